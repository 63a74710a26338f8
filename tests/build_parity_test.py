#!/usr/bin/env python3
"""Checks that CMakeLists.txt is generated from the Bazel BUILD files and builds the same sources.

Bazel is the build wherever Bazel runs; CMakeLists.txt is generated from the BUILD files by
deploy/cmake/gen_cmakelists.py for hosts without Bazel (the GPU host). This test fails when the
committed CMakeLists.txt differs from a fresh generation (sources, dependencies, link options, test
sizes and arguments), printing the diff; and, independently of the generator, naming the files, when
  * a .cc file is in the srcs of a cc_library/cc_binary/cc_test in some BUILD file but not in
    CMakeLists.txt, or the other way round;
  * a .cc file under offload/ models/ placement/ server/ clients/ tests/ (or any other top-level
    folder with a BUILD file, third_party/ excepted) exists on disk but neither description
    builds it;
  * a listed .cc file does not exist;
  * a cc rule's srcs or deps is not a literal list (glob(), select(), variables), which this check
    (and the explicit CMake list) cannot follow;
  * a cc rule has no stowage_cc_* call of the same target in CMakeLists.txt (or the other way
    round), or the two list different dependencies. Names map by convention: //pkg:lib ->
    pkg_lib (slashes become underscores) for libraries, //pkg:bin -> bin for binaries and tests
    (with PACKAGE pkg), @system//:x -> stowage_sys_x, @libtorch//:torch -> stowage_torch.
Generated sources (genrule outputs, protoc's *.pb.cc from cc_grpc_proto_library) are not listed by
name in either description and are skipped.

BUILD files are parsed with Python's `ast` module (Starlark's syntax is Python's); only literal
string lists are evaluated. CMakeLists.txt is scanned for .cc tokens outside comments.

Run: /usr/bin/python3 tests/build_parity_test.py [-v]    (any Python >= 3.8; standard library only)
The repository root is $STOWAGE_SRC_ROOT if set, else found from this file's own location
(symlinks resolved, so it also works from a Bazel runfiles tree).
"""

from __future__ import annotations

import ast
import os
import re
import tempfile
import textwrap
import unittest
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

# Directories whose .cc files must be built by both descriptions; every other top-level folder
# that holds a BUILD file (bench/, ...) is added to these, third_party/ excepted.
SOURCE_DIRS = ("offload", "models", "placement", "runtime", "server", "clients", "tests")
NOT_SOURCE_DIRS = ("third_party",)
BUILD_FILE_NAMES = ("BUILD", "BUILD.bazel")
CMAKE_FILE = "CMakeLists.txt"
# Rule names whose srcs are compiled: cc_library, native.cc_test, and macros such as
# stowage_cc_test. cc_grpc_proto_library (generated sources) does not match.
CC_RULE_RE = re.compile(r"(?:^|_)cc_(?:library|binary|test)$")
# Never walked: VCS data, build outputs, fetched packages, caches.
SKIP_DIR_NAMES = {".git", "build", ".deb", ".whl", ".ref", "__pycache__", "gpu_out", "node_modules"}
NESTED_REPO_MARKERS = ("WORKSPACE", "WORKSPACE.bazel", "MODULE.bazel")
GENERATED_SUFFIXES = (".pb.cc",)


def find_repo_root() -> str:
    """The source tree: $STOWAGE_SRC_ROOT, else the parent of this file's directory."""
    env = os.environ.get("STOWAGE_SRC_ROOT")
    if env:
        root = os.path.abspath(env)
        if not os.path.isfile(os.path.join(root, CMAKE_FILE)):
            raise RuntimeError(f"STOWAGE_SRC_ROOT={env} has no {CMAKE_FILE}")
        return root
    candidates = [
        # The file itself, symlinks resolved: the source tree even when run from runfiles.
        os.path.dirname(os.path.dirname(os.path.realpath(__file__))),
        # A Bazel runfiles tree (CMakeLists.txt and the BUILD files as data).
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    ]
    if os.environ.get("TEST_SRCDIR"):
        candidates.append(
            os.path.join(os.environ["TEST_SRCDIR"], os.environ.get("TEST_WORKSPACE", "stowage"))
        )
    for candidate in candidates:
        cmake = os.path.join(candidate, CMAKE_FILE)
        if os.path.isfile(cmake):
            # In a runfiles tree CMakeLists.txt links into the source tree: use that tree, where
            # every BUILD file and source is visible.
            return os.path.dirname(os.path.realpath(cmake))
    raise RuntimeError(
        "cannot find the repository root (no CMakeLists.txt in "
        + ", ".join(candidates)
        + "); set STOWAGE_SRC_ROOT"
    )


