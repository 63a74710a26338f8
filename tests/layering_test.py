#!/usr/bin/env python3
"""Checks the folder layering of ARCHITECTURE.md: each layer depends only on the layers below it.

    base ← proto, offload ← models ← placement ← runtime ← server
                   base, proto ← clients

A layer may use its own folder and the folders of lower layers, never a folder of its own layer
or a higher one. Both kinds of edge are checked:
  * `#include "folder/..."` in the .h/.cc/.cu files of a layer folder;
  * `//folder...` labels in the BUILD files of a layer folder (deps, data).
Inside models/, the rooms are layered the same way (core ← tokenizers, nets ← pipelines ← the
registry and the demo at models/ itself), once the rooms exist.

The test fails naming every offending file and edge, so a violation is fixed where it is made.
Run: /usr/bin/python3 tests/layering_test.py [-v]; the repository root is $STOWAGE_SRC_ROOT if
set, else the parent of this file's folder (symlinks resolved).
"""

from __future__ import annotations

import os
import re
import unittest
from typing import Dict, List, Optional, Tuple

# Folder → layer. Same number = same layer: they may not use each other.
LAYERS: Dict[str, int] = {
    "base": 0,
    "proto": 1,
    "offload": 1,
    "models": 2,
    "placement": 3,
    "runtime": 4,
    "server": 5,
    "clients": 5,
}
# Folders under models/ with their own rank (models/ itself, the registry, ranks above its rooms).
MODEL_ROOMS: Dict[str, int] = {
    "core": 0,
    "tokenizers": 1,
    "nets": 1,
    "pipelines": 2,
    "demo": 3,
}
MODELS_TOP_RANK = 3
INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([a-z_0-9]+)/([^"]*)"', re.M)
LABEL_RE = re.compile(r'"//([a-z_0-9]+)(/[a-z_0-9/]+)?[:"]')
SOURCE_SUFFIXES = (".h", ".cc", ".cu")


def repo_root() -> str:
    env = os.environ.get("STOWAGE_SRC_ROOT")
    if env:
        return os.path.abspath(env)
    return os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def room_rank(path_in_models: str) -> int:
    """The rank inside models/ of a path relative to models/ (a file or a folder path)."""
    first = path_in_models.split("/", 1)[0]
    if "/" in path_in_models and first in MODEL_ROOMS:
        return MODEL_ROOMS[first]
    return MODELS_TOP_RANK


def edge_error(src_folder: str, src_sub: str, dst_folder: str, dst_sub: str) -> Optional[str]:
    """Why the edge src → dst breaks the layering, or None. `*_sub`: the path inside the folder."""
    if src_folder not in LAYERS or dst_folder not in LAYERS:
        return None  # Third-party headers, generated stowage/v1 protos, tests, bench, ...
    if src_folder == dst_folder:
        if src_folder != "models":
            return None
        s, d = room_rank(src_sub), room_rank(dst_sub)
        if d > s or (d == s and src_sub.split("/", 1)[0] != dst_sub.split("/", 1)[0] and s != MODELS_TOP_RANK):
            return f"models/{src_sub.split('/', 1)[0]} may not use models/{dst_sub.split('/', 1)[0]}"
        return None
    if LAYERS[dst_folder] >= LAYERS[src_folder]:
        return f"{src_folder}/ (layer {LAYERS[src_folder]}) may not use {dst_folder}/ (layer {LAYERS[dst_folder]})"
    return None


def scan(root: str) -> List[Tuple[str, str, str]]:
    """Every violation as (file, edge, reason)."""
    found: List[Tuple[str, str, str]] = []
    for folder in LAYERS:
        top = os.path.join(root, folder)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            rel_dir = os.path.relpath(dirpath, top)
            rel_dir = "" if rel_dir == "." else rel_dir + "/"
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                sub = rel_dir + name
                if name.endswith(SOURCE_SUFFIXES):
                    text = read(path)
                    for m in INCLUDE_RE.finditer(text):
                        why = edge_error(folder, sub, m.group(1), m.group(2))
                        if why:
                            found.append((f"{folder}/{sub}", f'#include "{m.group(1)}/{m.group(2)}"', why))
                elif name in ("BUILD", "BUILD.bazel"):
                    text = read(path)
                    for m in LABEL_RE.finditer(text):
                        dst_sub = (m.group(2) or "").lstrip("/")
                        dst_sub = dst_sub + "/x" if dst_sub else "x"
                        why = edge_error(folder, sub, m.group(1), dst_sub)
                        if why:
                            found.append((f"{folder}/{sub}", f"//{m.group(1)}{m.group(2) or ''}", why))
    return found


class LayeringTest(unittest.TestCase):
    def test_tree_is_layered(self):
        root = repo_root()
        self.assertTrue(os.path.isdir(os.path.join(root, "runtime")), f"no runtime/ under {root}")
        violations = scan(root)
        self.assertEqual(violations, [], "\n" + "\n".join(f"{f}: {e}: {w}" for f, e, w in violations))

    def test_upward_and_sideways_edges_are_caught(self):
        self.assertIsNotNone(edge_error("runtime", "x.cc", "server", "server.h"))
        self.assertIsNotNone(edge_error("offload", "x.cc", "proto", "wire_check.h"))
        self.assertIsNotNone(edge_error("server", "x.cc", "clients", "stowctl/x.h"))
        self.assertIsNotNone(edge_error("models", "core/layers.cc", "models", "nets/flux.h"))
        self.assertIsNotNone(edge_error("models", "nets/flux.cc", "models", "tokenizers/t5.h"))
        self.assertIsNone(edge_error("server", "x.cc", "runtime", "config.h"))
        self.assertIsNone(edge_error("models", "pipelines/flux.cc", "models", "nets/flux.h"))
        self.assertIsNone(edge_error("models", "registry.cc", "models", "pipelines/flux.h"))
        self.assertIsNone(edge_error("runtime", "x.cc", "absl", "status/status.h"))

    def test_server_holds_only_fronts(self):
        # The runtime's classes live in runtime/: server/ may not define them again.
        root = repo_root()
        names = sorted(n for n in os.listdir(os.path.join(root, "server")) if n.endswith((".h", ".cc")))
        owned = {"device_worker", "device_runtime", "device_set", "hosted_pipelines", "admin_core", "config"}
        self.assertEqual([n for n in names if n.rsplit(".", 1)[0] in owned], [])


if __name__ == "__main__":
    unittest.main()
