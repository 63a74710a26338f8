"""Command-line client: ``python3 -m stowage_client --target HOST:PORT <command> ...``.

Commands:
  generate   run one request, write the image (--out) and print its statistics
  stream     the same, printing progress events as they arrive
  pipelines  list the server's pipelines and their components

Admin commands (need --token or $STOWAGE_TOKEN):
  placement              the device's memory, the strategy and every component's placement
  set-strategy           replace the offload strategy (--footprint, --custom NAME, --rules-file)
  enable-group-offload   group-offload a component (--component ID) or pipeline (--pipeline NAME)
  disable-group-offload  remove group offloading again
  load-pipeline          load a built-in architecture under a new pipeline name
  unload-pipeline        stop serving a pipeline (waits for its in-flight requests)
  placement-log          the newest placement decisions, oldest first

Connection options (before the command): --target HOST:PORT, --timeout, --token, and --tls with
optional --ca-cert FILE.pem and --server-name NAME for a server with TLS on.

Exit status: 0 on success, 1 when the RPC (or writing --out) fails, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime
from typing import Any

from google.protobuf import json_format

from stowage.v1 import config_pb2
from stowage_client.admin import AdminClient, ComponentPlacementInfo, Decision, PlacementInfo
from stowage_client.client import (
    GenerationResult,
    PipelineInfo,
    ProgressEvent,
    StowageClient,
    StowageError,
)

DEFAULT_TARGET = "127.0.0.1:50051"  # The server's default grpc_address.
_UINT64_MAX = 2**64 - 1
_MAX_LOG_LIMIT = 4096  # GetPlacementLogRequest.limit's upper bound.
ADMIN_COMMANDS = frozenset(
    {
        "placement",
        "set-strategy",
        "enable-group-offload",
        "disable-group-offload",
        "load-pipeline",
        "unload-pipeline",
        "placement-log",
    }
)


def format_bytes(n: int) -> str:
    """Formats a byte count with binary (IEC) units: 512 B, 1.5 KiB, 3.2 GiB."""
    if abs(n) < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "PiB":
            break
    return f"{value:.1f} {unit}"


def format_count(n: int) -> str:
    """Formats a parameter count the way model sizes are usually quoted: 950, 1.2K, 6.0B."""
    if abs(n) < 1000:
        return str(n)
    value = float(n)
    for unit in ("K", "M", "B", "T"):
        value /= 1000
        if abs(value) < 1000 or unit == "T":
            break
    return f"{value:.1f}{unit}"


def _format_seconds(s: float) -> str:
    return f"{s:.3f} s"


def _table(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """Left-aligns columns; the last column is not padded so lines carry no trailing spaces."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [
        indent + "  ".join([c.ljust(w) for c, w in zip(row, widths)] + [row[-1]]).rstrip()
        for row in rows
    ]


def format_result(result: GenerationResult, out: str | None) -> list[str]:
    """The human-readable summary of a result and its statistics, one table row per line."""
    stats = result.stats
    image = f"{result.width}x{result.height}, {format_bytes(len(result.image))}"
    rows = [
        ["request id", result.request_id],
        ["pipeline", result.pipeline],
        ["seed", str(result.seed)],
        ["image", image + (f" -> {out}" if out else " (not saved; use --out)")],
        ["device", stats.device],
        ["queue wait", _format_seconds(stats.queue_wait_s)],
        ["run time", _format_seconds(stats.run_time_s)],
    ]
    if stats.batch_size > 1:
        rows.insert(-1, ["batch", f"{stats.batch_size} requests (held open {_format_seconds(stats.batch_wait_s)}); "
                                  "shared figures are the batch's"])
    rows += [[f"  {name}", _format_seconds(s) + (" (shared)" if name in stats.shared_stages else "")]
             for name, s in stats.stages.items()]
    rows += [
        ["peak device memory", format_bytes(stats.peak_device_memory_bytes)],
        ["peak reserved", format_bytes(stats.peak_device_reserved_bytes)],
        ["peak CPU RSS", format_bytes(stats.peak_cpu_rss_bytes)],
        ["host to device", format_bytes(stats.host_to_device_bytes)],
        ["device to host", format_bytes(stats.device_to_host_bytes)],
    ]
    return _table(rows)