@dataclass
class Rule:
    """A C++ target of either description, its dependencies in the other's naming mapped away."""

    label: str  # //pkg:name (Bazel) or the CMake target name
    package: str
    name: str
    kind: str  # library, binary or test
    deps: List[str]
    where: str


@dataclass
class Sources:
    """Sources a description builds: repo-relative path -> where it is listed; and its targets."""

    files: Dict[str, List[str]] = field(default_factory=dict)
    problems: List[str] = field(default_factory=list)
    rules: Dict[str, Rule] = field(default_factory=dict)

    def add(self, path: str, where: str) -> None:
        self.files.setdefault(path, []).append(where)


def _walk(root: str):
    """os.walk over root, skipping build outputs, bazel-* links and nested repositories."""
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        kept = []
        for d in sorted(dirnames):
            full = os.path.join(dirpath, d)
            if d in SKIP_DIR_NAMES or d.startswith("bazel-") or os.path.islink(full):
                continue
            if any(os.path.exists(os.path.join(full, m)) for m in NESTED_REPO_MARKERS):
                continue  # A separate Bazel repository (third_party/bazel/rules_cc, ...).
            kept.append(d)
        dirnames[:] = kept
        yield ("" if rel == "." else rel), sorted(filenames)


def _call_name(node: ast.Call) -> Optional[str]:
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def _string_list(node: ast.AST) -> Optional[List[str]]:
    """Evaluates a literal list/tuple of strings, or a '+' of such; None for anything else."""
    if isinstance(node, (ast.List, ast.Tuple)):
        out = []
        for elt in node.elts:
            if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                out.append(elt.value)
            else:
                return None
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _string_list(node.left), _string_list(node.right)
        if left is None or right is None:
            return None
        return left + right
    return None


def _label_to_path(label: str, package: str) -> Optional[str]:
    """A srcs entry as a repo-relative path; None for other repositories' files."""
    if label.startswith("@"):
        if label.startswith("@//") or label.startswith("@stowage//"):
            label = label[label.index("//"):]
        else:
            return None
    if label.startswith("//"):
        pkg, _, name = label[2:].partition(":")
        if not name:  # "//pkg/file.cc" is not a valid label; treat it as a path anyway.
            return os.path.normpath(pkg)
        return os.path.normpath(os.path.join(pkg, name))
    if label.startswith(":"):
        label = label[1:]
    return os.path.normpath(os.path.join(package, label)) if package else os.path.normpath(label)


def normalize_label(dep: str, package: str) -> str:
    """A deps entry as a full label: ':x' -> //pkg:x, '//a/b' -> //a/b:b, '@r//p' -> @r//p:p."""
    repo = ""
    if dep.startswith("@"):
        repo, _, rest = dep.partition("//")
        dep = "//" + rest
        if repo in ("@", "@stowage"):
            repo = ""
    if dep.startswith("//"):
        pkg, _, name = dep[2:].partition(":")
        return f"{repo}//{pkg}:{name or pkg.rsplit('/', 1)[-1]}"
    return f"//{package}:{dep[1:] if dep.startswith(':') else dep}"


def _rule_kind(rule: str) -> Optional[str]:
    if rule.endswith("cc_grpc_proto_library") or rule.endswith("cc_library"):
        return "library"
    if rule.endswith("cc_binary"):
        return "binary"
    if rule.endswith("cc_test"):
        return "test"
    return None


