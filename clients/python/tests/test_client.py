"""Tests of stowage_client against an in-process fake GenerationService.

The fake records every request and its metadata and replies with canned messages, so the tests
check both directions of the wrapper: what goes on the wire, and how replies and errors come
back as Python values. Run through run_tests.sh, which puts the generated stubs on PYTHONPATH.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from dataclasses import dataclass, field
from unittest import mock

import grpc
from google.protobuf import duration_pb2

from stowage.v1 import generation_pb2, generation_pb2_grpc

import stowage_client
from stowage_client import (
    ComponentInfo,
    GenerationResult,
    PipelineInfo,
    ProgressEvent,
    StowageClient,
    StowageError,
)
from stowage_client.__main__ import format_bytes, format_count, main

from fake_server import FakeServerTestCase, RecordedCall

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4  # Not a real image; bytes must round-trip.
UINT64_MAX = 2**64 - 1


def _duration(seconds: int = 0, nanos: int = 0) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=seconds, nanos=nanos)


def canned_response() -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(
        image=PNG,
        format=generation_pb2.IMAGE_FORMAT_PNG,
        width=640,
        height=384,
        seed=UINT64_MAX - 1,
        pipeline="tiny",
        request_id="srv-42",
        stats=generation_pb2.RequestStats(
            queue_wait=_duration(0, 250_000_000),
            run_time=_duration(2, 500_000_000),
            stages=[
                generation_pb2.StageTiming(stage="tokenize", duration=_duration(0, 1_000_000)),
                generation_pb2.StageTiming(stage="encode_prompt", duration=_duration(0, 7)),
                generation_pb2.StageTiming(stage="denoise", duration=_duration(2, 123_456_789)),
                generation_pb2.StageTiming(stage="decode", duration=_duration(0, 300_000_000)),
            ],
            peak_device_memory_bytes=3 * 2**30 + 5,
            peak_device_reserved_bytes=4 * 2**30 + 9,
            peak_cpu_rss_bytes=2**40 + 7,
            host_to_device_bytes=5 * 2**20,
            allocator_retries=3,
            allocator_ooms=2,
            device_to_host_bytes=1536,
            device="sim:0",
        ),
    )


def canned_progress() -> list[generation_pb2.Progress]:
    return [
        generation_pb2.Progress(
            stage="tokenize", step=0, total_steps=2, elapsed=_duration(0, 100_000_000),
            queue_wait=_duration(0, 250_000_000),
        ),
        generation_pb2.Progress(
            stage="denoise", step=1, total_steps=2, elapsed=_duration(1, 0),
            queue_wait=_duration(0, 250_000_000),
        ),
        generation_pb2.Progress(
            stage="denoise", step=2, total_steps=2, elapsed=_duration(2, 5),
            queue_wait=_duration(0, 250_000_000),
        ),
    ]


def canned_pipelines() -> generation_pb2.ListPipelinesResponse:
    return generation_pb2.ListPipelinesResponse(
        pipelines=[
            generation_pb2.Pipeline(
                name="tiny",
                description="Built-in test pipeline",
                is_default=True,
                components=[
                    generation_pb2.PipelineComponent(
                        name="text_encoder", kind="TinyTextEncoder", weight_bytes=1536,
                        parameter_count=384, dtype="float32",
                    ),
                    generation_pb2.PipelineComponent(
                        name="transformer", kind="ZImageTransformer2DModel",
                        weight_bytes=3 * 2**30, parameter_count=1_200_000, dtype="bfloat16",
                    ),
                ],
                device="sim:0",
                default_width=512,
                default_height=256,
                min_size=64,
                max_size=1024,
                size_multiple=16,
                default_inference_steps=20,
                max_inference_steps=50,
                default_guidance_scale=4.5,
                max_prompt_bytes=2048,
            ),
            generation_pb2.Pipeline(name="other", device="cuda:1"),
        ]
    )


@dataclass
class FakeGenerationService(generation_pb2_grpc.GenerationServiceServicer):
    """A scriptable GenerationService: tests set the fields, then inspect `calls`."""

    calls: list[RecordedCall] = field(default_factory=list)
    # (code, message) to abort every call with; for streams, after sending `progress`.
    abort_with: tuple[grpc.StatusCode, str] | None = None
    response: generation_pb2.GenerateResponse = field(default_factory=canned_response)
    progress: list[generation_pb2.Progress] = field(default_factory=canned_progress)
    send_result: bool = True
    pipelines: generation_pb2.ListPipelinesResponse = field(default_factory=canned_pipelines)
    # Seconds Generate takes, to let client deadlines expire.
    delay_s: float = 0.0
    # When set, the stream waits on `release` after its first event, before sending the rest.
    gate: bool = False
    release: threading.Event = field(default_factory=threading.Event)
    gate_timed_out: bool | None = None
    # When true, the stream sends progress events until the client goes away.
    endless: bool = False
    saw_cancellation: threading.Event = field(default_factory=threading.Event)

    def _record(self, method: str, request: object, context: grpc.ServicerContext) -> None:
        metadata = [(m.key, m.value) for m in context.invocation_metadata()]
        self.calls.append(RecordedCall(method, request, metadata))

    def Generate(self, request, context):
        self._record("Generate", request, context)
        deadline = time.monotonic() + self.delay_s
        while time.monotonic() < deadline and context.is_active():
            time.sleep(0.01)
        if self.abort_with:
            context.abort(*self.abort_with)
        return self.response

    def GenerateStream(self, request, context):
        self._record("GenerateStream", request, context)
        if self.endless:
            # Only the client going away ends this RPC. Signalled by a termination callback
            # rather than after the loop: once the call is cancelled, grpc may stop resuming the
            # generator between messages, so code after the loop need never run.
            context.add_callback(self.saw_cancellation.set)
            while context.is_active():
                yield generation_pb2.GenerateStreamResponse(progress=self.progress[0])
                time.sleep(0.02)
            return
        for i, progress in enumerate(self.progress):
            yield generation_pb2.GenerateStreamResponse(progress=progress)
            if self.gate and i == 0:
                self.gate_timed_out = not self.release.wait(10)
        if self.abort_with:
            context.abort(*self.abort_with)
        if self.send_result:
            yield generation_pb2.GenerateStreamResponse(result=self.response)

    def ListPipelines(self, request, context):
        self._record("ListPipelines", request, context)
        if self.abort_with:
            context.abort(*self.abort_with)
        return self.pipelines


class ServerTestCase(FakeServerTestCase):
    """Starts one in-process server per test class; every test gets a fresh fake."""

    servicer_base = generation_pb2_grpc.GenerationServiceServicer
    add_servicer = staticmethod(generation_pb2_grpc.add_GenerationServiceServicer_to_server)
    methods = ("Generate", "GenerateStream", "ListPipelines")
    fake: FakeGenerationService

    def setUp(self) -> None:
        type(self).fake = FakeGenerationService()
        self.client = StowageClient(self.target, timeout=10)
        self.addCleanup(self.client.close)


FULL_ARGS = dict(
    negative_prompt="blurry",
    width=768,
    height=512,
    steps=30,
    guidance_scale=7.5,
    seed=UINT64_MAX,
    pipeline="tiny-bf16",
    request_id="req-1",
)


class RequestMappingTest(ServerTestCase):
    def assert_full_request(self, request: generation_pb2.GenerateRequest) -> None:
        expected = generation_pb2.GenerateRequest(
            pipeline="tiny-bf16",
            prompt="a lighthouse",
            negative_prompt="blurry",
            width=768,
            height=512,
            num_inference_steps=30,
            guidance_scale=7.5,
            seed=UINT64_MAX,
            request_id="req-1",
        )
        self.assertEqual(request, expected)
        self.assertTrue(request.HasField("guidance_scale"))
        self.assertTrue(request.HasField("seed"))

    def assert_defaults_request(self, request: generation_pb2.GenerateRequest) -> None:
        self.assertEqual(request, generation_pb2.GenerateRequest(prompt="a lighthouse"))
        self.assertFalse(request.HasField("guidance_scale"))
        self.assertFalse(request.HasField("seed"))

    def test_generate_sends_every_given_field(self) -> None:
        self.client.generate("a lighthouse", **FULL_ARGS)
        self.assert_full_request(self.only_call("Generate").request)

    def test_generate_leaves_optional_fields_unset_for_none(self) -> None:
        self.client.generate("a lighthouse")
        self.assert_defaults_request(self.only_call("Generate").request)

    def test_zero_guidance_and_seed_are_sent_not_dropped(self) -> None:
        # 0 is a meaningful value for both (no guidance; seed 0), distinct from unset.
        self.client.generate("a lighthouse", guidance_scale=0.0, seed=0)
        request = self.only_call("Generate").request
        self.assertTrue(request.HasField("guidance_scale"))
        self.assertTrue(request.HasField("seed"))
        self.assertEqual(request.guidance_scale, 0.0)
        self.assertEqual(request.seed, 0)

    def test_stream_sends_every_given_field(self) -> None:
        list(self.client.stream("a lighthouse", **FULL_ARGS))
        self.assert_full_request(self.only_call("GenerateStream").request)

    def test_stream_leaves_optional_fields_unset_for_none(self) -> None:
        list(self.client.stream("a lighthouse"))
        self.assert_defaults_request(self.only_call("GenerateStream").request)


class ResultConversionTest(ServerTestCase):
    def assert_canned_result(self, result: GenerationResult) -> None:
        self.assertIsInstance(result, GenerationResult)
        self.assertEqual(result.image, PNG)
        self.assertEqual((result.width, result.height), (640, 384))
        self.assertEqual(result.seed, UINT64_MAX - 1)
        self.assertEqual(result.pipeline, "tiny")
        self.assertEqual(result.request_id, "srv-42")
        stats = result.stats
        self.assertEqual(stats.queue_wait_s, 0.25)
        self.assertEqual(stats.run_time_s, 2.5)
        self.assertEqual(list(stats.stages), ["tokenize", "encode_prompt", "denoise", "decode"])
        self.assertAlmostEqual(stats.stages["tokenize"], 0.001, places=12)
        self.assertAlmostEqual(stats.stages["encode_prompt"], 7e-9, places=15)
        self.assertAlmostEqual(stats.stages["denoise"], 2.123456789, places=12)
        self.assertAlmostEqual(stats.stages["decode"], 0.3, places=12)
        self.assertEqual(stats.peak_device_memory_bytes, 3 * 2**30 + 5)
        self.assertEqual(stats.peak_device_reserved_bytes, 4 * 2**30 + 9)
        self.assertEqual(stats.peak_cpu_rss_bytes, 2**40 + 7)
        self.assertEqual(stats.host_to_device_bytes, 5 * 2**20)
        self.assertEqual(stats.device_to_host_bytes, 1536)
        self.assertEqual(stats.device, "sim:0")
        self.assertEqual([stats.allocator_retries, stats.allocator_ooms], [3, 2])

    def test_generate_converts_result_and_stats(self) -> None:
        self.assert_canned_result(self.client.generate("p"))

    def test_stream_result_is_converted_the_same_way(self) -> None:
        items = list(self.client.stream("p"))
        self.assert_canned_result(items[-1])

    def test_repeated_stage_durations_are_summed(self) -> None:
        self.fake.response.stats.stages.append(
            generation_pb2.StageTiming(stage="denoise", duration=_duration(1, 0))
        )
        stats = self.client.generate("p").stats
        self.assertEqual(list(stats.stages), ["tokenize", "encode_prompt", "denoise", "decode"])
        self.assertAlmostEqual(stats.stages["denoise"], 3.123456789, places=12)

    def test_image_is_left_out_of_repr(self) -> None:
        self.assertNotIn("PNG", repr(self.client.generate("p")))


class ErrorTest(ServerTestCase):
    def test_generate_error_keeps_code_and_message(self) -> None:
        self.fake.abort_with = (grpc.StatusCode.NOT_FOUND, "no pipeline named 'nope'")
        with self.assertRaises(StowageError) as cm:
            self.client.generate("p", pipeline="nope")
        self.assertEqual(cm.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertEqual(cm.exception.message, "no pipeline named 'nope'")
        self.assertEqual(str(cm.exception), "NOT_FOUND: no pipeline named 'nope'")

    def test_list_pipelines_error_keeps_code_and_message(self) -> None:
        self.fake.abort_with = (grpc.StatusCode.PERMISSION_DENIED, "bad token")
        with self.assertRaises(StowageError) as cm:
            self.client.list_pipelines()
        self.assertEqual(cm.exception.code, grpc.StatusCode.PERMISSION_DENIED)
        self.assertEqual(cm.exception.message, "bad token")

    def test_stream_error_after_progress_keeps_code_and_message(self) -> None:
        self.fake.abort_with = (grpc.StatusCode.RESOURCE_EXHAUSTED, "out of device memory")
        received = []
        with self.assertRaises(StowageError) as cm:
            for item in self.client.stream("p"):
                received.append(item)
        self.assertEqual(cm.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertEqual(cm.exception.message, "out of device memory")
        self.assertEqual(len(received), 3)
        self.assertTrue(all(isinstance(i, ProgressEvent) for i in received))

    def test_timeout_becomes_deadline_exceeded(self) -> None:
        self.fake.delay_s = 5
        with StowageClient(self.target, timeout=0.2) as client:
            start = time.monotonic()
            with self.assertRaises(StowageError) as cm:
                client.generate("p")
        self.assertEqual(cm.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertLess(time.monotonic() - start, 4)

    def test_unreachable_server_is_unavailable(self) -> None:
        with socket.socket() as s:  # A port that nothing listens on once closed.
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with StowageClient(f"127.0.0.1:{port}", timeout=5) as client:
            with self.assertRaises(StowageError) as cm:
                client.list_pipelines()
        self.assertEqual(cm.exception.code, grpc.StatusCode.UNAVAILABLE)

    def test_error_from_bare_rpc_error_is_unknown(self) -> None:
        error = StowageError.from_rpc_error(grpc.RpcError("socket closed"))
        self.assertEqual(error.code, grpc.StatusCode.UNKNOWN)
        self.assertEqual(error.message, "socket closed")


class StreamTest(ServerTestCase):
    def test_progress_events_then_result_in_order(self) -> None:
        items = list(self.client.stream("p"))
        self.assertEqual(
            [type(i) for i in items],
            [ProgressEvent, ProgressEvent, ProgressEvent, GenerationResult],
        )
        self.assertEqual(items[0], ProgressEvent("tokenize", 0, 2, 0.1, 0.25))
        self.assertEqual(items[1], ProgressEvent("denoise", 1, 2, 1.0, 0.25))
        self.assertEqual(items[2].step, 2)
        self.assertAlmostEqual(items[2].elapsed_s, 2.000000005, places=12)

    def test_stream_without_result_raises(self) -> None:
        self.fake.send_result = False
        received = []
        with self.assertRaises(StowageError) as cm:
            for item in self.client.stream("p"):
                received.append(item)
        self.assertEqual(cm.exception.code, grpc.StatusCode.INTERNAL)
        self.assertIn("without a result", cm.exception.message)
        self.assertEqual(len(received), 3)

    def test_empty_stream_raises(self) -> None:
        self.fake.send_result = False
        self.fake.progress = []
        with self.assertRaises(StowageError):
            list(self.client.stream("p"))

    def test_events_arrive_before_the_stream_ends(self) -> None:
        # The server holds the rest of the stream until the client has seen the first event, so
        # a client that buffered the stream would make the server's wait time out.
        self.fake.gate = True
        stream = self.client.stream("p")
        first = next(stream)
        self.fake.release.set()
        rest = list(stream)
        self.assertIsInstance(first, ProgressEvent)
        self.assertIsInstance(rest[-1], GenerationResult)
        self.assertIs(self.fake.gate_timed_out, False)

    def test_abandoning_the_stream_cancels_the_call(self) -> None:
        self.fake.endless = True
        stream = self.client.stream("p")
        self.assertIsInstance(next(stream), ProgressEvent)
        stream.close()
        self.assertTrue(self.fake.saw_cancellation.wait(5))


class PipelinesTest(ServerTestCase):
    def test_list_pipelines_converts_every_field(self) -> None:
        pipelines = self.client.list_pipelines()
        self.assertEqual(self.only_call("ListPipelines").request,
                         generation_pb2.ListPipelinesRequest())
        self.assertEqual(len(pipelines), 2)
        self.assertEqual(
            pipelines[0],
            PipelineInfo(
                name="tiny",
                description="Built-in test pipeline",
                is_default=True,
                components=[
                    ComponentInfo("text_encoder", "TinyTextEncoder", 1536, 384, "float32"),
                    ComponentInfo(
                        "transformer", "ZImageTransformer2DModel", 3 * 2**30, 1_200_000,
                        "bfloat16",
                    ),
                ],
                device="sim:0",
                default_width=512,
                default_height=256,
                min_size=64,
                max_size=1024,
                size_multiple=16,
                default_inference_steps=20,
                max_inference_steps=50,
                default_guidance_scale=4.5,
                max_prompt_bytes=2048,
            ),
        )
        self.assertEqual(pipelines[0].total_weight_bytes, 3 * 2**30 + 1536)
        self.assertEqual(pipelines[1].name, "other")
        self.assertFalse(pipelines[1].is_default)
        self.assertEqual(pipelines[1].components, [])


class MetadataTest(ServerTestCase):
    METADATA = [("authorization", "Bearer s3cret"), ("x-trace-id", "abc")]

    def test_metadata_is_sent_with_every_call(self) -> None:
        with StowageClient(self.target, timeout=10, metadata=self.METADATA) as client:
            client.generate("p")
            list(client.stream("p"))
            client.list_pipelines()
        self.assertEqual(len(self.fake.calls), 3)
        for call in self.fake.calls:
            with self.subTest(call.method):
                for pair in self.METADATA:
                    self.assertIn(pair, call.metadata)

    def test_no_metadata_by_default(self) -> None:
        self.client.generate("p")
        keys = [k for k, _ in self.only_call("Generate").metadata]
        self.assertNotIn("authorization", keys)

    def test_context_manager_closes_the_channel(self) -> None:
        with StowageClient(self.target) as client:
            client.list_pipelines()
        with self.assertRaises(ValueError):  # grpc refuses calls on a closed channel.
            client.list_pipelines()


class FormatTest(unittest.TestCase):
    def test_format_bytes(self) -> None:
        self.assertEqual(format_bytes(0), "0 B")
        self.assertEqual(format_bytes(1023), "1023 B")
        self.assertEqual(format_bytes(1024), "1.0 KiB")
        self.assertEqual(format_bytes(1536), "1.5 KiB")
        self.assertEqual(format_bytes(5 * 2**20), "5.0 MiB")
        self.assertEqual(format_bytes(3 * 2**30), "3.0 GiB")
        self.assertEqual(format_bytes(2**40), "1.0 TiB")

    def test_format_count(self) -> None:
        self.assertEqual(format_count(384), "384")
        self.assertEqual(format_count(1_200_000), "1.2M")
        self.assertEqual(format_count(6_000_000_000), "6.0B")

    def test_package_exports(self) -> None:
        for name in stowage_client.__all__:
            self.assertTrue(hasattr(stowage_client, name), name)


class CliTest(ServerTestCase):
    def setUp(self) -> None:
        super().setUp()
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp = tmp.name
        # The CLI reads a default token from the environment; keep the tests independent of it.
        env = mock.patch.dict(os.environ)
        env.start()
        self.addCleanup(env.stop)
        os.environ.pop("STOWAGE_TOKEN", None)

    def run_main(self, *argv: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(["--target", self.target, *argv])
            except SystemExit as e:
                status = e.code
        return status, out.getvalue(), err.getvalue()

    def test_generate_writes_png_and_prints_stats(self) -> None:
        path = os.path.join(self.tmp, "out.png")
        status, out, err = self.run_main(
            "generate", "--prompt", "a lighthouse", "--width", "640", "--guidance", "3.5",
            "--seed", "9", "--pipeline", "tiny", "--out", path,
        )
        self.assertEqual((status, err), (0, ""))
        with open(path, "rb") as f:
            self.assertEqual(f.read(), PNG)
        request = self.only_call("Generate").request
        self.assertEqual(
            request,
            generation_pb2.GenerateRequest(
                prompt="a lighthouse", width=640, guidance_scale=3.5, seed=9, pipeline="tiny"
            ),
        )
        lines = out.splitlines()
        self.assertIn("request id          srv-42", lines)
        self.assertIn(f"seed                {UINT64_MAX - 1}", lines)
        self.assertIn(f"image               640x384, 1.0 KiB -> {path}", lines)
        self.assertIn("queue wait          0.250 s", lines)
        self.assertIn("run time            2.500 s", lines)
        self.assertIn("  denoise           2.123 s", lines)
        self.assertIn("peak device memory  3.0 GiB", lines)
        self.assertIn("peak reserved       4.0 GiB", lines)
        self.assertIn("peak CPU RSS        1.0 TiB", lines)
        self.assertIn("host to device      5.0 MiB", lines)
        self.assertIn("device to host      1.5 KiB", lines)
        self.assertIn("device              sim:0", lines)

    def test_generate_without_options_leaves_optional_fields_unset(self) -> None:
        status, _, _ = self.run_main("generate", "--prompt", "p")
        self.assertEqual(status, 0)
        request = self.only_call("Generate").request
        self.assertFalse(request.HasField("guidance_scale"))
        self.assertFalse(request.HasField("seed"))

    def test_generate_json(self) -> None:
        path = os.path.join(self.tmp, "out.png")
        status, out, _ = self.run_main("generate", "--prompt", "p", "--json", "--out", path)
        self.assertEqual(status, 0)
        record = json.loads(out)
        self.assertEqual(record["seed"], UINT64_MAX - 1)
        self.assertEqual(record["image_bytes"], len(PNG))
        self.assertEqual(record["out"], path)
        self.assertEqual(record["stats"]["run_time_s"], 2.5)
        self.assertEqual(record["stats"]["queue_wait_s"], 0.25)
        self.assertEqual(
            list(record["stats"]["stages"]), ["tokenize", "encode_prompt", "denoise", "decode"]
        )
        self.assertEqual(record["stats"]["peak_device_memory_bytes"], 3 * 2**30 + 5)
        self.assertEqual(record["stats"]["device"], "sim:0")

    def test_stream_prints_progress_lines_then_stats(self) -> None:
        path = os.path.join(self.tmp, "out.png")
        status, out, err = self.run_main("stream", "--prompt", "p", "--steps", "2", "--out", path)
        self.assertEqual((status, err), (0, ""))
        lines = out.splitlines()
        self.assertEqual(
            lines[:3],
            ["    0.100 s  tokenize", "    1.000 s  denoise 1/2", "    2.000 s  denoise 2/2"],
        )
        self.assertIn("run time            2.500 s", lines[3:])
        with open(path, "rb") as f:
            self.assertEqual(f.read(), PNG)
        self.assertEqual(self.only_call("GenerateStream").request.num_inference_steps, 2)

    def test_stream_json_lines(self) -> None:
        status, out, _ = self.run_main("stream", "--prompt", "p", "--json")
        self.assertEqual(status, 0)
        records = [json.loads(line) for line in out.splitlines()]
        self.assertEqual([r["event"] for r in records], ["progress"] * 3 + ["result"])
        self.assertEqual(records[1]["step"], 1)
        self.assertEqual(records[-1]["stats"]["run_time_s"], 2.5)

    def test_pipelines_prints_components_in_human_units(self) -> None:
        status, out, _ = self.run_main("pipelines")
        self.assertEqual(status, 0)
        lines = out.splitlines()
        self.assertEqual(lines[0], "tiny (default) on sim:0: Built-in test pipeline")
        rows = [line.split() for line in lines]
        self.assertIn(["text_encoder", "TinyTextEncoder", "float32", "1.5", "KiB", "384"], rows)
        self.assertIn(
            ["transformer", "ZImageTransformer2DModel", "bfloat16", "3.0", "GiB", "1.2M"], rows
        )
        self.assertIn(["total", "3.0", "GiB", "1.2M"], rows)
        self.assertIn("other on cuda:1", lines)
        self.assertIn("  defaults: 512x256, 20 steps, guidance 4.5", lines)
        self.assertIn(
            "  limits: size 64 to 1024 in multiples of 16, at most 50 steps, "
            "prompt at most 2048 bytes",
            lines,
        )

    def test_pipelines_json(self) -> None:
        status, out, _ = self.run_main("pipelines", "--json")
        self.assertEqual(status, 0)
        records = json.loads(out)
        self.assertEqual([r["name"] for r in records], ["tiny", "other"])
        self.assertEqual(records[0]["components"][1]["weight_bytes"], 3 * 2**30)

    def test_rpc_error_exits_1_with_code_and_message(self) -> None:
        self.fake.abort_with = (grpc.StatusCode.NOT_FOUND, "no pipeline named 'nope'")
        path = os.path.join(self.tmp, "out.png")
        status, out, err = self.run_main(
            "generate", "--prompt", "p", "--pipeline", "nope", "--out", path
        )
        self.assertEqual(status, 1)
        self.assertEqual(err, "error: NOT_FOUND: no pipeline named 'nope'\n")
        self.assertEqual(out, "")
        self.assertFalse(os.path.exists(path))

    def test_stream_error_exits_1(self) -> None:
        self.fake.send_result = False
        status, _, err = self.run_main("stream", "--prompt", "p")
        self.assertEqual(status, 1)
        self.assertEqual(err, "error: INTERNAL: stream ended without a result\n")

    def test_timeout_option_sets_the_deadline(self) -> None:
        self.fake.delay_s = 5
        status, _, err = self.run_main("--timeout", "0.2", "generate", "--prompt", "p")
        self.assertEqual(status, 1)
        self.assertTrue(err.startswith("error: DEADLINE_EXCEEDED: "), err)

    def test_unwritable_out_exits_1(self) -> None:
        path = os.path.join(self.tmp, "missing-dir", "out.png")
        status, _, err = self.run_main("generate", "--prompt", "p", "--out", path)
        self.assertEqual(status, 1)
        self.assertTrue(err.startswith(f"error: cannot write {path}: "), err)

    def test_token_is_sent_as_bearer_authorization(self) -> None:
        status, _, _ = self.run_main("--token", "s3cret", "pipelines")
        self.assertEqual(status, 0)
        self.assertIn(("authorization", "Bearer s3cret"), self.only_call("ListPipelines").metadata)

    def test_token_defaults_to_environment(self) -> None:
        os.environ["STOWAGE_TOKEN"] = "from-env"
        status, _, _ = self.run_main("pipelines")
        self.assertEqual(status, 0)
        self.assertIn(
            ("authorization", "Bearer from-env"), self.only_call("ListPipelines").metadata
        )

    def test_no_token_sends_no_authorization(self) -> None:
        self.run_main("pipelines")
        keys = [k for k, _ in self.only_call("ListPipelines").metadata]
        self.assertNotIn("authorization", keys)

    def test_usage_errors_exit_2_without_calling_the_server(self) -> None:
        cases = {
            "no command": [],
            "unknown command": ["paint"],
            "missing prompt": ["generate"],
            "non-integer width": ["generate", "--prompt", "p", "--width", "wide"],
            "negative seed": ["generate", "--prompt", "p", "--seed", "-1"],
            "seed over uint64": ["stream", "--prompt", "p", "--seed", str(2**64)],
            "zero timeout": ["--timeout", "0", "pipelines"],
            "unknown option": ["pipelines", "--verbose"],
            "CA without --tls": ["--ca-cert", __file__, "pipelines"],
            "server name without --tls": ["--server-name", "stowage", "pipelines"],
            "unreadable CA": ["--tls", "--ca-cert", "/nonexistent/ca.crt", "pipelines"],
            "empty CA": ["--tls", "--ca-cert", os.devnull, "pipelines"],
        }
        for name, argv in cases.items():
            with self.subTest(name):
                status, out, err = self.run_main(*argv)
                self.assertEqual(status, 2)
                self.assertIn("usage:", err)
        self.assertEqual(self.fake.calls, [])


class TlsOptionsTest(ServerTestCase):
    """The TLS options against the plaintext fake: TLS must not quietly fall back to plaintext."""

    def test_a_tls_client_cannot_talk_to_a_plaintext_server(self) -> None:
        with StowageClient(self.target, timeout=5, tls=True) as client:
            with self.assertRaises(StowageError) as caught:
                client.list_pipelines()
        self.assertEqual(caught.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(self.fake.calls, [])

    def test_tls_settings_without_tls_are_refused(self) -> None:
        with self.assertRaises(ValueError):
            stowage_client.make_channel(self.target, root_certificates=b"pem")
        with self.assertRaises(ValueError):
            stowage_client.make_channel(self.target, server_name="stowage")
        stowage_client.make_channel(self.target).close()  # Plaintext stays the default.


class CliSubprocessTest(ServerTestCase):
    """Runs `python3 -m stowage_client` for real: the entry point and its exit statuses."""

    def run_module(self, *argv: str) -> subprocess.CompletedProcess[str]:
        # The child needs the same stubs and package as this process.
        stubs = os.path.dirname(os.path.dirname(os.path.dirname(generation_pb2.__file__)))
        package = os.path.dirname(os.path.dirname(stowage_client.__file__))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([stubs, package]))
        env.pop("STOWAGE_TOKEN", None)
        return subprocess.run(
            [sys.executable, "-m", "stowage_client", "--target", self.target, *argv],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )

    def test_generate_exits_0_and_writes_png(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "out.png")
            proc = self.run_module("generate", "--prompt", "p", "--out", path)
            self.assertEqual(proc.returncode, 0, proc.stderr)
            with open(path, "rb") as f:
                self.assertEqual(f.read(), PNG)
        self.assertIn("run time", proc.stdout)

    def test_rpc_error_exits_1(self) -> None:
        self.fake.abort_with = (grpc.StatusCode.INVALID_ARGUMENT, "width must be <= 1024")
        proc = self.run_module("generate", "--prompt", "p", "--width", "4096")
        self.assertEqual(proc.returncode, 1)
        self.assertEqual(proc.stderr, "error: INVALID_ARGUMENT: width must be <= 1024\n")

    def test_usage_error_exits_2(self) -> None:
        proc = self.run_module("generate")
        self.assertEqual(proc.returncode, 2)
        self.assertIn("--prompt", proc.stderr)


if __name__ == "__main__":
    unittest.main()