def result_to_json(result: GenerationResult, out: str | None) -> dict[str, Any]:
    """The machine-readable form of a result: everything but the image bytes."""
    return {
        "request_id": result.request_id,
        "pipeline": result.pipeline,
        "seed": result.seed,
        "width": result.width,
        "height": result.height,
        "image_bytes": len(result.image),
        "out": out,
        "stats": asdict(result.stats),
    }


def format_progress(event: ProgressEvent) -> str:
    """One line per progress event: elapsed time, stage, and the step during denoising."""
    line = f"{event.elapsed_s:9.3f} s  {event.stage}"
    if event.step:
        line += f" {event.step}/{event.total_steps}"
    return line


def format_pipelines(pipelines: Sequence[PipelineInfo]) -> list[str]:
    """Each pipeline with its limits and a table of its components."""
    if not pipelines:
        return ["no pipelines"]
    lines: list[str] = []
    for p in pipelines:
        if lines:
            lines.append("")
        title = p.name + (" (default)" if p.is_default else "") + f" on {p.device}"
        lines.append(title + (f": {p.description}" if p.description else ""))
        lines.append(
            f"  defaults: {p.default_width}x{p.default_height}, {p.default_inference_steps} steps, "
            f"guidance {p.default_guidance_scale:g}"
        )
        lines.append(
            f"  limits: size {p.min_size} to {p.max_size} in multiples of {p.size_multiple}, "
            f"at most {p.max_inference_steps} steps, prompt at most {p.max_prompt_bytes} bytes"
        )
        rows = [["component", "kind", "dtype", "weights", "parameters"]]
        rows += [
            [c.name, c.kind, c.dtype, format_bytes(c.weight_bytes), format_count(c.parameter_count)]
            for c in p.components
        ]
        rows.append(
            [
                "total",
                "",
                "",
                format_bytes(p.total_weight_bytes),
                format_count(sum(c.parameter_count for c in p.components)),
            ]
        )
        lines += _table(rows, indent="  ")
    return lines


def _group_summary(c: ComponentPlacementInfo) -> str:
    g = c.group_offload
    if g is None:
        return "-"
    return f"{g.groups} ({g.streamed_groups} streamed, {g.resident_groups} resident)"


def format_components(components: Sequence[ComponentPlacementInfo]) -> list[str]:
    """A table of components: placement state, device and weight bytes, group offloading."""
    if not components:
        return ["no components"]
    rows = [["component", "state", "on device", "weights", "groups", "kind", "pipelines"]]
    rows += [
        [
            c.id,
            c.state,
            format_bytes(c.device_bytes),
            format_bytes(c.weight_bytes),
            _group_summary(c),
            c.kind,
            ",".join(c.pipelines),
        ]
        for c in components
    ]
    return _table(rows)


def format_placement(p: PlacementInfo) -> list[str]:
    """The device and strategy summary, the component table, then one line per warning."""
    if p.free_bytes is None:
        memory = f"{format_bytes(p.allocated_bytes)} allocated, no budget"
    else:
        memory = (
            f"{format_bytes(p.allocated_bytes)} allocated of {format_bytes(p.budget_bytes)} "
            f"({format_bytes(p.free_bytes)} free)"
        )
    lines = _table(
        [
            ["device", p.device],
            ["memory", memory],
            ["strategy", p.strategy],
            ["OOM recoveries", str(p.oom_recoveries)],
        ]
        + (
            [
                [
                    "prefetched",
                    f"{p.pipeline_prefetches} components of the next pipeline "
                    f"({format_bytes(p.pipeline_prefetch_bytes)}), {p.pipeline_prefetches_used} used, "
                    f"{p.pipeline_prefetches_unused} moved off unused",
                ]
            ]
            if p.pipeline_prefetches
            else []
        )
        + ([["cache margin", format_bytes(p.cache_margin_bytes)]] if p.cache_margin_bytes else [])
        + (
            [["allocator ran short", f"{p.allocator_retries} retries, {p.allocator_ooms} OOMs"]]
            if p.allocator_retries or p.allocator_ooms
            else []
        )
    )
    lines.append("")
    lines += format_components(p.components)
    lines += [f"warning: {w}" for w in p.warnings]
    return lines