def parse_build_file(path: str, package: str, sources: Sources) -> None:
    """Adds the .cc srcs of every cc rule in one BUILD file to `sources`."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    display = os.path.join(package, os.path.basename(path)) if package else os.path.basename(path)
    try:
        tree = ast.parse(text, filename=display)
    except SyntaxError as e:
        sources.problems.append(f"{display}:{e.lineno}: cannot parse as Starlark/Python: {e.msg}")
        return
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    # Outputs of rules in this package (genrule outs): generated, not listed in CMake by name.
    generated: Set[str] = set()
    for call in calls:
        for kw in call.keywords:
            if kw.arg == "outs":
                for out in _string_list(kw.value) or []:
                    generated.add(_label_to_path(out, package) or out)
    for call in calls:
        rule = _call_name(call)
        if not rule or not (CC_RULE_RE.search(rule) or rule.endswith("cc_grpc_proto_library")):
            continue
        kwargs = {kw.arg: kw.value for kw in call.keywords if kw.arg}
        name_node = kwargs.get("name")
        name = (
            name_node.value
            if isinstance(name_node, ast.Constant) and isinstance(name_node.value, str)
            else f"<{rule} at line {call.lineno}>"
        )
        label = f"//{package}:{name}"
        deps = _string_list(kwargs["deps"]) if "deps" in kwargs else []
        if deps is None:
            sources.problems.append(
                f"{display}:{call.lineno}: {label}: deps is not a literal list of strings; list "
                f"them explicitly, as CMakeLists.txt must"
            )
            deps = []
        sources.rules[label] = Rule(
            label, package, name, _rule_kind(rule) or "library",
            [normalize_label(d, package) for d in deps], f"{display}:{call.lineno}",
        )
        if "srcs" not in kwargs or not CC_RULE_RE.search(rule):
            continue
        srcs = _string_list(kwargs["srcs"])
        if srcs is None:
            sources.problems.append(
                f"{display}:{call.lineno}: {label}: srcs is not a literal list of strings "
                f"({ast.dump(kwargs['srcs'])[:80]}...); list the files explicitly, as "
                f"CMakeLists.txt must"
            )
            continue
        for src in srcs:
            if not src.endswith(".cc"):
                continue
            rel = _label_to_path(src, package)
            if rel is None or rel in generated or rel.endswith(GENERATED_SUFFIXES):
                continue
            sources.add(rel, label)


def bazel_sources(root: str) -> Tuple[Sources, List[str]]:
    """The .cc sources of every cc rule in every BUILD file under root, and the files read."""
    sources = Sources()
    build_files = []
    for rel_dir, filenames in _walk(root):
        for name in filenames:
            if name in BUILD_FILE_NAMES:
                build_files.append(os.path.join(rel_dir, name))
                parse_build_file(os.path.join(root, rel_dir, name), rel_dir, sources)
    return sources, build_files


def _strip_cmake_comments(text: str) -> str:
    """Removes '#' line comments and '#[[...]]' bracket comments outside quoted arguments."""
    out = []
    i, n = 0, len(text)
    in_quote = False
    while i < n:
        c = text[i]
        if in_quote:
            out.append(c)
            if c == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 2
                continue
            if c == '"':
                in_quote = False
            i += 1
            continue
        if c == '"':
            in_quote = True
            out.append(c)
            i += 1
            continue
        if c == "#":
            bracket = re.match(r"#\[(=*)\[", text[i:])
            if bracket:
                close = "]" + bracket.group(1) + "]"
                end = text.find(close, i + bracket.end())
                end = n if end < 0 else end + len(close)
                out.append("\n" * text.count("\n", i, end))  # Keep line numbers.
                i = end
                continue
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        out.append(c)
        i += 1
    return "".join(out)


_CMAKE_CC_RE = re.compile(r"(?<![\w/.${}+-])([\w./+-]+\.cc)(?![\w.])")
_CMAKE_CALL_RE = re.compile(
    r"\b(stowage_cc_(?:library|binary|test|grpc_proto_library))\s*\(([^)]*)\)", re.DOTALL)
_CMAKE_KEYWORDS = {"SRCS", "DEPS", "PACKAGE", "SIZE", "ARGS", "LINKOPTS", "GRPC_INCLUDE", "CC_DEPS"}
_CMAKE_ROOT_VARS = re.compile(r"\$\{(?:CMAKE_CURRENT_SOURCE_DIR|CMAKE_SOURCE_DIR|PROJECT_SOURCE_DIR)\}/")


def cmake_sources(root: str) -> Sources:
    """Every .cc token in CMakeLists.txt, as repo-relative paths; tokens built from variables
    (the generated ${...}.pb.cc) are skipped."""
    sources = Sources()
    path = os.path.join(root, CMAKE_FILE)
    with open(path, encoding="utf-8") as f:
        text = _CMAKE_ROOT_VARS.sub("", _strip_cmake_comments(f.read()))
    for lineno, line in enumerate(text.splitlines(), start=1):
        for match in _CMAKE_CC_RE.finditer(line):
            token = match.group(1)
            if token.endswith(GENERATED_SUFFIXES):
                continue
            sources.add(os.path.normpath(token), f"{CMAKE_FILE}:{lineno}")
    for match in _CMAKE_CALL_RE.finditer(text):
        function, body = match.group(1), match.group(2)
        tokens = [t.strip('"') for t in body.split()]
        if not tokens or "$" in tokens[0]:
            continue  # The helper functions' own calls, e.g. stowage_cc_binary(${name} ...).
        sections: Dict[str, List[str]] = {}
        current = None
        for token in tokens[1:]:
            if token in _CMAKE_KEYWORDS:
                current = token
                sections.setdefault(current, [])
            elif current:
                sections[current].append(token)
        lineno = text.count("\n", 0, match.start()) + 1
        kind = _rule_kind(function.replace("stowage_", "")) or "library"
        package = (sections.get("PACKAGE") or [""])[0]
        sources.rules[tokens[0]] = Rule(
            tokens[0], package, tokens[0], kind, sections.get("DEPS", []), f"{CMAKE_FILE}:{lineno}")
    return sources


def source_dirs(build_files: List[str]) -> Set[str]:
    """SOURCE_DIRS and every other top-level folder holding a BUILD file."""
    dirs = set(SOURCE_DIRS)
    for build_file in build_files:
        top = build_file.split(os.sep, 1)[0]
        if os.sep in build_file and top not in NOT_SOURCE_DIRS:
            dirs.add(top)
    return dirs


def disk_sources(root: str, dirs: Set[str]) -> Set[str]:
    """.cc files on disk under `dirs`."""
    found = set()
    for rel_dir, filenames in _walk(root):
        top = rel_dir.split(os.sep, 1)[0]
        if top not in dirs:
            continue
        for name in filenames:
            if name.endswith(".cc") and not name.endswith(GENERATED_SUFFIXES):
                found.add(os.path.join(rel_dir, name))
    return found


# External Bazel targets and their CMake counterparts; @system//:x maps to stowage_sys_x.
EXTERNAL_TARGETS = {"@libtorch//:torch": "stowage_torch"}


def cmake_name(label: str, bazel_rules: Dict[str, Rule]) -> Optional[str]:
    """The CMake target the naming convention gives a Bazel label; None if it is no C++ target."""
    if label in EXTERNAL_TARGETS:
        return EXTERNAL_TARGETS[label]
    if label.startswith("@system//:"):
        return "stowage_sys_" + label.split(":", 1)[1]
    rule = bazel_rules.get(label)
    if rule is None:
        return None
    if rule.kind in ("binary", "test"):
        return rule.name
    return rule.package.replace("/", "_") + "_" + rule.name


@dataclass
class Report:
    build_files: List[str]
    bazel: Sources
    cmake: Sources
    disk: Set[str]
    dirs: Set[str] = field(default_factory=set)

    def target_drift(self) -> List[str]:
        """Targets missing from one description, and dependency lists that differ."""
        out = []
        mapped = set()
        for label, rule in sorted(self.bazel.rules.items()):
            name = cmake_name(label, self.bazel.rules)
            mapped.add(name)
            target = self.cmake.rules.get(name)
            if target is None:
                out.append(f"{label} ({rule.where}): no stowage_cc_* call for target '{name}' "
                           f"in {CMAKE_FILE}")
                continue
            if rule.kind in ("binary", "test") and target.package != rule.package:
                out.append(f"{label}: {target.where} has PACKAGE '{target.package}', "
                           f"expected '{rule.package}'")
            want = set()
            for dep in rule.deps:
                dep_name = cmake_name(dep, self.bazel.rules)
                if dep_name is None:
                    out.append(f"{label}: dependency {dep} is not a C++ target this check knows")
                else:
                    want.add(dep_name)
            have = set(target.deps)
            if want - have:
                out.append(f"{label}: {target.where} lacks DEPS {', '.join(sorted(want - have))}")
            if have - want:
                out.append(f"{label}: {target.where} has DEPS {', '.join(sorted(have - want))} "
                           f"that {rule.where} does not")
        for name, target in sorted(self.cmake.rules.items()):
            if name not in mapped:
                out.append(f"CMake target '{name}' ({target.where}) matches no cc rule of any "
                           f"BUILD file")
        return out

    def only_in_bazel(self) -> List[str]:
        return [
            f"{p}  (in {', '.join(self.bazel.files[p])}; missing from {CMAKE_FILE})"
            for p in sorted(set(self.bazel.files) - set(self.cmake.files))
        ]

    def only_in_cmake(self) -> List[str]:
        return [
            f"{p}  (at {', '.join(self.cmake.files[p])}; in no cc rule of any BUILD file)"
            for p in sorted(set(self.cmake.files) - set(self.bazel.files))
        ]

    def unbuilt(self) -> List[str]:
        listed = set(self.bazel.files) | set(self.cmake.files)
        return [f"{p}  (on disk, built by neither)" for p in sorted(self.disk - listed)]

    def missing_on_disk(self, root: str) -> List[str]:
        out = []
        for desc in (self.bazel, self.cmake):
            for p, where in sorted(desc.files.items()):
                if not os.path.isfile(os.path.join(root, p)):
                    out.append(f"{p}  (listed at {', '.join(where)}; no such file)")
        return out

    def problems(self) -> List[str]:
        return self.bazel.problems + self.cmake.problems


def check(root: str) -> Report:
    bazel, build_files = bazel_sources(root)
    dirs = source_dirs(build_files)
    return Report(build_files, bazel, cmake_sources(root), disk_sources(root, dirs), dirs)


def _fail_message(what: str, items: List[str], hint: str) -> str:
    return f"{len(items)} {what}:\n  " + "\n  ".join(items) + f"\n{hint}"


class BuildParityTest(unittest.TestCase):
    """The repository's own BUILD files against its CMakeLists.txt."""

    @classmethod
    def setUpClass(cls):
        cls.root = find_repo_root()
        cls.report = check(cls.root)

    def test_cmakelists_is_a_fresh_generation(self):
        import importlib.util
        path = os.path.join(self.root, "deploy", "cmake", "gen_cmakelists.py")
        spec = importlib.util.spec_from_file_location("gen_cmakelists", path)
        gen = importlib.util.module_from_spec(spec)
        import sys
        sys.modules[spec.name] = gen  # dataclasses look their module up there.
        spec.loader.exec_module(gen)
        generated = gen.generate(self.root)
        with open(os.path.join(self.root, CMAKE_FILE), encoding="utf-8") as f:
            committed = f.read()
        if generated != committed:
            import difflib
            diff = "".join(list(difflib.unified_diff(committed.splitlines(True), generated.splitlines(True),
                                                     "CMakeLists.txt (committed)", "generated"))[:80])
            self.fail("CMakeLists.txt is not what deploy/cmake/gen_cmakelists.py generates from the BUILD "
                      "files; run python3 deploy/cmake/gen_cmakelists.py\n" + diff)

    def test_found_build_files_and_sources(self):
        self.assertTrue(self.report.build_files, f"no BUILD files found under {self.root}")
        self.assertTrue(self.report.bazel.files, "no .cc sources found in any BUILD file")
        self.assertTrue(self.report.cmake.files, f"no .cc sources found in {CMAKE_FILE}")

    def test_build_files_are_readable(self):
        problems = self.report.problems()
        if problems:
            self.fail(_fail_message("BUILD file problems", problems, ""))

    def test_every_bazel_source_is_in_cmake(self):
        items = self.report.only_in_bazel()
        if items:
            self.fail(_fail_message(
                "sources built by Bazel but not by CMake", items,
                f"Add them to the matching stowage_cc_* call in {CMAKE_FILE}."))

    def test_every_cmake_source_is_in_bazel(self):
        items = self.report.only_in_cmake()
        if items:
            self.fail(_fail_message(
                "sources built by CMake but not by Bazel", items,
                f"Add them to a BUILD file's srcs, or remove them from {CMAKE_FILE}."))

    def test_every_source_on_disk_is_built(self):
        items = self.report.unbuilt()
        if items:
            self.fail(_fail_message(
                f"sources under {'/ '.join(sorted(self.report.dirs))}/ built by neither description", items,
                f"Add them to a BUILD file and {CMAKE_FILE}, or delete them."))

    def test_targets_and_dependencies_match(self):
        items = self.report.target_drift()
        if items:
            self.fail(_fail_message(
                "differences between the BUILD files' cc rules and CMakeLists.txt's targets", items,
                f"Mirror the BUILD files in {CMAKE_FILE} (see its header for the naming)."))

    def test_every_listed_source_exists(self):
        items = self.report.missing_on_disk(self.root)
        if items:
            self.fail(_fail_message("listed sources that do not exist", items, ""))


