"""End to end through the real binaries: stowage_server on loopback port 0, called through the
Python client and the stowctl CLI, with gRPC health checking, server reflection and the
Prometheus page scraped over HTTP; then a second server, configured with an admin token, driven
through the Python AdminClient.

Run by Bazel as an sh_test (tests/e2e/BUILD); paths come from the environment it sets.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

import grpc

from stowage.v1 import admin_pb2, admin_pb2_grpc, config_pb2
from stowage_client import AdminClient, StowageClient, StowageError

SERVER = os.environ["STOWAGE_SERVER_BIN"]
STOWCTL = os.environ["STOWCTL_BIN"]


def _start_server(tmp: str, config: str | None = None) -> tuple[subprocess.Popen, dict]:
    """Starts the server (with --config=`config` when given); the flags' addresses override the
    config's."""
    port_file = os.path.join(tmp, "ports.json")
    log = open(os.path.join(tmp, "server.log"), "w")
    # Without a config the server would also serve the demo pipeline (tests/e2e/demo_e2e_test.py);
    # these tests are about the clients and run on zimage-tiny alone.
    proc = subprocess.Popen(
        [SERVER, "--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
         f"--port_file={port_file}"] + ([f"--config={config}"] if config else ["--demo_dir=none"]),
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError("server did not start: " + open(log.name).read())
        time.sleep(0.05)
    with open(port_file) as f:
        return proc, json.load(f)


class PythonEndToEndTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.tmp = tempfile.mkdtemp()
        cls.proc, cls.addresses = _start_server(cls.tmp)
        cls.target = cls.addresses["grpc_address"]
        cls.client = StowageClient(cls.target, timeout=60)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        cls.proc.terminate()
        cls.proc.wait(timeout=30)

    def test_generate_stream_and_pipelines_through_the_python_client(self) -> None:
        pipelines = self.client.list_pipelines()
        self.assertEqual([p.name for p in pipelines], ["zimage-tiny"])
        self.assertEqual([c.name for c in pipelines[0].components],
                         ["text_encoder", "vae_encoder", "transformer", "vae"])
        result = self.client.generate("a paper crane", width=64, height=80, steps=2, seed=5)
        self.assertTrue(result.image.startswith(b"\x89PNG\r\n\x1a\n"))
        self.assertEqual((result.width, result.height, result.seed), (64, 80, 5))
        # Every component but the VAE's encoder (images in only) is on the device while it runs.
        ran = sum(c.weight_bytes for c in pipelines[0].components if c.name != "vae_encoder")
        self.assertGreaterEqual(result.stats.peak_device_memory_bytes, ran)
        self.assertGreater(result.stats.peak_cpu_rss_bytes, 10 << 20)
        events = list(self.client.stream("a paper crane", width=64, height=80, steps=2, seed=5))
        self.assertEqual(events[-1].image, result.image)  # Same seed: same image.
        steps = [e.step for e in events[:-1] if e.stage == "denoise"]
        self.assertEqual(steps, [0, 1, 2])
        # Images in: the crane as the input; its size is taken, the strength matters, a mask the
        # image's size inpaints, and a mask alone is refused naming the field.
        edit = self.client.generate("a paper boat", image=result.image, strength=0.5, steps=4, seed=6)
        self.assertEqual((edit.width, edit.height), (64, 80))
        self.assertNotEqual(edit.image, result.image)
        again = self.client.generate("a paper boat", image=result.image, strength=0.5, steps=4, seed=6)
        self.assertEqual(again.image, edit.image)
        stronger = self.client.generate("a paper boat", image=result.image, strength=1.0, steps=4, seed=6)
        self.assertNotEqual(stronger.image, edit.image)
        inpainted = self.client.generate("a paper boat", image=result.image, mask=result.image, steps=2, seed=6)
        self.assertTrue(inpainted.image.startswith(b"\x89PNG"))
        streamed = list(self.client.stream("a paper boat", image=result.image, strength=0.5, steps=4, seed=6))
        self.assertEqual(streamed[-1].image, edit.image)
        self.assertEqual([e.step for e in streamed[:-1] if e.stage == "denoise"], [0, 1, 2])  # 2 of 4 steps.
        with self.assertRaises(StowageError) as caught:
            self.client.generate("x", mask=result.image)
        self.assertEqual(caught.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("mask: a mask needs an image", str(caught.exception))

    def test_bad_input_then_a_valid_request(self) -> None:
        cases = [
            (dict(prompt="", steps=1), grpc.StatusCode.INVALID_ARGUMENT, "prompt is required"),
            (dict(prompt="x", width=65), grpc.StatusCode.INVALID_ARGUMENT, "multiples of 16"),
            (dict(prompt="x", steps=101), grpc.StatusCode.INVALID_ARGUMENT, "num_inference_steps"),
            (dict(prompt="x", guidance_scale=float("nan")), grpc.StatusCode.INVALID_ARGUMENT,
             "guidance_scale"),
            (dict(prompt="x", pipeline="nope"), grpc.StatusCode.NOT_FOUND, "available: zimage-tiny"),
            (dict(prompt="y" * 5000), grpc.StatusCode.INVALID_ARGUMENT, "at most 4096 bytes"),
        ]
        for kwargs, code, text in cases:
            prompt = kwargs.pop("prompt")
            with self.assertRaises(StowageError, msg=str(kwargs)) as caught:
                self.client.generate(prompt, **kwargs)
            self.assertEqual(caught.exception.code, code)
            self.assertIn(text, caught.exception.message)
        self.assertTrue(self.client.generate("ok", width=64, height=64, steps=1).image)

    def test_stowctl_generate_stream_and_pipelines(self) -> None:
        out = os.path.join(self.tmp, "stowctl.png")
        gen = subprocess.run([STOWCTL, f"--target={self.target}", "generate", "--prompt=a kite",
                              "--width=64", "--height=64", "--steps=2", "--seed=9", f"--out={out}"],
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(gen.returncode, 0, gen.stderr)
        self.assertIn("peak device memory", gen.stdout)
        with open(out, "rb") as f:
            self.assertTrue(f.read().startswith(b"\x89PNG"))
        stream = subprocess.run([STOWCTL, f"--target={self.target}", "stream", "--prompt=a kite",
                                 "--width=64", "--height=64", "--steps=2"],
                                capture_output=True, text=True, timeout=120)
        self.assertEqual(stream.returncode, 0, stream.stderr)
        self.assertRegex(stream.stdout, r"denoise\s+step 2/2")
        listing = subprocess.run([STOWCTL, f"--target={self.target}", "pipelines"],
                                 capture_output=True, text=True, timeout=60)
        self.assertEqual(listing.returncode, 0, listing.stderr)
        self.assertIn("Z-Image (S3-DiT", listing.stdout)
        bad = subprocess.run([STOWCTL, f"--target={self.target}", "generate", "--prompt=x",
                              "--width=7"], capture_output=True, text=True, timeout=60)
        self.assertEqual(bad.returncode, 1)
        self.assertIn("width is 7", bad.stderr)
        usage = subprocess.run([STOWCTL, "frobnicate"], capture_output=True, text=True, timeout=60)
        self.assertEqual(usage.returncode, 2)

    def test_health_and_reflection(self) -> None:
        with grpc.insecure_channel(self.target) as channel:
            check = channel.unary_unary("/grpc.health.v1.Health/Check")
            # HealthCheckRequest{service: ""} is empty; HealthCheckResponse{status: SERVING} is
            # field 1 varint 1.
            self.assertEqual(check(b"", timeout=10), b"\x08\x01")
            reflect = channel.stream_stream(
                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
            # ServerReflectionRequest{list_services: ""}: field 7, length-delimited, empty.
            replies = list(reflect(iter([b"\x3a\x00"]), timeout=10))
            self.assertEqual(len(replies), 1)
            self.assertIn(b"stowage.v1.GenerationService", replies[0])
            self.assertIn(b"grpc.health.v1.Health", replies[0])

    def test_metrics_page_has_the_request(self) -> None:
        result = self.client.generate("metrics", width=64, height=64, steps=1)
        url = f"http://{self.addresses['metrics_address']}/metrics"
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        ok = re.search(r'^stowage_requests_total\{code="ok",pipeline="zimage-tiny"\} (\S+)$', page, re.M)
        self.assertIsNotNone(ok, page)
        self.assertGreaterEqual(float(ok.group(1)), 1)
        peak_sum = re.search(
            r'^stowage_request_peak_device_memory_bytes_sum\{pipeline="zimage-tiny"\} (\S+)$', page, re.M)
        self.assertGreaterEqual(float(peak_sum.group(1)), result.stats.peak_device_memory_bytes)
        self.assertRegex(page, r"(?m)^# TYPE stowage_request_duration_seconds histogram$")
        self.assertRegex(page, r"(?m)^stowage_process_resident_memory_bytes \d")

    def test_admin_api_is_disabled_without_a_token(self) -> None:
        # This server's config sets no auth.admin_token: every admin call is refused as such.
        with AdminClient(self.target, "any-token", timeout=30) as admin:
            with self.assertRaises(StowageError) as caught:
                admin.get_placement()
        self.assertEqual(caught.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("admin_token", caught.exception.message)


class PythonAdminEndToEndTest(unittest.TestCase):
    """The admin API through the Python AdminClient, against a server whose config file (protobuf
    text format, --config) sets the admin token."""

    TOKEN = "e2e-admin-token"

    @classmethod
    def setUpClass(cls) -> None:
        cls.tmp = tempfile.mkdtemp()
        config = os.path.join(cls.tmp, "server.txtpb")
        with open(config, "w") as f:
            f.write(f'auth {{ admin_token: "{cls.TOKEN}" }}\n')
        cls.proc, cls.addresses = _start_server(cls.tmp, config)
        cls.target = cls.addresses["grpc_address"]
        cls.client = StowageClient(cls.target, timeout=120)
        cls.admin = AdminClient(cls.target, cls.TOKEN, timeout=60)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.admin.close()
        cls.client.close()
        cls.proc.terminate()
        cls.proc.wait(timeout=30)

    def generate(self, request_id: str) -> bytes:
        result = self.client.generate("a paper lantern", width=64, height=64, steps=2, seed=3,
                                      request_id=request_id)
        self.assertTrue(result.image.startswith(b"\x89PNG\r\n\x1a\n"))
        return result.image

    def states(self) -> dict[str, str]:
        return {c.id: c.state for c in self.admin.get_placement().components}

    def test_wrong_or_missing_token_is_refused(self) -> None:
        with AdminClient(self.target, "wrong-token", timeout=30) as wrong:
            with self.assertRaises(StowageError) as caught:
                wrong.get_placement()
        self.assertEqual(caught.exception.code, grpc.StatusCode.PERMISSION_DENIED)
        # AdminClient always sends a token, so go around it for the missing-token case.
        with grpc.insecure_channel(self.target) as channel:
            with self.assertRaises(grpc.RpcError) as missing:
                admin_pb2_grpc.AdminServiceStub(channel).GetPlacement(
                    admin_pb2.GetPlacementRequest(), timeout=30)
        self.assertEqual(missing.exception.code(), grpc.StatusCode.UNAUTHENTICATED)

    def test_placement_lists_the_four_components(self) -> None:
        placement = self.admin.get_placement()
        self.assertTrue(placement.device)
        self.assertEqual(sorted(c.id for c in placement.components),
                         ["zimage-tiny/text_encoder", "zimage-tiny/transformer", "zimage-tiny/vae",
                          "zimage-tiny/vae_encoder"])
        for c in placement.components:
            self.assertEqual(c.id, f"zimage-tiny/{c.name}")
            self.assertEqual(c.pipelines, ["zimage-tiny"])
            self.assertGreater(c.weight_bytes, 0)
            self.assertIn(c.state, ("OFFLOADED", "RESIDENT", "GROUP_OFFLOADED"))

    def test_strategy_group_offload_and_decision_log(self) -> None:
        # One scenario, in order: each step builds on the server state the previous one left.
        self.assertEqual(self.admin.set_strategy_custom("text-encoders-only"),
                         ("text-encoders-only", []))
        self.assertEqual(self.admin.get_placement().strategy, "text-encoders-only")
        image = self.generate("py-admin-e2e-1")
        # The strategy moved the text encoder off before the transformer ran; nothing else (the
        # VAE's encoder, which text to image does not run, was never brought to the device).
        self.assertEqual(self.states(), {"zimage-tiny/text_encoder": "OFFLOADED",
                                         "zimage-tiny/transformer": "RESIDENT", "zimage-tiny/vae": "RESIDENT",
                                         "zimage-tiny/vae_encoder": "OFFLOADED"})

        enabled = self.admin.enable_group_offload(component_id="zimage-tiny/transformer")
        self.assertEqual([c.id for c in enabled], ["zimage-tiny/transformer"])
        transformer = enabled[0]
        self.assertEqual(transformer.state, "GROUP_OFFLOADED")
        self.assertIsNotNone(transformer.group_offload)
        self.assertGreater(transformer.group_offload.streamed_groups, 0)
        self.assertLess(transformer.device_bytes, transformer.weight_bytes)
        with self.assertRaises(StowageError) as twice:
            self.admin.enable_group_offload(component_id="zimage-tiny/transformer")
        self.assertEqual(twice.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertEqual(self.generate("py-admin-e2e-2"), image)  # Same seed, same weights.
        self.assertEqual(self.states(), {"zimage-tiny/text_encoder": "OFFLOADED",
                                         "zimage-tiny/transformer": "GROUP_OFFLOADED",
                                         "zimage-tiny/vae": "RESIDENT", "zimage-tiny/vae_encoder": "OFFLOADED"})

        log = self.admin.placement_log(limit=1000)
        self.assertTrue(log)
        self.assertTrue(any(d.action == "set_strategy" and d.strategy == "text-encoders-only"
                            for d in log), log)
        self.assertTrue(any(d.action == "offload" and d.component == "zimage-tiny/text_encoder"
                            and d.strategy == "text-encoders-only"
                            and d.request_id == "py-admin-e2e-1" for d in log), log)
        self.assertTrue(any(d.action == "onload" and d.request_id == "py-admin-e2e-2"
                            for d in log), log)  # The text encoder came back for request 2.
        # Oldest first: the newest one is last (nothing has been decided since).
        self.assertEqual(self.admin.placement_log(limit=1), [log[-1]])

        # Back to the start: group offloading off, the default strategy.
        disabled = self.admin.disable_group_offload(component_id="zimage-tiny/transformer")
        self.assertEqual([(c.id, c.state) for c in disabled], [("zimage-tiny/transformer", "OFFLOADED")])
        self.assertEqual(self.admin.set_strategy_footprint(), ("footprint", []))

    def test_batching_through_the_python_client(self) -> None:
        info = self.admin.set_batching("zimage-tiny", max_batch_size=3, max_queue_delay_ms=3000)
        self.assertEqual((info.max_batch_size, info.max_queue_delay_ms), (3, 3000))
        with self.assertRaises(StowageError) as refused:
            self.admin.set_batching("zimage-tiny", max_batch_size=65)
        self.assertEqual(refused.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("max_batch_size: 65", refused.exception.message)
        # Three requests at once: one batch of three, each with its own seed and the shared stages
        # marked. The server holds a batch open for members only once their key has shown
        # concurrent demand, so a first round may split; the next rounds run as one batch.
        import concurrent.futures
        for _ in range(5):
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                results = list(pool.map(
                    lambda seed: self.client.generate("a paper lantern", width=64, height=64, steps=2, seed=seed),
                    [11, 12, 13]))
            if all(r.stats.batch_size == 3 for r in results):
                break
        self.assertEqual([r.seed for r in results], [11, 12, 13])
        for r in results:
            self.assertEqual(r.stats.batch_size, 3)
            self.assertIn("denoise", r.stats.shared_stages)
            self.assertNotIn("encode_image", r.stats.shared_stages)
        self.admin.set_batching("zimage-tiny", max_batch_size=1)
        alone = self.client.generate("a paper lantern", width=64, height=64, steps=2, seed=12)
        self.assertEqual(alone.stats.batch_size, 1)
        self.assertEqual(alone.image, results[1].image)

    def test_scheduler_switched_at_run_time_through_the_python_client_and_stowctl(self) -> None:
        self.assertEqual(self.admin.get_scheduler().max_reorder_delay_ms, 0)  # The config's: FIFO.
        now = self.admin.set_scheduler(max_reorder_delay_ms=4000, priority_mode="weighted",
                                       tenant_weights={"gold": 2.0}, tenant_burst_work=8, preemption="resident")
        self.assertEqual((now.max_reorder_delay_ms, dict(now.tenant_weights), now.tenant_burst_work),
                         (4000, {"gold": 2.0}, 8))
        self.assertEqual(now.preemption, config_pb2.SchedulerConfig.PREEMPTION_RESIDENT)
        self.assertEqual(self.admin.get_scheduler(), now)
        # Out of range: refused by field name, and the scheduler in force is unchanged.
        for kwargs, needle in (({"max_reorder_delay_ms": 60001}, "scheduler.max_reorder_delay_ms: 60001"),
                               ({"tenant_weights": {"gold": 0.0}}, "scheduler.tenant_weights[gold]"),
                               ({"tenant_weights": {"two words": 1.0}}, "tenant 'two words'"),
                               ({"tenant_queue_limit": 100000}, "scheduler.tenant_queue_limit"),
                               ({"tenant_burst_work": -1}, "scheduler.tenant_burst_work"),
                               ({"preemption": "resident"}, "scheduler.preemption: PREEMPTION_RESIDENT bounds")):
            with self.assertRaises(StowageError) as refused:
                self.admin.set_scheduler(**kwargs)
            self.assertEqual(refused.exception.code, grpc.StatusCode.INVALID_ARGUMENT, kwargs)
            self.assertIn(needle, refused.exception.message)
        self.assertEqual(self.admin.get_scheduler(), now)
        with self.assertRaises(ValueError):
            self.admin.set_scheduler(priority_mode="fastest")
        with self.assertRaises(ValueError):
            self.admin.set_scheduler(preemption="always")
        # Requests still run under the new scheduler.
        self.generate("after-set-scheduler")
        # stowctl: set back to first come, first served, then read it.
        base = [STOWCTL, f"--target={self.target}", f"--token={self.TOKEN}"]
        done = subprocess.run(base + ["set-scheduler", "--scheduler=tenant_queue_limit: 2"],
                              capture_output=True, text=True, timeout=60)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("tenant_queue_limit: 2", done.stdout)
        got = subprocess.run(base + ["get-scheduler"], capture_output=True, text=True, timeout=60)
        self.assertEqual(got.returncode, 0, got.stderr)
        self.assertIn("tenant_queue_limit: 2", got.stdout)
        self.assertNotIn("max_reorder_delay_ms", got.stdout)
        bad = subprocess.run(base + ["set-scheduler", "--scheduler=max_reorder_delay_ms: -5"],
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(bad.returncode, 1)
        self.assertIn("max_reorder_delay_ms: -5", bad.stderr)
        garbled = subprocess.run(base + ["set-scheduler", "--scheduler={{"], capture_output=True, text=True,
                                 timeout=60)
        self.assertEqual(garbled.returncode, 2)
        self.assertIn("not a valid stowage.v1.SchedulerConfig", garbled.stderr)
        self.admin.set_scheduler()

    def test_memory_budget_changed_at_run_time_through_the_python_client_and_stowctl(self) -> None:
        self.generate("before-set-memory-budget")
        placement = self.admin.get_placement()
        unbudgeted = placement.budget_bytes  # No limit (simulated) or the card's size (CUDA).
        resident = sum(c.device_bytes for c in placement.components if c.state == "RESIDENT")
        self.assertGreater(resident, 0)
        budget = placement.context_bytes + resident - 1  # A budget counts the context.
        try:
            moved = self.admin.set_memory_budget(budget)
            self.assertTrue(moved)
            self.assertTrue(all(m.startswith("zimage-tiny/") for m in moved), moved)
            now = self.admin.get_placement()
            self.assertEqual(now.budget_bytes, budget)
            self.assertLessEqual(now.allocated_bytes, budget)
            self.generate("under-the-new-budget")
            with self.assertRaises(StowageError) as refused:
                self.admin.set_memory_budget(-5)
            self.assertEqual(refused.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("memory_budget_bytes: -5", refused.exception.message)
            with self.assertRaises(StowageError) as unknown:
                self.admin.set_memory_budget(resident, device="sim:7")
            self.assertEqual(unknown.exception.code, grpc.StatusCode.NOT_FOUND)
            base = [STOWCTL, f"--target={self.target}", f"--token={self.TOKEN}"]
            missing = subprocess.run(base + ["set-memory-budget"], capture_output=True, text=True, timeout=60)
            self.assertEqual(missing.returncode, 2)
            self.assertIn("set-memory-budget needs --memory_budget_bytes", missing.stderr)
            roomy = budget + resident
            done = subprocess.run(base + ["set-memory-budget", f"--memory_budget_bytes={roomy}"],
                                  capture_output=True, text=True, timeout=60)
            self.assertEqual(done.returncode, 0, done.stderr)
            self.assertIn(f"budget_bytes: {roomy}", done.stdout)
        finally:
            self.admin.set_memory_budget(0)
        self.assertEqual(self.admin.get_placement().budget_bytes, unbudgeted)


if __name__ == "__main__":
    unittest.main(verbosity=2)