def _format_time(t: datetime) -> str:
    # UTC with milliseconds: decisions of one request are milliseconds apart.
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def _format_free(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def format_decisions(decisions: Sequence[Decision]) -> list[str]:
    """One row per decision, oldest first; "-" marks an empty field or a device without budget."""
    if not decisions:
        return ["no placement decisions"]
    rows = [["time (UTC)", "request", "action", "component", "bytes", "free before -> after",
             "strategy", "reason"]]
    rows += [
        [
            _format_time(d.time),
            d.request_id or "-",
            d.action,
            d.component or "-",
            format_bytes(d.bytes),
            f"{_format_free(d.free_before)} -> {_format_free(d.free_after)}",
            d.strategy or "-",
            d.reason,
        ]
        for d in decisions
    ]
    return _table(rows)


def _json_default(value: Any) -> Any:
    """json.dumps fallback: datetimes as ISO 8601 (UTC, with offset)."""
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _dumps(value: Any) -> str:
    return json.dumps(value, indent=2, default=_json_default)


def _seed(text: str) -> int:
    value = int(text)
    if not 0 <= value <= _UINT64_MAX:
        raise argparse.ArgumentTypeError(f"seed must be in [0, {_UINT64_MAX}], got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _log_limit(text: str) -> int:
    value = int(text)
    if not 1 <= value <= _MAX_LOG_LIMIT:
        raise argparse.ArgumentTypeError(f"must be in [1, {_MAX_LOG_LIMIT}], got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m stowage_client",
        description="Client for the Stowage text-to-image inference server.",
    )
    parser.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        metavar="HOST:PORT",
        help=f"server address (default {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        metavar="SECONDS",
        help="deadline of each call (default: none)",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="connect with TLS (the server's config has tls { cert_file key_file })",
    )
    parser.add_argument(
        "--ca-cert",
        "--ca_cert",
        dest="ca_cert",
        metavar="FILE.pem",
        help="with --tls: the CA certificates that verify the server (default: the system's roots)",
    )
    parser.add_argument(
        "--server-name",
        "--server_name",
        dest="server_name",
        metavar="NAME",
        help="with --tls: the name the server's certificate carries, when not the --target host",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("STOWAGE_TOKEN"),
        help="bearer token sent as 'authorization: Bearer TOKEN'; required by the admin commands "
        "(default: $STOWAGE_TOKEN, which keeps it out of the process list)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    request = argparse.ArgumentParser(add_help=False)
    request.add_argument("--prompt", required=True, help="the text to depict")
    request.add_argument("--negative-prompt", default="", help="text to steer away from")
    request.add_argument("--width", type=int, default=0, help="pixels; 0: pipeline default")
    request.add_argument("--height", type=int, default=0, help="pixels; 0: pipeline default")
    request.add_argument("--steps", type=int, default=0, help="denoising steps; 0: default")
    request.add_argument("--guidance", type=float, help="guidance scale (default: pipeline's)")
    request.add_argument("--seed", type=_seed, help="noise seed (default: random)")
    request.add_argument("--pipeline", default="", help="pipeline name (default: server's)")
    request.add_argument("--request-id", default="", help="identifier echoed in server logs")
    request.add_argument("--out", metavar="FILE.png", help="where to write the image")
    request.add_argument("--json", action="store_true", help="print statistics as JSON")

    commands.add_parser(
        "generate", parents=[request], help="run one request and print its statistics"
    )
    commands.add_parser(
        "stream", parents=[request], help="like generate, printing progress as it arrives"
    )
    pipelines = commands.add_parser("pipelines", help="list pipelines and their components")
    pipelines.add_argument("--json", action="store_true", help="print as JSON")
    _add_admin_commands(commands)
    return parser


def _add_target_options(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--component", metavar="ID", help="one component: PIPELINE/COMPONENT")
    target.add_argument("--pipeline", metavar="NAME", help="every component of a pipeline")


def _add_admin_commands(commands: argparse._SubParsersAction) -> None:
    placement = commands.add_parser(
        "placement", help="[admin] device memory, strategy and every component's placement"
    )
    placement.add_argument("--json", action="store_true", help="print as JSON")

    strategy = commands.add_parser("set-strategy", help="[admin] replace the offload strategy")
    which = strategy.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--footprint", action="store_true", help="evict the fewest bytes that let a component fit"
    )
    which.add_argument(
        "--custom", metavar="NAME", help="a strategy registered in the server, e.g. lru"
    )
    which.add_argument(
        "--rules-file",
        metavar="FILE.json",
        help="workflow rules: a stowage.v1.WorkflowStrategy message as JSON, e.g. "
        '{"rules": [{"after": {"component": "text_encoder", "offload": ["text_encoder"]}}, '
        '{"keep_resident": "vae"}]}',
    )
    strategy.add_argument(
        "--reserve-bytes",
        type=_non_negative_int,
        metavar="N",
        help="with --footprint: device bytes to keep free (default 0)",
    )
    strategy.add_argument("--json", action="store_true", help="print as JSON")

    enable = commands.add_parser(
        "enable-group-offload", help="[admin] group-offload a component or a whole pipeline"
    )
    _add_target_options(enable)
    enable.add_argument(
        "--leaf", action="store_true", help="one group per leaf layer (default: blocks)"
    )
    enable.add_argument(
        "--blocks-per-group", type=_positive_int, default=1, metavar="N",
        help="block level: consecutive blocks per group (default 1)",
    )
    enable.add_argument(
        "--no-stream", action="store_true", help="copy groups synchronously (no prefetching)"
    )
    enable.add_argument(
        "--prefetch-depth", type=_positive_int, default=0, metavar="N",
        help="groups copied ahead while one computes (default: the server's, 4 at leaf level "
        "without a budget, else 1)",
    )
    enable.add_argument(
        "--block-module", action="append", default=[], metavar="PATH", dest="block_modules",
        help="block level: a module whose children are the blocks (repeatable; default: every "
        "block list)",
    )
    enable.add_argument(
        "--staging-buffer-bytes", type=_positive_int, default=0, metavar="N",
        help="pageable/disk targets: staging buffer size (default: the server's, 64 MiB)",
    )
    enable.add_argument(
        "--staging-buffers", type=_positive_int, default=0, metavar="N",
        help="pageable/disk targets: staging buffers (default: the server's, 2)",
    )
    enable.add_argument(
        "--compress", choices=("none", "int8", "fp8", "int8_grouped", "int4", "auto"), default="none",
        help="pinned target: stream compressed weights (int8 / fp8 per channel, int8 per 128 values, int4 per "
        "16), widened on the device; auto: the server chooses under the device's host_memory_budget_bytes",
    )
    enable.add_argument(
        "--no-pin-in-place", action="store_true",
        help="pageable target: always stage through the ring instead of pinning the host copy "
        "where it lies",
    )
    # dest differs from the global --target (the server address), which it must not overwrite.
    enable.add_argument(
        "--target",
        dest="offload_target",
        choices=["pinned", "pageable", "disk"],
        default="pinned",
        help="where the weights wait: pinned or pageable host memory, or disk (default pinned)",
    )
    enable.add_argument(
        "--disk-dir", default="", metavar="DIR", help="group files for --target disk"
    )
    enable.add_argument(
        "--budget-bytes", type=_non_negative_int, default=0, metavar="N",
        help="device bytes the component may keep; groups that fit stay resident (default 0)",
    )
    enable.add_argument(
        "--exclude", nargs="+", action="extend", default=[], metavar="NAME",
        help="with --pipeline: component names to leave alone",
    )
    enable.add_argument("--json", action="store_true", help="print as JSON")

    disable = commands.add_parser(
        "disable-group-offload", help="[admin] remove group offloading"
    )
    _add_target_options(disable)
    disable.add_argument("--json", action="store_true", help="print as JSON")

    load = commands.add_parser("load-pipeline", help="[admin] load and serve a new pipeline")
    load.add_argument("name", help="the new pipeline's name, [a-z0-9_-]{1,64}")
    load.add_argument("--builtin", default="zimage-tiny",
                      help="built-in architecture: zimage-tiny (default) or tiny")
    load.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    load.add_argument("--weight-seed", type=_seed, default=0, help="seed of the random weights")
    load.add_argument("--model-dir", help="a diffusers-format directory on the server instead of --builtin")
    load.add_argument("--random-weights", action="store_true",
                      help="with --model-dir: read only the config.json files, draw the weights")
    load.add_argument("--json", action="store_true", help="print as JSON")

    unload = commands.add_parser(
        "unload-pipeline", help="[admin] stop serving a pipeline (waits for in-flight requests)"
    )
    unload.add_argument("name", help="pipeline name")

    log = commands.add_parser("placement-log", help="[admin] the newest placement decisions")
    log.add_argument(
        "--limit", type=_log_limit, default=100, metavar="N",
        help=f"at most N decisions, 1 to {_MAX_LOG_LIMIT} (default 100)",
    )
    log.add_argument("--json", action="store_true", help="print as JSON")


def _check_admin_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage checks argparse cannot express; exits 2 (through parser.error) before any call.

    Also parses --rules-file into ``args.strategy``, so that a bad file is a usage error and
    nothing is sent.
    """
    if not args.token:
        parser.error(f"{args.command} needs the admin token: --token TOKEN or $STOWAGE_TOKEN")
    if args.command == "set-strategy":
        if args.reserve_bytes is not None and not args.footprint:
            parser.error("--reserve-bytes goes with --footprint")
        args.strategy = config_pb2.OffloadStrategy()
        if args.footprint:
            args.strategy.footprint.reserve_bytes = args.reserve_bytes or 0
            args.strategy.footprint.SetInParent()
        elif args.custom is not None:
            args.strategy.custom = args.custom
        else:
            args.strategy.workflow.CopyFrom(_read_rules(parser, args.rules_file))
            args.strategy.workflow.SetInParent()
    elif args.command == "enable-group-offload" and args.component and args.exclude:
        parser.error("--exclude goes with --pipeline, not --component")


def _read_rules(parser: argparse.ArgumentParser, path: str) -> config_pb2.WorkflowStrategy:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        parser.error(f"--rules-file: cannot read {path}: {e.strerror or e}")
    try:
        # protobuf's own JSON mapping: accepts keep_resident and keepResident, refuses unknown
        # fields, so a typo is an error here rather than a silently empty rule.
        return json_format.Parse(text, config_pb2.WorkflowStrategy())
    except json_format.ParseError as e:
        parser.error(f"--rules-file: {path} is not a stowage.v1.WorkflowStrategy in JSON: {e}")


def _request_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "negative_prompt": args.negative_prompt,
        "width": args.width,
        "height": args.height,
        "steps": args.steps,
        "guidance_scale": args.guidance,
        "seed": args.seed,
        "pipeline": args.pipeline,
        "request_id": args.request_id,
    }


class _OutputError(Exception):
    """The result arrived but could not be saved; reported like an RPC failure (exit 1)."""


def _finish(result: GenerationResult, args: argparse.Namespace) -> None:
    if args.out:
        try:
            with open(args.out, "wb") as f:
                f.write(result.image)
        except OSError as e:
            raise _OutputError(f"cannot write {args.out}: {e.strerror or e}") from e
    if args.json:
        record = result_to_json(result, args.out)
        if args.command == "stream":
            record = {"event": "result", **record}
        print(json.dumps(record))
    else:
        print("\n".join(format_result(result, args.out)))


def _run(client: StowageClient, args: argparse.Namespace) -> None:
    if args.command == "pipelines":
        pipelines = client.list_pipelines()
        if args.json:
            print(json.dumps([asdict(p) for p in pipelines], indent=2))
        else:
            print("\n".join(format_pipelines(pipelines)))
    elif args.command == "generate":
        _finish(client.generate(args.prompt, **_request_kwargs(args)), args)
    elif args.command == "stream":
        for item in client.stream(args.prompt, **_request_kwargs(args)):
            if isinstance(item, ProgressEvent):
                if args.json:
                    print(json.dumps({"event": "progress", **asdict(item)}), flush=True)
                else:
                    print(format_progress(item), flush=True)
            else:
                _finish(item, args)
    else:  # pragma: no cover - argparse only accepts the commands above
        raise AssertionError(args.command)


def _print_components(components: Sequence[ComponentPlacementInfo], as_json: bool) -> None:
    if as_json:
        print(_dumps([asdict(c) for c in components]))
    else:
        print("\n".join(format_components(components)))


def _run_admin(client: AdminClient, args: argparse.Namespace) -> None:
    if args.command == "placement":
        placement = client.get_placement()
        if args.json:
            print(_dumps({**asdict(placement), "free_bytes": placement.free_bytes}))
        else:
            print("\n".join(format_placement(placement)))
    elif args.command == "set-strategy":
        name, warnings = client.set_offload_strategy(args.strategy)
        if args.json:
            print(_dumps({"strategy": name, "warnings": warnings}))
        else:
            print(f"strategy: {name}")
            for warning in warnings:
                print(f"warning: {warning}")
    elif args.command == "enable-group-offload":
        components = client.enable_group_offload(
            args.component,
            args.pipeline,
            offload_type="leaf" if args.leaf else "block",
            num_blocks_per_group=args.blocks_per_group,
            use_stream=not args.no_stream,
            prefetch_depth=args.prefetch_depth,
            target=args.offload_target,
            disk_dir=args.disk_dir,
            budget_bytes=args.budget_bytes,
            block_modules=args.block_modules,
            staging_buffer_bytes=args.staging_buffer_bytes,
            staging_buffers=args.staging_buffers,
            pin_in_place=not args.no_pin_in_place,
            compress=args.compress,
            exclude=args.exclude,
        )
        _print_components(components, args.json)
    elif args.command == "disable-group-offload":
        _print_components(client.disable_group_offload(args.component, args.pipeline), args.json)
    elif args.command == "load-pipeline":
        pipeline = client.load_pipeline(
            args.name, builtin=args.builtin, dtype=args.dtype, weight_seed=args.weight_seed,
            model_dir=args.model_dir, random_weights=args.random_weights,
        )
        if args.json:
            print(_dumps(asdict(pipeline)))
        else:
            print("\n".join(format_pipelines([pipeline])))
    elif args.command == "unload-pipeline":
        client.unload_pipeline(args.name)
        print(f"unloaded pipeline {args.name}")
    elif args.command == "placement-log":
        decisions = client.placement_log(args.limit)
        if args.json:
            print(_dumps([asdict(d) for d in decisions]))
        else:
            print("\n".join(format_decisions(decisions)))
    else:  # pragma: no cover - argparse only accepts the commands above
        raise AssertionError(args.command)


def _tls_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The clients' TLS keyword arguments from --tls/--ca-cert/--server-name (usage errors exit 2)."""
    if not args.tls:
        if args.ca_cert or args.server_name:
            parser.error("--ca-cert and --server-name need --tls")
        return {}
    root_certificates = None
    if args.ca_cert:
        try:
            with open(args.ca_cert, "rb") as f:
                root_certificates = f.read()
        except OSError as e:
            parser.error(f"cannot read --ca-cert {args.ca_cert!r}: {e.strerror}")
        if not root_certificates:
            parser.error(f"--ca-cert {args.ca_cert!r} is empty")
    return {"tls": True, "root_certificates": root_certificates, "server_name": args.server_name}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status.

    Usage errors exit through argparse's SystemExit(2), as every argparse program does.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    admin = args.command in ADMIN_COMMANDS
    if admin:
        _check_admin_args(parser, args)
    tls = _tls_args(parser, args)
    metadata = [("authorization", f"Bearer {args.token}")] if args.token else None
    try:
        if admin:
            with AdminClient(args.target, args.token, timeout=args.timeout, **tls) as admin_client:
                _run_admin(admin_client, args)
        else:
            with StowageClient(args.target, timeout=args.timeout, metadata=metadata, **tls) as client:
                _run(client, args)
    except (StowageError, _OutputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Leaving the with-block closed the channel, which cancels the request on the server.
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
