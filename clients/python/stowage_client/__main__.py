"""Command-line client: ``python3 -m stowage_client --target HOST:PORT <command> ...``.

Commands:
  generate   run one request, write the image (--out) and print its statistics
  stream     the same, printing progress events as they arrive
  pipelines  list the server's pipelines and their components

Exit status: 0 on success, 1 when the RPC (or writing --out) fails, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from stowage_client.client import (
    GenerationResult,
    PipelineInfo,
    ProgressEvent,
    StowageClient,
    StowageError,
)

DEFAULT_TARGET = "127.0.0.1:50051"  # The server's default grpc_address.
_UINT64_MAX = 2**64 - 1


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
    rows += [[f"  {name}", _format_seconds(s)] for name, s in stats.stages.items()]
    rows += [
        ["peak device memory", format_bytes(stats.peak_device_memory_bytes)],
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


def _seed(text: str) -> int:
    value = int(text)
    if not 0 <= value <= _UINT64_MAX:
        raise argparse.ArgumentTypeError(f"seed must be in [0, {_UINT64_MAX}], got {value}")
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
        "--token",
        default=os.environ.get("STOWAGE_TOKEN"),
        help="bearer token sent as 'authorization: Bearer TOKEN' (default: $STOWAGE_TOKEN, "
        "which keeps it out of the process list)",
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
    return parser


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


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status.

    Usage errors exit through argparse's SystemExit(2), as every argparse program does.
    """
    args = build_parser().parse_args(argv)
    metadata = [("authorization", f"Bearer {args.token}")] if args.token else None
    try:
        with StowageClient(args.target, timeout=args.timeout, metadata=metadata) as client:
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