class CheckerSelfTest(unittest.TestCase):
    """The checker on small synthetic trees: it must catch each kind of drift."""

    def make_tree(self, files: Dict[str, str]) -> str:
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        for rel, text in files.items():
            path = os.path.join(tmp.name, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(textwrap.dedent(text))
        return tmp.name

    BASE = {
        "WORKSPACE": "",
        "BUILD": "",
        "proto/BUILD": """
            load("//third_party:protoc.bzl", "cc_grpc_proto_library")
            cc_grpc_proto_library(name = "p", srcs = ["stowage/v1/x.proto"])
        """,
        "offload/BUILD": """
            load("@rules_cc//cc:defs.bzl", "cc_library")
            cc_library(
                name = "a",
                srcs = ["a.cc", "a.h"],
                hdrs = ["a.h"],
                deps = ["@system//:absl"],
            )
            cc_test(name = "a_test", srcs = ["a_test.cc"], deps = [":a"])
            genrule(name = "g", outs = ["gen.cc"], cmd = "touch $@")
            cc_library(name = "gen", srcs = [":gen.cc"])
        """,
        "offload/a.cc": "",
        "offload/a_test.cc": "",
        "third_party/bazel/rules_cc/WORKSPACE": "",
        "third_party/bazel/rules_cc/BUILD": 'cc_library(name = "ignored", srcs = ["nope.cc"])\n',
        "CMakeLists.txt": """
            # offload/commented_out.cc is only a comment
            function(stowage_cc_test name)
              stowage_cc_binary(${name} PACKAGE ${ARG_PACKAGE} SRCS ${ARG_SRCS})
            endfunction()
            stowage_cc_grpc_proto_library(proto_p SRCS stowage/v1/x.proto)
            stowage_cc_library(offload_a SRCS offload/a.cc DEPS stowage_sys_absl)  # offload/c2.cc
            #[[ bracket comment offload/c3.cc ]]
            stowage_cc_test(a_test
              PACKAGE offload
              SRCS "${CMAKE_CURRENT_SOURCE_DIR}/offload/a_test.cc"
              DEPS offload_a)
            stowage_cc_library(offload_gen SRCS "${GEN_DIR}/gen.cc")
            set(gen "${GEN_DIR}/${base}.pb.cc" ${GEN_DIR}/x.grpc.pb.cc)
        """,
    }

    def tree(self, changes: Optional[Dict[str, Optional[str]]] = None) -> str:
        """BASE with some files replaced (or removed, for None)."""
        files = dict(self.BASE)
        for rel, value in (changes or {}).items():
            if value is None:
                files.pop(rel, None)
            else:
                files[rel] = value
        return self.make_tree(files)

    def test_clean_tree_passes(self):
        report = check(self.tree())
        self.assertEqual(report.problems(), [])
        self.assertEqual(sorted(report.bazel.files), ["offload/a.cc", "offload/a_test.cc"])
        self.assertEqual(sorted(report.cmake.files), ["offload/a.cc", "offload/a_test.cc"])
        self.assertEqual(report.only_in_bazel() + report.only_in_cmake() + report.unbuilt(), [])
        self.assertEqual(report.target_drift(), [])

    def test_dependency_drift_is_named(self):
        root = self.tree({"CMakeLists.txt": self.BASE["CMakeLists.txt"].replace(
            "DEPS stowage_sys_absl)", "DEPS stowage_sys_grpc)").replace(
            "stowage_cc_library(offload_gen", "stowage_cc_library(offload_renamed")})
        drift = check(root).target_drift()
        self.assertEqual(len(drift), 4, drift)
        self.assertIn("//offload:a: CMakeLists.txt:7 lacks DEPS stowage_sys_absl", drift)
        self.assertIn("//offload:a: CMakeLists.txt:7 has DEPS stowage_sys_grpc that "
                      "offload/BUILD:3 does not", drift)
        self.assertTrue(any("//offload:gen" in d and "'offload_gen'" in d for d in drift), drift)
        self.assertTrue(any("'offload_renamed'" in d for d in drift), drift)

    def test_new_top_level_package_is_scanned(self):
        report = check(self.tree({"bench/BUILD": "", "bench/orphan.cc": ""}))
        self.assertEqual(report.unbuilt(), ["bench/orphan.cc  (on disk, built by neither)"])

    def test_source_missing_from_cmake_is_named(self):
        root = self.tree({"offload/BUILD": self.BASE["offload/BUILD"].replace(
            '"a.cc", "a.h"', '"a.cc", "fake_extra.cc", "a.h"')})
        report = check(root)
        self.assertEqual(len(report.only_in_bazel()), 1)
        self.assertIn("offload/fake_extra.cc", report.only_in_bazel()[0])
        self.assertIn("//offload:a", report.only_in_bazel()[0])
        self.assertIn("offload/fake_extra.cc", report.missing_on_disk(root)[0])

    def test_source_missing_from_bazel_is_named(self):
        root = self.tree({
            "CMakeLists.txt": self.BASE["CMakeLists.txt"] + "add_executable(t server/extra.cc)\n"})
        report = check(root)
        self.assertEqual(len(report.only_in_cmake()), 1)
        self.assertIn("server/extra.cc", report.only_in_cmake()[0])
        self.assertIn("CMakeLists.txt:", report.only_in_cmake()[0])

    def test_unbuilt_file_on_disk_is_named(self):
        report = check(self.tree({"models/orphan.cc": "", "docs/example.cc": ""}))
        self.assertEqual(report.unbuilt(), ["models/orphan.cc  (on disk, built by neither)"])

    def test_non_literal_srcs_is_a_problem(self):
        report = check(self.tree({"server/BUILD": 'cc_library(name = "s", srcs = glob(["*.cc"]))\n'}))
        self.assertEqual(len(report.problems()), 1)
        self.assertIn("//server:s", report.problems()[0])

    def test_concatenated_lists_and_macros_are_read(self):
        report = check(self.tree({
            "server/BUILD": """
                stowage_cc_test(name = "t", srcs = ["t.cc"] + ["u.cc"])
                native.cc_binary(name = "b", srcs = ["//server:b.cc"])
            """}))
        self.assertEqual(
            sorted(p for p in report.bazel.files if p.startswith("server/")),
            ["server/b.cc", "server/t.cc", "server/u.cc"])

    def test_syntax_error_is_a_problem(self):
        report = check(self.tree({"server/BUILD": "cc_library(name = \n"}))
        self.assertEqual(len(report.problems()), 1)
        self.assertIn("server/BUILD", report.problems()[0])


if __name__ == "__main__":
    unittest.main()
