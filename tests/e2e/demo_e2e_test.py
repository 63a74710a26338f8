"""The trained demo pipeline through the real server binary: stowage_server started without a
config serves "shapes" (models/demo/shapes) as its default pipeline beside "zimage-tiny"; prompts
of the demo's grammar come back as images whose background colour, shape colour and shape position
match the prompt, scored by models/demo/captions.check_image (the rule the training's evaluation
used). The same rule must reject what the random-weights pipeline draws and a mismatched caption,
so a pass means the model drew the prompt. --demo_dir=none and a --demo_dir without a model are
checked too.

Run by Bazel as an sh_test (tests/e2e/BUILD); paths come from the environment it sets.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np
from PIL import Image

from stowage_client import StowageClient

sys.path.insert(0, os.environ["STOWAGE_DEMO_PY"])
import captions  # noqa: E402

SERVER = os.environ["STOWAGE_SERVER_BIN"]

# Held out from the training run's evaluation prompts (captions.eval_prompts): other pairs, seeds.
PROMPTS = [
    (dict(fg="red", bg="blue", shape="circle", position="top left"), 42),
    (dict(fg="yellow", bg="black", shape="square", position="bottom right"), 7),
    (dict(fg="white", bg="purple", shape="triangle", position="center"), 3),
    (dict(fg="green", bg="orange", shape="circle", position="right"), 11),
    (dict(fg="black", bg="white", shape="square", position="top"), 5),
    (dict(fg="orange", bg="green", shape="triangle", position="bottom left"), 9),
]


def start_server(tmp: str, *flags: str) -> tuple[subprocess.Popen, dict]:
    port_file = os.path.join(tmp, "ports.json")
    with open(os.path.join(tmp, "server.log"), "w") as log:  # The child keeps its own descriptor.
        proc = subprocess.Popen([SERVER, "--grpc_address=127.0.0.1:0", "--metrics_address=none",
                                 f"--port_file={port_file}", *flags], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            with open(log.name) as f:
                raise RuntimeError("server did not start: " + f.read())
        time.sleep(0.05)
    with open(port_file) as f:
        return proc, json.load(f)


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


class DemoPipelineTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.tmp = tempfile.mkdtemp()
        cls.proc, addresses = start_server(cls.tmp)
        cls.client = StowageClient(addresses["grpc_address"], timeout=120)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        cls.proc.terminate()
        cls.proc.wait(timeout=30)

    def test_served_as_the_default_beside_the_random_one(self) -> None:
        pipelines = {p.name: p for p in self.client.list_pipelines()}
        self.assertEqual(set(pipelines), {"shapes", "zimage-tiny"})
        shapes = pipelines["shapes"]
        self.assertTrue(shapes.is_default)
        self.assertFalse(pipelines["zimage-tiny"].is_default)
        self.assertEqual((shapes.default_width, shapes.default_height), (128, 128))
        self.assertEqual(shapes.default_inference_steps, 8)

    def test_draws_the_prompt(self) -> None:
        failures = []
        for attrs, seed in PROMPTS:
            prompt = captions.caption(attrs)
            result = self.client.generate(prompt, seed=seed)  # The default pipeline, its defaults.
            self.assertEqual((result.pipeline, result.width, result.height), ("shapes", 128, 128))
            verdict = captions.check_image(pixels(result.image), attrs)
            if not (verdict["fg"] and verdict["bg"] and verdict["position"]):
                failures.append(f"{prompt!r} (seed {seed}): found {verdict['found']}")
        self.assertEqual(failures, [])

    def test_the_check_rejects_what_does_not_match(self) -> None:
        attrs, seed = PROMPTS[0]
        drawn = pixels(self.client.generate(captions.caption(attrs), seed=seed).image)
        swapped = dict(attrs, fg=attrs["bg"], bg=attrs["fg"], position="bottom right")
        verdict = captions.check_image(drawn, swapped)
        self.assertFalse(verdict["fg"] or verdict["bg"] or verdict["position"], verdict)
        # Random weights draw noise: not the prompt.
        noise = pixels(self.client.generate(captions.caption(attrs), seed=seed, pipeline="zimage-tiny",
                                            width=128, height=128).image)
        verdict = captions.check_image(noise, attrs)
        self.assertFalse(verdict["fg"] and verdict["bg"] and verdict["position"], verdict)

    def test_demo_dir_none_serves_only_the_random_pipeline(self) -> None:
        tmp = tempfile.mkdtemp()
        proc, addresses = start_server(tmp, "--demo_dir=none")
        try:
            with StowageClient(addresses["grpc_address"], timeout=60) as client:
                self.assertEqual([p.name for p in client.list_pipelines()], ["zimage-tiny"])
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    def test_demo_dir_without_a_model_is_refused(self) -> None:
        tmp = tempfile.mkdtemp()
        done = subprocess.run([SERVER, "--grpc_address=127.0.0.1:0", "--metrics_address=none",
                               f"--demo_dir={tmp}"], capture_output=True, text=True, timeout=60)
        self.assertEqual(done.returncode, 2, done.stderr)
        self.assertIn(f"--demo_dir: '{tmp}' has no model_index.json", done.stderr)


if __name__ == "__main__":
    unittest.main()
