"""Typed wrapper around the Stowage AdminService gRPC API (placement inspection and control).

Like ``client.py``, it exists so that callers deal in plain Python values (dataclasses, state
names as strings, ``datetime`` for timestamps) and in one exception type (``StowageError``), and
so that the admin bearer token is attached to every call in one place instead of by each caller.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Dict, Optional

import grpc

try:
    from stowage.v1 import admin_pb2, admin_pb2_grpc, config_pb2
except ImportError as e:  # pragma: no cover - depends on the environment
    # Same reason as in client.py: the stubs are build outputs, so a missing import almost always
    # means PYTHONPATH lacks the stubs directory (or it predates admin.proto).
    raise ImportError(
        "stowage_client needs the generated stubs for stowage/v1/admin.proto and config.proto; "
        "put the directory that contains stowage/v1/admin_pb2.py on PYTHONPATH"
    ) from e

from google.protobuf import timestamp_pb2

from stowage_client.client import (
    AdapterInfo,
    PipelineInfo,
    StowageError,
    _ChannelClient,
    _adapter_from_proto,
    _pipeline_from_proto,
    make_channel,
)

__all__ = [
    "AdminClient",
    "ComponentPlacementInfo",
    "Decision",
    "DeviceStatusInfo",
    "GroupOffloadInfo",
    "PlacementInfo",
    "WorkflowRuleSpec",
    "workflow_rule",
]

TOKEN_ENV = "STOWAGE_TOKEN"
"""Environment variable the token is read from when the constructor is given none."""

WorkflowRuleSpec = Mapping[str, Any]
"""One workflow rule as a one-key dict: ``{"after": (component, [offload, ...])}``,
``{"before": (component, [offload, ...])}`` or ``{"keep_resident": component}``."""

_OFFLOAD_TYPES = {
    "block": config_pb2.GroupOffloadConfig.BLOCK_LEVEL,
    "leaf": config_pb2.GroupOffloadConfig.LEAF_LEVEL,
}
_TARGETS = {
    "pinned": config_pb2.GroupOffloadConfig.PINNED_HOST,
    "pageable": config_pb2.GroupOffloadConfig.PAGEABLE_HOST,
    "disk": config_pb2.GroupOffloadConfig.DISK,
}
_COMPRESS = {
    "none": config_pb2.GroupOffloadConfig.COMPRESS_NONE,
    "int8": config_pb2.GroupOffloadConfig.COMPRESS_INT8,
    "fp8": config_pb2.GroupOffloadConfig.COMPRESS_FP8,
    "int8_grouped": config_pb2.GroupOffloadConfig.COMPRESS_INT8_GROUPED,
    "int4": config_pb2.GroupOffloadConfig.COMPRESS_INT4,
    "auto": config_pb2.GroupOffloadConfig.COMPRESS_AUTO,  # Placement chooses under the host budget.
}


@dataclass(frozen=True)
class GroupOffloadInfo:
    """Statistics of a group-offloaded component: how its groups stream through its slots."""

    groups: int
    streamed_groups: int
    resident_groups: int
    slots: int
    slot_bytes: int
    working_set_bytes: int
    forwards: int
    prefetches: int
    sync_onloads: int
    pinned_in_place_bytes: int = 0
    pin_in_place_error: str = ""
    compress: str = ""  # "", "int8", "fp8_e4m3", "int8_grouped" or "int4" (compressed transfer).
    compressed_host_bytes: int = 0
    scratch_bytes: int = 0
    bytes_per_forward: int = 0
    # FP8 weights whose int4 copy was made with their FP8 form in one pass at load.
    one_pass_fp8_weights: int = 0


@dataclass(frozen=True)
class ComponentPlacementInfo:
    """Where one component's weights are.

    ``id`` is ``"<pipeline>/<component>"``; ``state`` is the proto enum's name: ``"OFFLOADED"``
    (host only), ``"RESIDENT"`` (all weights on the device) or ``"GROUP_OFFLOADED"`` (it places
    itself; ``group_offload`` is then set). A state newer than this client reads ``"STATE_<n>"``.
    ``device_bytes`` is what it holds on the device now. ``last_use`` is None before its first run.
    """

    id: str
    name: str
    kind: str
    pipelines: list[str]
    weight_bytes: int
    device_bytes: int
    state: str
    last_use: datetime | None = None
    group_offload: GroupOffloadInfo | None = None
    lifecycle: str = ""  # "LOADING", "READY" or "UNLOADING".


@dataclass(frozen=True)
class PlacementInfo:
    """The device, its memory, the offload strategy and every component's placement.

    ``budget_bytes`` is 0 when the device has no limit (the simulated device by default).
    """

    device: str
    budget_bytes: int
    allocated_bytes: int
    strategy: str
    components: list[ComponentPlacementInfo]
    warnings: list[str]
    oom_recoveries: int
    # Cross-pipeline prefetch (device.prefetch_next_pipeline): started, their bytes, used, unused.
    pipeline_prefetches: int = 0
    pipeline_prefetch_bytes: int = 0
    pipeline_prefetches_used: int = 0
    pipeline_prefetches_unused: int = 0
    # Runs this device began (its requests and batches, other devices' requests run here).
    runs_begun: int = 0
    # What the spare-room caches leave free beyond what runs allocate (0: caches off).
    cache_margin_bytes: int = 0
    # Times the allocator ran short of room under its cap since the server started: allocations it
    # retried after giving back its cached blocks, and out-of-memory errors (recovered from or not).
    allocator_retries: int = 0
    allocator_ooms: int = 0

    # Held outside the allocator (CUDA context and libraries): a budget counts it.
    context_bytes: int = 0

    @property
    def free_bytes(self) -> int | None:
        """Budget minus allocated bytes; None when the device has no budget."""
        return self.budget_bytes - self.allocated_bytes if self.budget_bytes else None


@dataclass(frozen=True)
class DeviceStatusInfo:
    """A device of the server: whether it drains, its requests in flight, the pipelines with a
    READY replica on it and the components it runs for pipelines homed elsewhere."""

    device: str
    draining: bool
    in_flight: int
    pipelines: list[str]
    guest_components: list[str]


@dataclass(frozen=True)
class Decision:
    """One placement decision from the server's bounded log.

    ``action`` is for example "onload", "offload", "group_offload", "oom", "set_strategy" or
    "unregister"; ``component`` is a component id ("" for "set_strategy"). ``free_before`` and
    ``free_after`` are free device bytes, None when the device has no budget (the wire's -1).
    ``time`` is timezone-aware UTC.
    """

    time: datetime
    request_id: str
    component: str
    action: str
    bytes: int
    free_before: int | None
    free_after: int | None
    strategy: str
    reason: str


def _datetime(ts: timestamp_pb2.Timestamp) -> datetime:
    # By hand rather than Timestamp.ToDatetime(tzinfo=...), whose tz support depends on the
    # protobuf version; microsecond precision is what datetime holds.
    return datetime.fromtimestamp(ts.seconds, tz=timezone.utc) + timedelta(
        microseconds=ts.nanos // 1000
    )


def _state_name(value: int) -> str:
    try:
        return admin_pb2.ComponentPlacement.State.Name(value)
    except ValueError:  # An enum value added after this client was generated.
        return f"STATE_{value}"


def _lifecycle_name(value: int) -> str:
    if value == admin_pb2.ComponentPlacement.LIFECYCLE_UNSPECIFIED:
        return ""  # A server older than lifecycles.
    try:
        return admin_pb2.ComponentPlacement.Lifecycle.Name(value)
    except ValueError:  # A value added after this client was generated.
        return f"LIFECYCLE_{value}"


def _free(value: int) -> int | None:
    return None if value < 0 else value


def _component_from_proto(msg: admin_pb2.ComponentPlacement) -> ComponentPlacementInfo:
    group = None
    if msg.HasField("group_offload"):
        g = msg.group_offload
        group = GroupOffloadInfo(
            groups=g.groups,
            streamed_groups=g.streamed_groups,
            resident_groups=g.resident_groups,
            slots=g.slots,
            slot_bytes=g.slot_bytes,
            working_set_bytes=g.working_set_bytes,
            forwards=g.forwards,
            prefetches=g.prefetches,
            sync_onloads=g.sync_onloads,
            pinned_in_place_bytes=g.pinned_in_place_bytes,
            pin_in_place_error=g.pin_in_place_error,
            compress="" if g.compress == "none" else g.compress,
            compressed_host_bytes=g.compressed_host_bytes,
            scratch_bytes=g.scratch_bytes,
            bytes_per_forward=g.bytes_per_forward,
            one_pass_fp8_weights=g.one_pass_fp8_weights,
        )
    return ComponentPlacementInfo(
        id=msg.id,
        name=msg.name,
        kind=msg.kind,
        pipelines=list(msg.pipelines),
        weight_bytes=msg.weight_bytes,
        device_bytes=msg.device_bytes,
        state=_state_name(msg.state),
        last_use=_datetime(msg.last_use) if msg.HasField("last_use") else None,
        group_offload=group,
        lifecycle=_lifecycle_name(msg.lifecycle),
    )


def _placement_from_proto(msg: admin_pb2.GetPlacementResponse) -> PlacementInfo:
    return PlacementInfo(
        device=msg.device,
        budget_bytes=msg.budget_bytes,
        allocated_bytes=msg.allocated_bytes,
        strategy=msg.strategy,
        components=[_component_from_proto(c) for c in msg.components],
        warnings=list(msg.warnings),
        oom_recoveries=msg.oom_recoveries,
        pipeline_prefetches=msg.pipeline_prefetches,
        pipeline_prefetch_bytes=msg.pipeline_prefetch_bytes,
        pipeline_prefetches_used=msg.pipeline_prefetches_used,
        pipeline_prefetches_unused=msg.pipeline_prefetches_unused,
        runs_begun=msg.runs_begun,
        cache_margin_bytes=msg.cache_margin_bytes,
        allocator_retries=msg.allocator_retries,
        allocator_ooms=msg.allocator_ooms,
        context_bytes=msg.context_bytes,
    )


def _decision_from_proto(msg: admin_pb2.PlacementDecision) -> Decision:
    return Decision(
        time=_datetime(msg.time),
        request_id=msg.request_id,
        component=msg.component,
        action=msg.action,
        bytes=msg.bytes,
        free_before=_free(msg.free_before),
        free_after=_free(msg.free_after),
        strategy=msg.strategy,
        reason=msg.reason,
    )


def _trigger(kind: str, value: Any) -> config_pb2.WorkflowRule.Trigger:
    try:
        component, offload = value
    except (TypeError, ValueError):
        raise ValueError(
            f"a {kind!r} rule takes (component, [components to offload]), got {value!r}"
        ) from None
    # A bare string would otherwise be iterated character by character.
    names = [offload] if isinstance(offload, str) else list(offload)
    if not isinstance(component, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"a {kind!r} rule names components by string, got {value!r}")
    return config_pb2.WorkflowRule.Trigger(component=component, offload=names)


def workflow_rule(spec: WorkflowRuleSpec) -> config_pb2.WorkflowRule:
    """Converts one rule dict (see ``WorkflowRuleSpec``) to its message; ValueError if malformed.

    Checks only the shape: whether the names exist is the server's to say (INVALID_ARGUMENT
    naming the rule), since only it knows the loaded components.
    """
    if not isinstance(spec, Mapping) or len(spec) != 1:
        raise ValueError(
            f"a workflow rule is a dict with exactly one of 'after', 'before', 'keep_resident'; "
            f"got {spec!r}"
        )
    ((kind, value),) = spec.items()
    if kind == "after":
        return config_pb2.WorkflowRule(after=_trigger(kind, value))
    if kind == "before":
        return config_pb2.WorkflowRule(before=_trigger(kind, value))
    if kind == "keep_resident":
        if not isinstance(value, str):
            raise ValueError(f"'keep_resident' takes a component name, got {value!r}")
        return config_pb2.WorkflowRule(keep_resident=value)
    raise ValueError(f"unknown workflow rule {kind!r}; use 'after', 'before' or 'keep_resident'")


def _group_offload_config(
    *,
    offload_type: str,
    num_blocks_per_group: int,
    use_stream: bool,
    prefetch_depth: int,
    target: str,
    disk_dir: str,
    budget_bytes: int,
    block_modules: Sequence[str] = (),
    staging_buffer_bytes: int = 0,
    staging_buffers: int = 0,
    pin_in_place: bool = True,
    compress: str = "none",
) -> config_pb2.GroupOffloadConfig:
    if offload_type not in _OFFLOAD_TYPES:
        raise ValueError(
            f"offload_type must be one of {sorted(_OFFLOAD_TYPES)}, got {offload_type!r}"
        )
    if target not in _TARGETS:
        raise ValueError(f"target must be one of {sorted(_TARGETS)}, got {target!r}")
    if compress not in _COMPRESS:
        raise ValueError(f"compress must be one of {sorted(_COMPRESS)}, got {compress!r}")
    if isinstance(block_modules, str):
        raise ValueError("block_modules is a list of module paths, not a string")
    return config_pb2.GroupOffloadConfig(
        offload_type=_OFFLOAD_TYPES[offload_type],
        num_blocks_per_group=num_blocks_per_group,
        # Always sent: proto3's default (false) is not this client's default (true).
        use_stream=use_stream,
        prefetch_depth=prefetch_depth,
        target=_TARGETS[target],
        disk_dir=disk_dir,
        budget_bytes=budget_bytes,
        block_modules=list(block_modules),
        staging_buffer_bytes=staging_buffer_bytes,
        staging_buffers=staging_buffers,
        never_pin_in_place=not pin_in_place,
        compress=_COMPRESS[compress],
    )



# The per-component options an `overrides` entry may replace: the keyword arguments of
# enable_group_offload that map to GroupOffloadConfig, i.e. _group_offload_config's parameters.
_OPTION_KEYS = frozenset(inspect.signature(_group_offload_config).parameters)

def _one_target(component_id: str | None, pipeline: str | None) -> tuple[str, str]:
    """The (oneof field, value) of a component-or-pipeline target; ValueError unless exactly one."""
    if (component_id is None) == (pipeline is None):
        raise ValueError("give exactly one of component_id and pipeline")
    if component_id is not None:
        return "component_id", component_id
    assert pipeline is not None
    return "pipeline", pipeline


class AdminClient(_ChannelClient):
    """A connection to a Stowage server's AdminService.

    Args:
        target: the server address, for example "127.0.0.1:50051".
        token: the admin bearer token, sent as ``authorization: Bearer <token>`` with every call.
            None (or "") reads ``$STOWAGE_TOKEN``, which keeps it out of source and process lists.
        timeout: deadline in seconds applied to every call; None waits indefinitely. Note that
            unload_pipeline waits for the pipeline's in-flight requests.

    Raises:
        ValueError: no token was given and ``$STOWAGE_TOKEN`` is unset or empty. The server
            refuses every call without one (UNAUTHENTICATED), so failing here says why sooner.

    Wrong tokens fail per call with StowageError PERMISSION_DENIED; a server without a configured
    token answers FAILED_PRECONDITION. ``tls``, ``root_certificates`` and ``server_name`` are
    StowageClient's: plaintext by default, where the token travels in the clear (fine on
    loopback; use TLS elsewhere). Use the client as a context manager, or call close(), to release
    the channel. ``device`` ("cuda:1") is the device that placement, strategy, group-offload and
    placement-log calls act on on a server with several; "" is the server's first.
    """

    def __init__(
        self,
        target: str,
        token: str | None = None,
        timeout: float | None = None,
        *,
        tls: bool = False,
        root_certificates: bytes | None = None,
        server_name: str | None = None,
        device: str = "",
    ) -> None:
        token = token or os.environ.get(TOKEN_ENV, "")
        # The device the device-scoped calls act on ("cuda:1"); "" = the server's first.
        self._device = device
        if not token:
            raise ValueError(f"the admin API needs a token: pass token= or set ${TOKEN_ENV}")
        self._timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._channel = make_channel(
            target, tls=tls, root_certificates=root_certificates, server_name=server_name
        )
        self._stub = admin_pb2_grpc.AdminServiceStub(self._channel)

    def _call(self, method: str, request: Any) -> Any:
        # Device-scoped requests (placement, strategy, group offload, the log) name this client's
        # device unless the call named one.
        if self._device and "device" in type(request).DESCRIPTOR.fields_by_name and not request.device:
            request.device = self._device
        try:
            return getattr(self._stub, method)(
                request, timeout=self._timeout, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise StowageError.from_rpc_error(e) from None

    def get_placement(self) -> PlacementInfo:
        """The device's memory, the strategy and its warnings, and every component's placement.

        Raises:
            StowageError: the call failed.
        """
        return _placement_from_proto(self._call("GetPlacement", admin_pb2.GetPlacementRequest()))

    def set_offload_strategy(self, strategy: config_pb2.OffloadStrategy) -> tuple[str, list[str]]:
        """Replaces the strategy with a ready-made message (the set_strategy_* helpers build one).

        Returns:
            The new strategy's name and the server's warnings (for example a footprint strategy
            now managing a group-offloaded component).

        Raises:
            StowageError: INVALID_ARGUMENT naming the rule for a bad rule set, NOT_FOUND for an
                unknown custom strategy; the old strategy stays.
        """
        reply = self._call(
            "SetOffloadStrategy", admin_pb2.SetOffloadStrategyRequest(strategy=strategy)
        )
        return reply.strategy, list(reply.warnings)

    def set_strategy_footprint(self, reserve_bytes: int = 0) -> tuple[str, list[str]]:
        """Footprint: evict the fewest bytes that let the next component fit, keeping
        ``reserve_bytes`` free. See set_offload_strategy for the result and errors."""
        strategy = config_pb2.OffloadStrategy()
        # Assigned through the field, not left default: with reserve 0 the submessage is empty
        # and would otherwise leave the oneof unset, which the server refuses.
        strategy.footprint.reserve_bytes = reserve_bytes
        strategy.footprint.SetInParent()
        return self.set_offload_strategy(strategy)

    def set_strategy_custom(self, name: str) -> tuple[str, list[str]]:
        """A strategy registered by name in the server ("text-encoders-only", "lru"). See
        set_offload_strategy for the result and errors."""
        return self.set_offload_strategy(config_pb2.OffloadStrategy(custom=name))

    def set_strategy_workflow(self, rules: Iterable[WorkflowRuleSpec]) -> tuple[str, list[str]]:
        """Declarative rules, in order, for example::

            [{"after": ("text_encoder", ["text_encoder"])}, {"keep_resident": "vae"}]

        Raises:
            ValueError: a rule is malformed (nothing is sent).
            StowageError: see set_offload_strategy.
        """
        workflow = config_pb2.WorkflowStrategy(rules=[workflow_rule(r) for r in rules])
        strategy = config_pb2.OffloadStrategy()
        strategy.workflow.CopyFrom(workflow)
        # An empty rule list is still a workflow: set the oneof explicitly, as for footprint.
        strategy.workflow.SetInParent()
        return self.set_offload_strategy(strategy)

    def enable_group_offload(
        self,
        component_id: str | None = None,
        pipeline: str | None = None,
        *,
        offload_type: str = "block",
        num_blocks_per_group: int = 1,
        use_stream: bool = True,
        prefetch_depth: int = 0,
        target: str = "pinned",
        disk_dir: str = "",
        budget_bytes: int = 0,
        block_modules: Sequence[str] = (),
        staging_buffer_bytes: int = 0,
        staging_buffers: int = 0,
        pin_in_place: bool = True,
        compress: str = "none",
        exclude: Sequence[str] = (),
        overrides: Mapping[str, Mapping[str, Any] | config_pb2.GroupOffloadConfig] | None = None,
    ) -> list[ComponentPlacementInfo]:
        """Group-offloads one component ("<pipeline>/<component>") or every component of a
        pipeline (all or nothing).

        ``offload_type`` is "block" or "leaf"; ``target`` is "pinned", "pageable" or "disk" (which
        needs ``disk_dir``). ``prefetch_depth`` 0 takes the server's default (4 at leaf level without
        a budget, else 1). ``block_modules`` names the modules whose children are the blocks
        (default: every block list of the component). ``staging_buffer_bytes`` / ``staging_buffers``
        size the staging ring (0: the server's 64 MiB x 2). ``pin_in_place`` (pageable target): pin
        the host copy where it lies; False always stages through the ring. ``compress`` ("none",
        "int8", "fp8"; pinned target): stream 8-bit weights with per-channel scales, widened on the
        device (see the README's 8-bit transfer for the error it costs). Pipeline target only: ``exclude`` names components to leave alone and
        ``overrides`` maps a component name to a dict of these same options, whose missing keys take
        this call's values (the server replaces options whole, so the client fills them in), or to
        a GroupOffloadConfig message sent as is.

        Returns:
            The affected components, now GROUP_OFFLOADED.

        Raises:
            ValueError: not exactly one of component_id/pipeline, an unknown offload_type, target
                or override key, or exclude/overrides with component_id (nothing is sent).
            StowageError: e.g. NOT_FOUND, FAILED_PRECONDITION (already group-offloaded),
                INVALID_ARGUMENT naming the option; nothing changes.
        """
        field, value = _one_target(component_id, pipeline)
        if field == "component_id" and (exclude or overrides):
            raise ValueError("exclude and overrides apply to a pipeline target, not component_id")
        if isinstance(exclude, str):
            raise ValueError("exclude is a list of component names, not a string")
        options: dict[str, Any] = dict(
            offload_type=offload_type,
            num_blocks_per_group=num_blocks_per_group,
            use_stream=use_stream,
            prefetch_depth=prefetch_depth,
            target=target,
            disk_dir=disk_dir,
            budget_bytes=budget_bytes,
            block_modules=block_modules,
            staging_buffer_bytes=staging_buffer_bytes,
            staging_buffers=staging_buffers,
            pin_in_place=pin_in_place,
            compress=compress,
        )
        request = admin_pb2.EnableGroupOffloadRequest(
            options=_group_offload_config(**options), exclude=list(exclude)
        )
        setattr(request, field, value)
        for name, override in (overrides or {}).items():
            if isinstance(override, config_pb2.GroupOffloadConfig):  # Sent as given.
                request.overrides[name].CopyFrom(override)
                continue
            unknown = set(override) - _OPTION_KEYS
            if unknown:
                raise ValueError(
                    f"overrides[{name!r}]: unknown option(s) {sorted(unknown)}; "
                    f"use {sorted(_OPTION_KEYS)}"
                )
            try:
                config = _group_offload_config(**{**options, **override})
            except ValueError as e:
                raise ValueError(f"overrides[{name!r}]: {e}") from None
            request.overrides[name].CopyFrom(config)
        reply = self._call("EnableGroupOffload", request)
        return [_component_from_proto(c) for c in reply.components]

    def disable_group_offload(
        self, component_id: str | None = None, pipeline: str | None = None
    ) -> list[ComponentPlacementInfo]:
        """Removes group offloading from one component or from every group-offloaded component of
        a pipeline; they become OFFLOADED (resident again on next use).

        Raises:
            ValueError: not exactly one of component_id/pipeline.
            StowageError: e.g. NOT_FOUND, FAILED_PRECONDITION (nothing group-offloaded).
        """
        field, value = _one_target(component_id, pipeline)
        request = admin_pb2.DisableGroupOffloadRequest()
        setattr(request, field, value)
        reply = self._call("DisableGroupOffload", request)
        return [_component_from_proto(c) for c in reply.components]

    def load_pipeline(
        self,
        name: str,
        builtin: str = "zimage-tiny",
        dtype: str = "float32",
        weight_seed: int = 0,
        *,
        model_dir: str | None = None,
        random_weights: bool = False,
    ) -> PipelineInfo:
        """Loads a pipeline as ``name`` and starts serving it: a built-in architecture ("tiny",
        "zimage-tiny"), or, with ``model_dir``, a diffusers-format directory on the server's disk
        (``random_weights`` then reads only its config.json files).

        Raises:
            StowageError: ALREADY_EXISTS for a loaded name, INVALID_ARGUMENT for a bad name,
                builtin, dtype or directory, NOT_FOUND for a missing directory.
        """
        if model_dir is not None:
            config = config_pb2.PipelineConfig(
                name=name, model_dir=model_dir, dtype=dtype, weight_seed=weight_seed,
                random_weights=random_weights,
            )
        else:
            config = config_pb2.PipelineConfig(
                name=name, builtin=builtin, dtype=dtype, weight_seed=weight_seed
            )
        reply = self._call("LoadPipeline", admin_pb2.LoadPipelineRequest(pipeline=config))
        return _pipeline_from_proto(reply.pipeline)

    def set_batching(self, pipeline: str, max_batch_size: int, max_queue_delay_ms: int = 0) -> PipelineInfo:
        """Sets a READY pipeline's dynamic batching: at most ``max_batch_size`` requests (1 = off,
        up to 64) per batch, held open up to ``max_queue_delay_ms`` (0..60000) for more.

        Raises:
            StowageError: INVALID_ARGUMENT out of range, NOT_FOUND for a pipeline that is not READY.
        """
        request = admin_pb2.SetBatchingRequest(
            pipeline=pipeline,
            batching=config_pb2.BatchingConfig(max_batch_size=max_batch_size, max_queue_delay_ms=max_queue_delay_ms),
        )
        return _pipeline_from_proto(self._call("SetBatching", request).pipeline)

    def set_scheduler(
        self,
        max_reorder_delay_ms: int = 0,
        priority_mode: str = "strict",
        tenant_weights: Optional[Dict[str, float]] = None,
        tenant_queue_limit: int = 0,
        tenant_burst_work: Optional[float] = None,
        preemption: str = "none",
    ) -> "config_pb2.SchedulerConfig":
        """Replaces every device's request scheduler and returns the one now in force: how long a
        request may be passed over for one whose weights are on the device (0..60000 ms; 0 = first
        come, first served), ``priority_mode`` "strict" or "weighted", tenants' shares
        (weight in (0, 1000]), requests one tenant may have waiting (0 = off ..queue_depth), and
        the burst credit of a returning tenant (0..10000; None = the default, 32), and
        ``preemption`` between denoising steps: "none", "priority" (a higher priority waiting runs
        between the running request's steps) or "resident" (also a shorter request of a pipeline
        that moves nothing, each running request paused at most max_reorder_delay_ms, which must be
        above 0). Fair shares start afresh.

        Raises:
            StowageError: INVALID_ARGUMENT naming the field out of range (nothing changes).
        """
        modes = {"strict": config_pb2.SchedulerConfig.PRIORITY_STRICT,
                 "weighted": config_pb2.SchedulerConfig.PRIORITY_WEIGHTED}
        if priority_mode not in modes:
            raise ValueError(f"priority_mode must be 'strict' or 'weighted', not {priority_mode!r}")
        preemptions = {"none": config_pb2.SchedulerConfig.PREEMPTION_NONE,
                       "priority": config_pb2.SchedulerConfig.PREEMPTION_PRIORITY,
                       "resident": config_pb2.SchedulerConfig.PREEMPTION_RESIDENT}
        if preemption not in preemptions:
            raise ValueError(f"preemption must be 'none', 'priority' or 'resident', not {preemption!r}")
        scheduler = config_pb2.SchedulerConfig(
            priority_mode=modes[priority_mode],
            preemption=preemptions[preemption],
            max_reorder_delay_ms=max_reorder_delay_ms,
            tenant_weights=dict(tenant_weights or {}),
            tenant_queue_limit=tenant_queue_limit,
        )
        if tenant_burst_work is not None:
            scheduler.tenant_burst_work = tenant_burst_work
        return self._call("SetScheduler", admin_pb2.SetSchedulerRequest(scheduler=scheduler)).scheduler

    def get_scheduler(self) -> "config_pb2.SchedulerConfig":
        """The request scheduler in force (the config file's or the last set_scheduler's)."""
        return self._call("GetScheduler", admin_pb2.GetSchedulerRequest()).scheduler

    def unload_pipeline(self, name: str) -> None:
        """Stops serving a pipeline. Returns once its in-flight requests have finished and its
        components are gone (mind ``timeout``: on expiry the pipeline keeps serving).

        Raises:
            StowageError: NOT_FOUND for a pipeline that is not loaded.
        """
        self._call("UnloadPipeline", admin_pb2.UnloadPipelineRequest(name=name))

    def move_component(self, pipeline: str, component: str, device: str) -> PipelineInfo:
        """Moves one component of a one-device (or split) pipeline to ``device``, between the
        pipeline's requests; returns the pipeline afterwards (each component's device).

        Raises:
            StowageError: INVALID_ARGUMENT naming an unknown pipeline, component or device;
                FAILED_PRECONDITION for a pipeline with replicas.
        """
        request = admin_pb2.MoveComponentRequest(pipeline=pipeline, component=component, device=device)
        return _pipeline_from_proto(self._call("MoveComponent", request).pipeline)

    def drain_device(self, device: str, drain: bool = True) -> list[DeviceStatusInfo]:
        """Marks ``device`` draining (new requests go to other replicas; running ones finish), or
        serving again with ``drain=False``; returns every device's status.

        Raises:
            StowageError: NOT_FOUND for an unknown device.
        """
        reply = self._call("DrainDevice", admin_pb2.DrainDeviceRequest(device=device, drain=drain))
        return [DeviceStatusInfo(device=d.device, draining=d.draining, in_flight=d.in_flight,
                                 pipelines=list(d.pipelines), guest_components=list(d.guest_components))
                for d in reply.devices]

    def set_memory_budget(self, memory_budget_bytes: int, device: str = "") -> list[str]:
        """Changes ``device``'s memory budget (bytes, its context included; 0: the whole device)
        between requests; returns the ids of the components moved to the host to fit it, least
        recently used first.

        Raises:
            StowageError: INVALID_ARGUMENT for a negative budget, one above the device's memory or
                not above its context; FAILED_PRECONDITION when what cannot move does not fit (the
                budget is then unchanged); NOT_FOUND for an unknown device.
        """
        request = admin_pb2.SetMemoryBudgetRequest(memory_budget_bytes=memory_budget_bytes, device=device)
        return list(self._call("SetMemoryBudget", request).offloaded)

    def resume_device(self, device: str) -> list[DeviceStatusInfo]:
        """drain_device(device, drain=False)."""
        return self.drain_device(device, drain=False)

    def load_adapter(self, pipeline: str, name: str, path: str, alpha: float = 0.0) -> AdapterInfo:
        """Reads a LoRA adapter (a safetensors file on the server, PEFT / diffusers layout) and
        attaches it to a READY pipeline on every device hosting it; requests then name it
        (StowageClient.generate(loras={name: scale})). ``alpha`` is the LoRA alpha for layers whose
        file gives none (PEFT keeps it in adapter_config.json; 0: factor 1).

        Raises:
            StowageError: INVALID_ARGUMENT naming the file, key or layer that does not fit;
                ALREADY_EXISTS for a name in use; NOT_FOUND for a missing file or pipeline.
        """
        request = admin_pb2.LoadAdapterRequest(pipeline=pipeline, name=name, path=path, alpha=alpha)
        return _adapter_from_proto(self._call("LoadAdapter", request).adapter)

    def unload_adapter(self, pipeline: str, name: str) -> None:
        """Detaches an adapter; requests still queued that name it fail.

        Raises:
            StowageError: NOT_FOUND when the pipeline has no such adapter.
        """
        self._call("UnloadAdapter", admin_pb2.UnloadAdapterRequest(pipeline=pipeline, name=name))

    def placement_log(self, limit: int = 100) -> list[Decision]:
        """The newest ``limit`` placement decisions (at most 4096), oldest first.

        Raises:
            StowageError: INVALID_ARGUMENT for a limit outside [0, 4096] (0 means 100).
        """
        reply = self._call("GetPlacementLog", admin_pb2.GetPlacementLogRequest(limit=limit))
        return [_decision_from_proto(d) for d in reply.decisions]

