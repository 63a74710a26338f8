"""Tests of stowage_client.AdminClient and the admin CLI commands against a fake AdminService.

Like test_client.py, the fake records every request with its metadata and answers with canned
messages, so the tests check what goes on the wire (oneofs, enums, the bearer token) and how
replies and errors come back. Run through run_tests.sh, which puts the generated stubs on
PYTHONPATH.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest
from dataclasses import dataclass, field
from datetime import datetime, timezone
from unittest import mock

import grpc
from google.protobuf import timestamp_pb2

from stowage.v1 import admin_pb2, admin_pb2_grpc, config_pb2, generation_pb2

import stowage_client
from stowage_client import (
    AdminClient,
    ComponentInfo,
    ComponentPlacementInfo,
    Decision,
    GroupOffloadInfo,
    PipelineInfo,
    PlacementInfo,
    StowageError,
)
from stowage_client.__main__ import format_decisions, main

from fake_server import FakeServerTestCase, RecordedCall

TOKEN = "s3cret-admin"
GOC = config_pb2.GroupOffloadConfig
STATE = admin_pb2.ComponentPlacement


def _ts(seconds: int, nanos: int = 0) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)


# 2023-11-14 22:13:20 UTC.
T0 = 1_700_000_000


def canned_group_status() -> admin_pb2.GroupOffloadStatus:
    return admin_pb2.GroupOffloadStatus(
        groups=4, streamed_groups=3, resident_groups=1, slots=2, slot_bytes=16 * 2**20,
        working_set_bytes=48 * 2**20, forwards=10, prefetches=30, sync_onloads=1,
        compress="int8", compressed_host_bytes=7 * 2**20, scratch_bytes=2**20, bytes_per_forward=9 * 2**20,
        one_pass_fp8_weights=3,
    )


def canned_placement() -> admin_pb2.GetPlacementResponse:
    return admin_pb2.GetPlacementResponse(
        device="cuda:0",
        budget_bytes=64 * 2**20,
        allocated_bytes=50 * 2**20 + 5,
        strategy="workflow",
        components=[
            STATE(
                id="tiny/text_encoder", name="text_encoder", kind="TinyTextEncoder",
                pipelines=["tiny"], weight_bytes=1536, device_bytes=0, state=STATE.OFFLOADED,
            ),
            STATE(
                id="tiny/transformer", name="transformer", kind="TinyDiT",
                pipelines=["tiny", "second"], weight_bytes=3 * 2**30,
                device_bytes=48 * 2**20, state=STATE.GROUP_OFFLOADED,
                last_use=_ts(T0, 123_456_789), group_offload=canned_group_status(),
            ),
            STATE(
                id="tiny/vae", name="vae", kind="TinyVAE", pipelines=["tiny"],
                weight_bytes=2 * 2**20, device_bytes=2 * 2**20, state=STATE.RESIDENT,
                last_use=_ts(T0 + 1),
            ),
        ],
        warnings=["footprint strategy manages group-offloaded component 'tiny/transformer'"],
        oom_recoveries=2,
    )


def canned_components() -> list[admin_pb2.ComponentPlacement]:
    return [canned_placement().components[1]]


def canned_pipeline() -> generation_pb2.Pipeline:
    return generation_pb2.Pipeline(
        name="second",
        description="Built-in test pipeline",
        components=[
            generation_pb2.PipelineComponent(
                name="text_encoder", kind="TinyTextEncoder", weight_bytes=768,
                parameter_count=384, dtype="bfloat16",
            ),
        ],
        device="sim:0",
        default_width=64,
        default_height=64,
        min_size=16,
        max_size=256,
        size_multiple=16,
        default_inference_steps=4,
        max_inference_steps=100,
        default_guidance_scale=3.0,
        max_prompt_bytes=126,
    )


def canned_log() -> admin_pb2.GetPlacementLogResponse:
    return admin_pb2.GetPlacementLogResponse(
        decisions=[
            admin_pb2.PlacementDecision(
                time=_ts(T0, 5_000_000), component="", action="set_strategy",
                free_before=-1, free_after=-1, strategy="text-encoders-only",
                reason="text-encoders-only",
            ),
            admin_pb2.PlacementDecision(
                time=_ts(T0 + 60, 250_999_999), request_id="req-7",
                component="tiny/text_encoder", action="offload", bytes=1536,
                free_before=1024, free_after=2560, strategy="text-encoders-only",
                reason="before tiny/transformer runs",
            ),
        ]
    )


@dataclass
class FakeAdminService(admin_pb2_grpc.AdminServiceServicer):
    """A scriptable AdminService: tests set the fields, then inspect `calls`."""

    calls: list[RecordedCall] = field(default_factory=list)
    # (code, message) to abort every call with.
    abort_with: tuple[grpc.StatusCode, str] | None = None
    # Seconds every call takes, to let client deadlines expire.
    delay_s: float = 0.0
    placement: admin_pb2.GetPlacementResponse = field(default_factory=canned_placement)
    strategy_reply: admin_pb2.SetOffloadStrategyResponse = field(
        default_factory=lambda: admin_pb2.SetOffloadStrategyResponse(strategy="footprint")
    )
    components: list[admin_pb2.ComponentPlacement] = field(default_factory=canned_components)
    pipeline: generation_pb2.Pipeline = field(default_factory=canned_pipeline)
    log: admin_pb2.GetPlacementLogResponse = field(default_factory=canned_log)

    def _handle(self, method: str, request: object, context: grpc.ServicerContext) -> None:
        metadata = [(m.key, m.value) for m in context.invocation_metadata()]
        self.calls.append(RecordedCall(method, request, metadata))
        deadline = time.monotonic() + self.delay_s
        while time.monotonic() < deadline and context.is_active():
            time.sleep(0.01)
        if self.abort_with:
            context.abort(*self.abort_with)

    def GetPlacement(self, request, context):
        self._handle("GetPlacement", request, context)
        return self.placement

    def SetOffloadStrategy(self, request, context):
        self._handle("SetOffloadStrategy", request, context)
        return self.strategy_reply

    def EnableGroupOffload(self, request, context):
        self._handle("EnableGroupOffload", request, context)
        return admin_pb2.EnableGroupOffloadResponse(components=self.components)

    def DisableGroupOffload(self, request, context):
        self._handle("DisableGroupOffload", request, context)
        return admin_pb2.DisableGroupOffloadResponse(components=self.components)

    def LoadPipeline(self, request, context):
        self._handle("LoadPipeline", request, context)
        return admin_pb2.LoadPipelineResponse(pipeline=self.pipeline)

    def UnloadPipeline(self, request, context):
        self._handle("UnloadPipeline", request, context)
        return admin_pb2.UnloadPipelineResponse()

    def GetPlacementLog(self, request, context):
        self._handle("GetPlacementLog", request, context)
        return self.log


_METHODS = [
    "GetPlacement",
    "SetOffloadStrategy",
    "EnableGroupOffload",
    "DisableGroupOffload",
    "LoadPipeline",
    "UnloadPipeline",
    "GetPlacementLog",
]


class AdminServerTestCase(FakeServerTestCase):
    """One in-process server per test class; every test gets a fresh fake and a clean
    $STOWAGE_TOKEN (the client and the CLI read it)."""

    servicer_base = admin_pb2_grpc.AdminServiceServicer
    add_servicer = staticmethod(admin_pb2_grpc.add_AdminServiceServicer_to_server)
    methods = _METHODS
    fake: FakeAdminService

    def setUp(self) -> None:
        type(self).fake = FakeAdminService()
        env = mock.patch.dict(os.environ)
        env.start()
        self.addCleanup(env.stop)
        os.environ.pop("STOWAGE_TOKEN", None)
        self.client = AdminClient(self.target, TOKEN, timeout=10)
        self.addCleanup(self.client.close)

    def sent(self, method: str):
        return self.only_call(method).request


class RequestMappingTest(AdminServerTestCase):
    def test_get_placement_sends_empty_request_with_bearer_token(self) -> None:
        self.client.get_placement()
        call = self.only_call("GetPlacement")
        self.assertEqual(call.request, admin_pb2.GetPlacementRequest())
        self.assertIn(("authorization", f"Bearer {TOKEN}"), call.metadata)

    def test_token_is_sent_with_every_method(self) -> None:
        self.client.get_placement()
        self.client.set_strategy_custom("lru")
        self.client.enable_group_offload("tiny/vae")
        self.client.disable_group_offload("tiny/vae")
        self.client.load_pipeline("second")
        self.client.unload_pipeline("second")
        self.client.placement_log()
        self.assertEqual([c.method for c in self.fake.calls], _METHODS)
        for call in self.fake.calls:
            with self.subTest(call.method):
                self.assertIn(("authorization", f"Bearer {TOKEN}"), call.metadata)

    def test_footprint_with_zero_reserve_still_sets_the_oneof(self) -> None:
        # FootprintStrategy{reserve_bytes: 0} is an empty message; the oneof must still be set,
        # or the server sees an empty strategy and refuses it.
        self.client.set_strategy_footprint()
        strategy = self.sent("SetOffloadStrategy").strategy
        self.assertEqual(strategy.WhichOneof("strategy"), "footprint")
        self.assertEqual(strategy.footprint.reserve_bytes, 0)

    def test_footprint_reserve_is_sent(self) -> None:
        self.client.set_strategy_footprint(reserve_bytes=3 * 2**30)
        strategy = self.sent("SetOffloadStrategy").strategy
        self.assertEqual(strategy.WhichOneof("strategy"), "footprint")
        self.assertEqual(strategy.footprint.reserve_bytes, 3 * 2**30)

    def test_custom_strategy_name_is_sent(self) -> None:
        self.client.set_strategy_custom("text-encoders-only")
        strategy = self.sent("SetOffloadStrategy").strategy
        self.assertEqual(strategy.WhichOneof("strategy"), "custom")
        self.assertEqual(strategy.custom, "text-encoders-only")

    def test_workflow_rules_map_to_their_oneofs_in_order(self) -> None:
        self.client.set_strategy_workflow(
            [
                {"after": ("text_encoder", ["text_encoder"])},
                {"before": ("vae", "transformer")},  # A bare name is one name, not characters.
                {"keep_resident": "vae"},
            ]
        )
        strategy = self.sent("SetOffloadStrategy").strategy
        self.assertEqual(strategy.WhichOneof("strategy"), "workflow")
        rules = strategy.workflow.rules
        self.assertEqual(
            [r.WhichOneof("rule") for r in rules], ["after", "before", "keep_resident"]
        )
        Trigger = config_pb2.WorkflowRule.Trigger
        self.assertEqual(
            rules[0].after, Trigger(component="text_encoder", offload=["text_encoder"])
        )
        self.assertEqual(rules[1].before, Trigger(component="vae", offload=["transformer"]))
        self.assertEqual(rules[2].keep_resident, "vae")

    def test_empty_workflow_is_still_a_workflow(self) -> None:
        self.client.set_strategy_workflow([])
        strategy = self.sent("SetOffloadStrategy").strategy
        self.assertEqual(strategy.WhichOneof("strategy"), "workflow")

    def test_malformed_rules_raise_value_error_without_calling(self) -> None:
        cases = {
            "two kinds in one rule": {"after": ("a", ["b"]), "keep_resident": "c"},
            "no kind": {},
            "unknown kind": {"during": ("a", ["b"])},
            "not a dict": ("after", ("a", ["b"])),
            "trigger not a pair": {"after": ("a",)},
            "trigger names not strings": {"before": ("a", [1])},
            "keep_resident not a string": {"keep_resident": ["vae"]},
        }
        for name, rule in cases.items():
            with self.subTest(name), self.assertRaises(ValueError):
                self.client.set_strategy_workflow([rule])
        self.assertEqual(self.fake.calls, [])

    def test_strategy_reply_is_name_and_warnings(self) -> None:
        self.fake.strategy_reply = admin_pb2.SetOffloadStrategyResponse(
            strategy="footprint", warnings=["w1", "w2"]
        )
        self.assertEqual(self.client.set_strategy_footprint(), ("footprint", ["w1", "w2"]))

    def test_enable_component_sends_the_default_options(self) -> None:
        self.client.enable_group_offload("tiny/transformer")
        request = self.sent("EnableGroupOffload")
        self.assertEqual(request.WhichOneof("target"), "component_id")
        self.assertEqual(request.component_id, "tiny/transformer")
        self.assertEqual(
            request.options,
            GOC(  # prefetch_depth 0: the server's default for the level.
                offload_type=GOC.BLOCK_LEVEL, num_blocks_per_group=1, use_stream=True,
                prefetch_depth=0, target=GOC.PINNED_HOST, never_pin_in_place=False,
            ),
        )
        self.assertEqual(list(request.exclude), [])
        self.assertEqual(dict(request.overrides), {})

    def test_enable_pipeline_maps_every_option(self) -> None:
        explicit = GOC(offload_type=GOC.LEAF_LEVEL, target=GOC.PAGEABLE_HOST)
        self.client.enable_group_offload(
            pipeline="tiny",
            offload_type="leaf",
            num_blocks_per_group=3,
            use_stream=False,
            prefetch_depth=2,
            target="disk",
            disk_dir="/var/cache/stowage",
            budget_bytes=2**30,
            block_modules=["layers", "noise_refiner"],
            staging_buffer_bytes=2**20,
            staging_buffers=3,
            pin_in_place=False,
            exclude=["vae", "text_encoder"],
            overrides={"transformer": {"offload_type": "block", "budget_bytes": 5}, "x": explicit},
        )
        request = self.sent("EnableGroupOffload")
        self.assertEqual(request.WhichOneof("target"), "pipeline")
        self.assertEqual(request.pipeline, "tiny")
        options = GOC(
            offload_type=GOC.LEAF_LEVEL, num_blocks_per_group=3, use_stream=False,
            prefetch_depth=2, target=GOC.DISK, disk_dir="/var/cache/stowage", budget_bytes=2**30,
            block_modules=["layers", "noise_refiner"], staging_buffer_bytes=2**20, staging_buffers=3,
            never_pin_in_place=True,
        )
        self.assertEqual(request.options, options)
        self.assertEqual(list(request.exclude), ["vae", "text_encoder"])
        # An override dict changes the keys it gives; the rest are this call's options.
        expected = GOC()
        expected.CopyFrom(options)
        expected.offload_type = GOC.BLOCK_LEVEL
        expected.budget_bytes = 5
        self.assertEqual(request.overrides["transformer"], expected)
        self.assertEqual(request.overrides["x"], explicit)
        self.assertEqual(sorted(request.overrides), ["transformer", "x"])

    def test_target_and_type_names_map_to_enums(self) -> None:
        cases = [
            (dict(compress="int8"), "compress", GOC.COMPRESS_INT8),
            (dict(compress="fp8"), "compress", GOC.COMPRESS_FP8),
            (dict(compress="int8_grouped"), "compress", GOC.COMPRESS_INT8_GROUPED),
            (dict(compress="int4"), "compress", GOC.COMPRESS_INT4),
            (dict(compress="auto"), "compress", GOC.COMPRESS_AUTO),
            (dict(compress="none"), "compress", GOC.COMPRESS_NONE),
            (dict(target="pinned"), "target", GOC.PINNED_HOST),
            (dict(target="pageable"), "target", GOC.PAGEABLE_HOST),
            (dict(target="disk", disk_dir="/d"), "target", GOC.DISK),
            (dict(offload_type="block"), "offload_type", GOC.BLOCK_LEVEL),
            (dict(offload_type="leaf"), "offload_type", GOC.LEAF_LEVEL),
        ]
        for kwargs, attr, value in cases:
            with self.subTest(**kwargs):
                self.fake.calls.clear()
                self.client.enable_group_offload("tiny/vae", **kwargs)
                self.assertEqual(getattr(self.sent("EnableGroupOffload").options, attr), value)

    def test_exactly_one_target_is_required(self) -> None:
        calls = {
            "enable, neither": lambda: self.client.enable_group_offload(),
            "enable, both": lambda: self.client.enable_group_offload("tiny/vae", "tiny"),
            "disable, neither": lambda: self.client.disable_group_offload(),
            "disable, both": lambda: self.client.disable_group_offload(
                component_id="tiny/vae", pipeline="tiny"
            ),
        }
        for name, call in calls.items():
            with self.subTest(name), self.assertRaises(ValueError):
                call()
        self.assertEqual(self.fake.calls, [])

    def test_bad_options_raise_value_error_without_calling(self) -> None:
        cases = {
            "unknown offload_type": (dict(component_id="t/x", offload_type="block_level"), ""),
            "unknown target": (dict(component_id="t/x", target="pinned_host"), ""),
            "unknown compress": (dict(component_id="t/x", compress="nf4"), ""),
            "exclude with component": (dict(component_id="t/x", exclude=["vae"]), ""),
            "overrides with component": (dict(component_id="t/x", overrides={"vae": {}}), ""),
            "exclude as a string": (dict(pipeline="tiny", exclude="vae"), ""),
            "unknown override key": (
                dict(pipeline="tiny", overrides={"vae": {"stream": False}}), "overrides['vae']"
            ),
            "bad override value": (
                dict(pipeline="tiny", overrides={"vae": {"target": "ram"}}), "overrides['vae']"
            ),
        }
        for name, (kwargs, text) in cases.items():
            with self.subTest(name):
                with self.assertRaises(ValueError) as cm:
                    self.client.enable_group_offload(**kwargs)
                self.assertIn(text, str(cm.exception))
        self.assertEqual(self.fake.calls, [])

    def test_disable_sets_the_target_oneof(self) -> None:
        self.client.disable_group_offload("tiny/transformer")
        self.client.disable_group_offload(pipeline="tiny")
        self.assertEqual(
            [c.request for c in self.fake.calls],
            [
                admin_pb2.DisableGroupOffloadRequest(component_id="tiny/transformer"),
                admin_pb2.DisableGroupOffloadRequest(pipeline="tiny"),
            ],
        )
        self.assertEqual(self.fake.calls[1].request.WhichOneof("target"), "pipeline")

    def test_load_pipeline_sends_the_config(self) -> None:
        self.client.load_pipeline("second", dtype="bfloat16", weight_seed=2**64 - 1)
        config = self.sent("LoadPipeline").pipeline
        self.assertEqual(
            config,
            config_pb2.PipelineConfig(
                name="second", builtin="zimage-tiny", dtype="bfloat16", weight_seed=2**64 - 1
            ),
        )
        self.assertEqual(config.WhichOneof("source"), "builtin")

    def test_load_pipeline_from_a_model_directory(self) -> None:
        self.client.load_pipeline("disk", model_dir="/models/z", random_weights=True, dtype="bfloat16")
        config = self.sent("LoadPipeline").pipeline
        self.assertEqual(config.WhichOneof("source"), "model_dir")
        self.assertEqual(config.model_dir, "/models/z")
        self.assertTrue(config.random_weights)
        self.assertEqual(config.dtype, "bfloat16")

    def test_unload_pipeline_sends_the_name(self) -> None:
        self.assertIsNone(self.client.unload_pipeline("second"))
        self.assertEqual(
            self.sent("UnloadPipeline"), admin_pb2.UnloadPipelineRequest(name="second")
        )

    def test_placement_log_sends_the_limit(self) -> None:
        self.client.placement_log()
        self.client.placement_log(limit=7)
        self.assertEqual([c.request.limit for c in self.fake.calls], [100, 7])


class ConversionTest(AdminServerTestCase):
    EXPECTED_TRANSFORMER = ComponentPlacementInfo(
        id="tiny/transformer",
        name="transformer",
        kind="TinyDiT",
        pipelines=["tiny", "second"],
        weight_bytes=3 * 2**30,
        device_bytes=48 * 2**20,
        state="GROUP_OFFLOADED",
        last_use=datetime(2023, 11, 14, 22, 13, 20, 123456, tzinfo=timezone.utc),
        group_offload=GroupOffloadInfo(
            groups=4, streamed_groups=3, resident_groups=1, slots=2, slot_bytes=16 * 2**20,
            working_set_bytes=48 * 2**20, forwards=10, prefetches=30, sync_onloads=1,
            compress="int8", compressed_host_bytes=7 * 2**20, scratch_bytes=2**20,
            bytes_per_forward=9 * 2**20, one_pass_fp8_weights=3,
        ),
    )

    def test_get_placement_converts_every_field(self) -> None:
        self.assertEqual(
            self.client.get_placement(),
            PlacementInfo(
                device="cuda:0",
                budget_bytes=64 * 2**20,
                allocated_bytes=50 * 2**20 + 5,
                strategy="workflow",
                components=[
                    ComponentPlacementInfo(
                        "tiny/text_encoder", "text_encoder", "TinyTextEncoder", ["tiny"], 1536,
                        0, "OFFLOADED",
                    ),
                    self.EXPECTED_TRANSFORMER,
                    ComponentPlacementInfo(
                        "tiny/vae", "vae", "TinyVAE", ["tiny"], 2 * 2**20, 2 * 2**20, "RESIDENT",
                        last_use=datetime(2023, 11, 14, 22, 13, 21, tzinfo=timezone.utc),
                    ),
                ],
                warnings=[
                    "footprint strategy manages group-offloaded component 'tiny/transformer'"
                ],
                oom_recoveries=2,
            ),
        )

    def test_free_bytes_is_none_without_a_budget(self) -> None:
        self.assertEqual(self.client.get_placement().free_bytes, 14 * 2**20 - 5)
        self.fake.placement.budget_bytes = 0
        self.assertIsNone(self.client.get_placement().free_bytes)

    def test_unknown_state_keeps_its_number(self) -> None:
        self.fake.placement.components[0].state = 9  # A state newer than these stubs.
        self.assertEqual(self.client.get_placement().components[0].state, "STATE_9")

    def test_enable_and_disable_return_components(self) -> None:
        self.assertEqual(
            self.client.enable_group_offload("tiny/transformer"), [self.EXPECTED_TRANSFORMER]
        )
        self.fake.components = []
        self.assertEqual(self.client.disable_group_offload(pipeline="tiny"), [])

    def test_load_pipeline_returns_pipeline_info(self) -> None:
        self.assertEqual(
            self.client.load_pipeline("second"),
            PipelineInfo(
                name="second",
                description="Built-in test pipeline",
                is_default=False,
                components=[ComponentInfo("text_encoder", "TinyTextEncoder", 768, 384, "bfloat16")],
                device="sim:0",
                default_width=64,
                default_height=64,
                min_size=16,
                max_size=256,
                size_multiple=16,
                default_inference_steps=4,
                max_inference_steps=100,
                default_guidance_scale=3.0,
                max_prompt_bytes=126,
            ),
        )

    def test_placement_log_converts_decisions(self) -> None:
        self.assertEqual(
            self.client.placement_log(),
            [
                Decision(
                    time=datetime(2023, 11, 14, 22, 13, 20, 5000, tzinfo=timezone.utc),
                    request_id="", component="", action="set_strategy", bytes=0,
                    free_before=None, free_after=None, strategy="text-encoders-only",
                    reason="text-encoders-only",
                ),
                Decision(
                    # Nanoseconds are truncated to datetime's microseconds, never rounded up.
                    time=datetime(2023, 11, 14, 22, 14, 20, 250999, tzinfo=timezone.utc),
                    request_id="req-7", component="tiny/text_encoder", action="offload",
                    bytes=1536, free_before=1024, free_after=2560,
                    strategy="text-encoders-only", reason="before tiny/transformer runs",
                ),
            ],
        )


class ErrorTest(AdminServerTestCase):
    def test_every_method_raises_stowage_error_with_code_and_message(self) -> None:
        self.fake.abort_with = (grpc.StatusCode.PERMISSION_DENIED, "wrong admin token")
        calls = {
            "GetPlacement": lambda: self.client.get_placement(),
            "SetOffloadStrategy": lambda: self.client.set_strategy_custom("lru"),
            "EnableGroupOffload": lambda: self.client.enable_group_offload(pipeline="tiny"),
            "DisableGroupOffload": lambda: self.client.disable_group_offload("tiny/vae"),
            "LoadPipeline": lambda: self.client.load_pipeline("second"),
            "UnloadPipeline": lambda: self.client.unload_pipeline("second"),
            "GetPlacementLog": lambda: self.client.placement_log(),
        }
        for method, call in calls.items():
            with self.subTest(method):
                with self.assertRaises(StowageError) as cm:
                    call()
                self.assertEqual(cm.exception.code, grpc.StatusCode.PERMISSION_DENIED)
                self.assertEqual(cm.exception.message, "wrong admin token")
                self.assertEqual(self.fake.calls[-1].method, method)

    def test_timeout_becomes_deadline_exceeded(self) -> None:
        self.fake.delay_s = 5
        with AdminClient(self.target, TOKEN, timeout=0.2) as client:
            start = time.monotonic()
            with self.assertRaises(StowageError) as cm:
                client.unload_pipeline("second")
        self.assertEqual(cm.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertLess(time.monotonic() - start, 4)


class TokenTest(AdminServerTestCase):
    def authorization(self) -> str:
        return dict(self.fake.calls[-1].metadata)["authorization"]

    def test_token_comes_from_the_environment_when_not_given(self) -> None:
        os.environ["STOWAGE_TOKEN"] = "from-env"
        with AdminClient(self.target) as client:
            client.get_placement()
        self.assertEqual(self.authorization(), "Bearer from-env")

    def test_constructor_token_wins_over_the_environment(self) -> None:
        os.environ["STOWAGE_TOKEN"] = "from-env"
        with AdminClient(self.target, "given") as client:
            client.get_placement()
        self.assertEqual(self.authorization(), "Bearer given")

    def test_no_token_at_all_is_a_value_error(self) -> None:
        for token in (None, ""):
            with self.subTest(token=token), self.assertRaises(ValueError) as cm:
                AdminClient(self.target, token)
            self.assertIn("STOWAGE_TOKEN", str(cm.exception))
        os.environ["STOWAGE_TOKEN"] = ""
        with self.assertRaises(ValueError):
            AdminClient(self.target)

    def test_context_manager_closes_the_channel(self) -> None:
        with AdminClient(self.target, TOKEN) as client:
            client.get_placement()
        with self.assertRaises(ValueError):  # grpc refuses calls on a closed channel.
            client.get_placement()


class FormatTest(unittest.TestCase):
    def test_package_exports_the_admin_api(self) -> None:
        for name in ["AdminClient", "PlacementInfo", "ComponentPlacementInfo", "Decision",
                     "GroupOffloadInfo"]:
            self.assertIn(name, stowage_client.__all__)
            self.assertTrue(hasattr(stowage_client, name), name)

    def test_empty_log_says_so(self) -> None:
        self.assertEqual(format_decisions([]), ["no placement decisions"])


class CliTest(AdminServerTestCase):
    def setUp(self) -> None:
        super().setUp()
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp = tmp.name

    def run_main(self, *argv: str, token: str | None = TOKEN) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        prefix = ["--target", self.target] + (["--token", token] if token else [])
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main([*prefix, *argv])
            except SystemExit as e:
                status = e.code
        return status, out.getvalue(), err.getvalue()

    def write(self, name: str, text: str) -> str:
        path = os.path.join(self.tmp, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def test_placement_prints_summary_components_and_warnings(self) -> None:
        status, out, err = self.run_main("placement")
        self.assertEqual((status, err), (0, ""))
        self.assertIn(("authorization", f"Bearer {TOKEN}"), self.only_call("GetPlacement").metadata)
        lines = out.splitlines()
        self.assertEqual(
            lines[:4],
            [
                "device          cuda:0",
                "memory          50.0 MiB allocated of 64.0 MiB (14.0 MiB free)",
                "strategy        workflow",
                "OOM recoveries  2",
            ],
        )
        rows = [line.split() for line in lines]
        self.assertIn(
            ["component", "state", "on", "device", "weights", "groups", "kind", "pipelines"], rows
        )
        self.assertIn(
            ["tiny/text_encoder", "OFFLOADED", "0", "B", "1.5", "KiB", "-", "TinyTextEncoder",
             "tiny"],
            rows,
        )
        self.assertIn(
            ["tiny/transformer", "GROUP_OFFLOADED", "48.0", "MiB", "3.0", "GiB", "4", "(3",
             "streamed,", "1", "resident)", "TinyDiT", "tiny,second"],
            rows,
        )
        self.assertIn(["tiny/vae", "RESIDENT", "2.0", "MiB", "2.0", "MiB", "-", "TinyVAE", "tiny"],
                      rows)
        self.assertEqual(
            lines[-1],
            "warning: footprint strategy manages group-offloaded component 'tiny/transformer'",
        )

    def test_placement_without_a_budget(self) -> None:
        self.fake.placement.budget_bytes = 0
        _, out, _ = self.run_main("placement")
        self.assertIn("memory          50.0 MiB allocated, no budget", out.splitlines())

    def test_placement_counts_the_next_pipelines_prefetches(self) -> None:
        self.fake.placement.pipeline_prefetches = 3
        self.fake.placement.pipeline_prefetch_bytes = 6 * 2**20
        self.fake.placement.pipeline_prefetches_used = 2
        self.fake.placement.pipeline_prefetches_unused = 1
        _, out, _ = self.run_main("placement")
        self.assertIn(
            "prefetched      3 components of the next pipeline (6.0 MiB), 2 used, 1 moved off unused",
            out.splitlines(),
        )
        record = json.loads(self.run_main("placement", "--json")[1])
        self.assertEqual(
            [record[k] for k in ("pipeline_prefetches", "pipeline_prefetch_bytes",
                                 "pipeline_prefetches_used", "pipeline_prefetches_unused")],
            [3, 6 * 2**20, 2, 1],
        )

    def test_placement_says_the_spare_room_caches_margin_when_they_are_on(self) -> None:
        _, out, _ = self.run_main("placement")
        self.assertFalse(any(line.startswith("cache margin") for line in out.splitlines()))
        self.fake.placement.cache_margin_bytes = 768 * 2**20
        self.fake.placement.runs_begun = 41
        _, out, _ = self.run_main("placement")
        self.assertIn("cache margin    768.0 MiB", out.splitlines())
        record = json.loads(self.run_main("placement", "--json")[1])
        self.assertEqual([record["cache_margin_bytes"], record["runs_begun"]], [768 * 2**20, 41])

    def test_placement_says_when_the_allocator_ran_short(self) -> None:
        _, out, _ = self.run_main("placement")
        self.assertNotIn("allocator ran short", out)
        self.fake.placement.allocator_retries = 5
        self.fake.placement.allocator_ooms = 2
        _, out, _ = self.run_main("placement")
        self.assertTrue(any(line.startswith("allocator ran short") and line.endswith("5 retries, 2 OOMs")
                            for line in out.splitlines()), out)
        record = json.loads(self.run_main("placement", "--json")[1])
        self.assertEqual([record["allocator_retries"], record["allocator_ooms"]], [5, 2])

    def test_placement_json(self) -> None:
        status, out, _ = self.run_main("placement", "--json")
        self.assertEqual(status, 0)
        record = json.loads(out)
        self.assertEqual(record["device"], "cuda:0")
        self.assertEqual(record["free_bytes"], 14 * 2**20 - 5)
        self.assertEqual(
            [c["state"] for c in record["components"]], ["OFFLOADED", "GROUP_OFFLOADED", "RESIDENT"]
        )
        transformer = record["components"][1]
        self.assertEqual(transformer["last_use"], "2023-11-14T22:13:20.123456+00:00")
        self.assertEqual(transformer["group_offload"]["streamed_groups"], 3)
        self.assertIsNone(record["components"][0]["last_use"])
        self.assertEqual(len(record["warnings"]), 1)

    def test_set_strategy_footprint(self) -> None:
        status, out, _ = self.run_main("set-strategy", "--footprint", "--reserve-bytes", "4096")
        self.assertEqual(status, 0)
        strategy = self.sent("SetOffloadStrategy").strategy
        self.assertEqual(strategy.WhichOneof("strategy"), "footprint")
        self.assertEqual(strategy.footprint.reserve_bytes, 4096)
        self.assertEqual(out, "strategy: footprint\n")

    def test_set_strategy_footprint_without_reserve_sets_the_oneof(self) -> None:
        self.run_main("set-strategy", "--footprint")
        self.assertEqual(self.sent("SetOffloadStrategy").strategy.WhichOneof("strategy"),
                         "footprint")

    def test_set_strategy_custom_prints_name_and_warnings(self) -> None:
        self.fake.strategy_reply = admin_pb2.SetOffloadStrategyResponse(
            strategy="lru", warnings=["something odd"]
        )
        status, out, _ = self.run_main("set-strategy", "--custom", "lru")
        self.assertEqual(status, 0)
        self.assertEqual(self.sent("SetOffloadStrategy").strategy,
                         config_pb2.OffloadStrategy(custom="lru"))
        self.assertEqual(out, "strategy: lru\nwarning: something odd\n")

    def test_set_strategy_json(self) -> None:
        self.fake.strategy_reply = admin_pb2.SetOffloadStrategyResponse(
            strategy="lru", warnings=["w"]
        )
        status, out, _ = self.run_main("set-strategy", "--custom", "lru", "--json")
        self.assertEqual(status, 0)
        self.assertEqual(json.loads(out), {"strategy": "lru", "warnings": ["w"]})

    def test_rules_file_is_parsed_with_protobuf_json(self) -> None:
        # Both field spellings protobuf's JSON mapping accepts: keep_resident and keepResident.
        path = self.write(
            "rules.json",
            json.dumps(
                {
                    "rules": [
                        {"after": {"component": "text_encoder", "offload": ["text_encoder"]}},
                        {"keep_resident": "vae"},
                        {"keepResident": "transformer"},
                    ]
                }
            ),
        )
        status, _, err = self.run_main("set-strategy", "--rules-file", path)
        self.assertEqual((status, err), (0, ""))
        strategy = self.sent("SetOffloadStrategy").strategy
        self.assertEqual(strategy.WhichOneof("strategy"), "workflow")
        Rule, Trigger = config_pb2.WorkflowRule, config_pb2.WorkflowRule.Trigger
        self.assertEqual(
            list(strategy.workflow.rules),
            [
                Rule(after=Trigger(component="text_encoder", offload=["text_encoder"])),
                Rule(keep_resident="vae"),
                Rule(keep_resident="transformer"),
            ],
        )

    def test_bad_rules_file_exits_2_without_calling(self) -> None:
        cases = {
            "not JSON": self.write("a.json", "{rules: ["),
            "unknown field": self.write("b.json", '{"rules": [{"aftr": {"component": "x"}}]}'),
            "two kinds in one rule": self.write(
                "c.json", '{"rules": [{"keep_resident": "a", "after": {"component": "b"}}]}'
            ),
            "missing file": os.path.join(self.tmp, "missing.json"),
        }
        for name, path in cases.items():
            with self.subTest(name):
                status, out, err = self.run_main("set-strategy", "--rules-file", path)
                self.assertEqual(status, 2)
                self.assertIn("--rules-file", err)
                self.assertIn(path, err)
                self.assertEqual(out, "")
        self.assertEqual(self.fake.calls, [])

    def test_enable_group_offload_maps_every_flag(self) -> None:
        status, _, err = self.run_main(
            "enable-group-offload", "--pipeline", "tiny", "--leaf", "--no-stream",
            "--blocks-per-group", "2", "--prefetch-depth", "3", "--target", "disk",
            "--disk-dir", "/tmp/groups", "--budget-bytes", "1048576",
            "--exclude", "vae", "text_encoder", "--exclude", "extra",
            "--block-module", "layers", "--block-module", "noise_refiner",
            "--staging-buffer-bytes", "65536", "--staging-buffers", "4", "--no-pin-in-place",
            "--compress", "int8",
        )
        self.assertEqual((status, err), (0, ""))
        self.assertEqual(
            self.sent("EnableGroupOffload"),
            admin_pb2.EnableGroupOffloadRequest(
                pipeline="tiny",
                options=GOC(
                    offload_type=GOC.LEAF_LEVEL, num_blocks_per_group=2, use_stream=False,
                    prefetch_depth=3, target=GOC.DISK, disk_dir="/tmp/groups",
                    budget_bytes=2**20, block_modules=["layers", "noise_refiner"],
                    staging_buffer_bytes=65536, staging_buffers=4, never_pin_in_place=True,
                    compress=GOC.COMPRESS_INT8,
                ),
                exclude=["vae", "text_encoder", "extra"],
            ),
        )

    def test_enable_group_offload_defaults_and_table(self) -> None:
        # The subcommand's --target (where weights wait) must not replace the global --target
        # (the server address): the call reaching the fake shows it did not.
        status, out, _ = self.run_main(
            "enable-group-offload", "--component", "tiny/transformer", "--target", "pageable"
        )
        self.assertEqual(status, 0)
        request = self.sent("EnableGroupOffload")
        self.assertEqual(request.WhichOneof("target"), "component_id")
        self.assertEqual(
            request.options,
            GOC(offload_type=GOC.BLOCK_LEVEL, num_blocks_per_group=1, use_stream=True,
                prefetch_depth=0, target=GOC.PAGEABLE_HOST),
        )
        lines = out.splitlines()
        self.assertEqual(len(lines), 2)
        self.assertEqual(lines[0].split()[:3], ["component", "state", "on"])
        self.assertEqual(lines[1].split()[:2], ["tiny/transformer", "GROUP_OFFLOADED"])

    def test_enable_group_offload_json(self) -> None:
        status, out, _ = self.run_main(
            "enable-group-offload", "--component", "tiny/transformer", "--json"
        )
        self.assertEqual(status, 0)
        records = json.loads(out)
        self.assertEqual([r["id"] for r in records], ["tiny/transformer"])
        self.assertEqual(records[0]["group_offload"]["groups"], 4)

    def test_disable_group_offload(self) -> None:
        status, out, _ = self.run_main("disable-group-offload", "--pipeline", "tiny")
        self.assertEqual(status, 0)
        self.assertEqual(
            self.sent("DisableGroupOffload"), admin_pb2.DisableGroupOffloadRequest(pipeline="tiny")
        )
        self.assertIn("tiny/transformer", out)
        self.fake.components = []
        _, out, _ = self.run_main("disable-group-offload", "--component", "tiny/vae")
        self.assertEqual(out, "no components\n")

    def test_load_pipeline(self) -> None:
        status, out, _ = self.run_main(
            "load-pipeline", "second", "--dtype", "bfloat16", "--weight-seed", "5"
        )
        self.assertEqual(status, 0)
        self.assertEqual(
            self.sent("LoadPipeline").pipeline,
            config_pb2.PipelineConfig(name="second", builtin="zimage-tiny", dtype="bfloat16",
                                      weight_seed=5),
        )
        lines = out.splitlines()
        self.assertEqual(lines[0], "second on sim:0: Built-in test pipeline")
        self.assertIn(["text_encoder", "TinyTextEncoder", "bfloat16", "768", "B", "384"],
                      [line.split() for line in lines])

    def test_load_pipeline_json(self) -> None:
        status, out, _ = self.run_main("load-pipeline", "second", "--json")
        self.assertEqual(status, 0)
        self.assertEqual(self.sent("LoadPipeline").pipeline.dtype, "float32")
        record = json.loads(out)
        self.assertEqual(record["name"], "second")
        self.assertEqual(record["components"][0]["weight_bytes"], 768)

    def test_unload_pipeline(self) -> None:
        status, out, _ = self.run_main("unload-pipeline", "second")
        self.assertEqual(status, 0)
        self.assertEqual(self.sent("UnloadPipeline").name, "second")
        self.assertEqual(out, "unloaded pipeline second\n")

    def test_placement_log_table(self) -> None:
        status, out, _ = self.run_main("placement-log", "--limit", "2")
        self.assertEqual(status, 0)
        self.assertEqual(self.sent("GetPlacementLog").limit, 2)
        lines = out.splitlines()
        self.assertEqual(len(lines), 3)
        self.assertTrue(lines[0].startswith("time (UTC)"), lines[0])
        self.assertEqual(
            lines[1].split(),
            ["2023-11-14", "22:13:20.005Z", "-", "set_strategy", "-", "0", "B", "-", "->", "-",
             "text-encoders-only", "text-encoders-only"],
        )
        self.assertEqual(
            lines[2].split(),
            ["2023-11-14", "22:14:20.250Z", "req-7", "offload", "tiny/text_encoder", "1.5", "KiB",
             "1.0", "KiB", "->", "2.5", "KiB", "text-encoders-only", "before", "tiny/transformer",
             "runs"],
        )

    def test_placement_log_json(self) -> None:
        status, out, _ = self.run_main("placement-log", "--json")
        self.assertEqual(status, 0)
        self.assertEqual(self.sent("GetPlacementLog").limit, 100)
        records = json.loads(out)
        self.assertEqual([r["action"] for r in records], ["set_strategy", "offload"])
        self.assertEqual(records[0]["time"], "2023-11-14T22:13:20.005000+00:00")
        self.assertIsNone(records[0]["free_before"])
        self.assertEqual(records[1]["free_after"], 2560)

    def test_rpc_error_exits_1_with_code_and_message(self) -> None:
        self.fake.abort_with = (grpc.StatusCode.PERMISSION_DENIED, "wrong admin token")
        for argv in (["placement"], ["set-strategy", "--custom", "lru"],
                     ["unload-pipeline", "x"], ["placement-log", "--json"]):
            with self.subTest(argv[0]):
                status, out, err = self.run_main(*argv)
                self.assertEqual(status, 1)
                self.assertEqual(err, "error: PERMISSION_DENIED: wrong admin token\n")
                self.assertEqual(out, "")

    def test_token_defaults_to_environment(self) -> None:
        os.environ["STOWAGE_TOKEN"] = "from-env"
        status, _, _ = self.run_main("placement", token=None)
        self.assertEqual(status, 0)
        self.assertIn(("authorization", "Bearer from-env"), self.only_call("GetPlacement").metadata)

    def test_usage_errors_exit_2_without_calling_the_server(self) -> None:
        cases = {
            "no token": (["placement"], None),
            "no strategy": (["set-strategy"], TOKEN),
            "two strategies": (["set-strategy", "--footprint", "--custom", "lru"], TOKEN),
            "reserve without footprint": (
                ["set-strategy", "--custom", "lru", "--reserve-bytes", "1"], TOKEN
            ),
            "negative reserve": (["set-strategy", "--footprint", "--reserve-bytes", "-1"], TOKEN),
            "no target": (["enable-group-offload"], TOKEN),
            "two targets": (
                ["enable-group-offload", "--component", "t/x", "--pipeline", "t"], TOKEN
            ),
            "exclude with component": (
                ["enable-group-offload", "--component", "t/x", "--exclude", "vae"], TOKEN
            ),
            "unknown offload target": (
                ["enable-group-offload", "--component", "t/x", "--target", "ram"], TOKEN
            ),
            "zero blocks per group": (
                ["enable-group-offload", "--pipeline", "t", "--blocks-per-group", "0"], TOKEN
            ),
            "disable without target": (["disable-group-offload"], TOKEN),
            "load without name": (["load-pipeline"], TOKEN),
            "negative weight seed": (["load-pipeline", "x", "--weight-seed", "-1"], TOKEN),
            "unload without name": (["unload-pipeline"], TOKEN),
            "zero limit": (["placement-log", "--limit", "0"], TOKEN),
            "limit over 4096": (["placement-log", "--limit", "4097"], TOKEN),
        }
        for name, (argv, token) in cases.items():
            with self.subTest(name):
                status, out, err = self.run_main(*argv, token=token)
                self.assertEqual(status, 2)
                self.assertIn("usage:", err)
                self.assertEqual(out, "")
        self.assertEqual(self.fake.calls, [])


class CliSubprocessTest(AdminServerTestCase):
    """Runs `python3 -m stowage_client` for real: the admin commands' exit statuses."""

    def run_module(self, *argv: str, token: str | None = TOKEN) -> subprocess.CompletedProcess[str]:
        stubs = os.path.dirname(os.path.dirname(os.path.dirname(admin_pb2.__file__)))
        package = os.path.dirname(os.path.dirname(stowage_client.__file__))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([stubs, package]))
        env.pop("STOWAGE_TOKEN", None)
        if token:
            env["STOWAGE_TOKEN"] = token  # Exercises the environment default end to end.
        return subprocess.run(
            [sys.executable, "-m", "stowage_client", "--target", self.target, *argv],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )

    def test_placement_exits_0(self) -> None:
        proc = self.run_module("placement")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("tiny/transformer", proc.stdout)
        self.assertIn(("authorization", f"Bearer {TOKEN}"), self.only_call("GetPlacement").metadata)

    def test_rpc_error_exits_1(self) -> None:
        self.fake.abort_with = (grpc.StatusCode.NOT_FOUND, "pipeline 'x' is not loaded")
        proc = self.run_module("unload-pipeline", "x")
        self.assertEqual(proc.returncode, 1)
        self.assertEqual(proc.stderr, "error: NOT_FOUND: pipeline 'x' is not loaded\n")

    def test_missing_token_exits_2(self) -> None:
        proc = self.run_module("placement", token=None)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("STOWAGE_TOKEN", proc.stderr)
        self.assertEqual(self.fake.calls, [])


if __name__ == "__main__":
    unittest.main()
