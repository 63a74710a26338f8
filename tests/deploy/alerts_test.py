"""Prometheus configuration and alerts: promtool's `check rules` and `check config`, promtool's
unit tests of the alerts (deploy/prometheus/alerts_test.yml), that those tests cover every alert
with a case where it fires and one where it stays quiet, and that the PrometheusRule of
deploy/kubernetes/monitoring.yaml carries exactly alerts.yml's groups.

Run by Bazel as an sh_test (tests/deploy/BUILD) with the deploy files in its runfiles.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import unittest

import yaml

PROMETHEUS_DIR = os.environ["STOWAGE_PROMETHEUS_DIR"]
MONITORING = os.environ["STOWAGE_MONITORING_MANIFEST"]
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def promtool(*args: str) -> subprocess.CompletedProcess:
    if not os.access(PROMTOOL, os.X_OK):
        raise RuntimeError(f"no {PROMTOOL}: run ./stowage setup (Debian's prometheus package)")
    return subprocess.run([PROMTOOL, *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True,
                          timeout=60)


def coverage_gaps(alerts: dict, tests: dict) -> list[str]:
    """What the promtool tests leave out: each alert needs a case where it fires (exp_alerts not
    empty) and one where it stays quiet (exp_alerts empty); a case naming no alert of the rules is
    a mistake too."""
    names = {r["alert"] for g in alerts["groups"] for r in g["rules"] if "alert" in r}
    fires, quiet = set(), set()
    gaps = []
    for test in tests.get("tests", []):
        for case in test.get("alert_rule_test", []):
            name = case["alertname"]
            if name not in names:
                gaps.append(f"test {test.get('name')!r} names unknown alert {name}")
            (fires if case.get("exp_alerts") else quiet).add(name)
    for name in sorted(names):
        if name not in fires:
            gaps.append(f"{name}: no case where it fires")
        if name not in quiet:
            gaps.append(f"{name}: no case where it stays quiet")
    return gaps


class PrometheusFilesTest(unittest.TestCase):
    def load(self, name: str) -> dict:
        with open(os.path.join(PROMETHEUS_DIR, name)) as f:
            return yaml.safe_load(f)

    def test_promtool_check_rules(self) -> None:
        result = promtool("check", "rules", "alerts.yml")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("SUCCESS", result.stdout)

    def test_promtool_check_config(self) -> None:
        # Debian builds Prometheus without the Kubernetes service discovery (its client libraries
        # are not packaged), so its promtool refuses kubernetes_sd_configs as an unknown field.
        # The check runs on a copy whose discovery is a static target; everything else (globals,
        # rule files, relabelling) is checked as written. The discovery block itself is checked
        # for the one role the relabelling depends on.
        config = self.load("prometheus.yml")
        for job in config["scrape_configs"]:
            sd = job.pop("kubernetes_sd_configs", None)
            if sd is not None:
                self.assertEqual([c["role"] for c in sd], ["pod"], job["job_name"])
                job["static_configs"] = [{"targets": ["127.0.0.1:9464"]}]
        tmp = os.environ.get("TEST_TMPDIR") or tempfile.mkdtemp()
        shutil.copy(os.path.join(PROMETHEUS_DIR, "alerts.yml"), os.path.join(tmp, "alerts.yml"))
        with open(os.path.join(tmp, "prometheus.yml"), "w") as f:
            yaml.safe_dump(config, f)
        result = subprocess.run([PROMTOOL, "check", "config", "prometheus.yml"], cwd=tmp,
                                capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("SUCCESS: 1 rule files found", result.stdout + result.stderr)

    def test_promtool_test_rules(self) -> None:
        result = promtool("test", "rules", "alerts_test.yml")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("SUCCESS", result.stdout)

    def test_every_alert_fires_and_stays_quiet_in_some_case(self) -> None:
        tests = self.load("alerts_test.yml")
        self.assertEqual(tests["rule_files"], ["alerts.yml"])
        self.assertEqual(coverage_gaps(self.load("alerts.yml"), tests), [])

    def test_coverage_check_finds_gaps(self) -> None:
        alerts = {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up"},
                                                     {"alert": "B", "expr": "up"}]}]}
        tests = {"tests": [{"name": "t", "alert_rule_test": [
            {"alertname": "A", "exp_alerts": [{"exp_labels": {}}]},
            {"alertname": "A", "exp_alerts": []},
            {"alertname": "B", "exp_alerts": []},
            {"alertname": "C", "exp_alerts": []}]}]}
        self.assertEqual(coverage_gaps(alerts, tests),
                         ["test 't' names unknown alert C", "B: no case where it fires"])

    def test_prometheus_rule_matches_alerts_yml(self) -> None:
        with open(MONITORING) as f:
            documents = [d for d in yaml.safe_load_all(f) if d]
        rules = [d for d in documents if d["kind"] == "PrometheusRule"]
        self.assertEqual(len(rules), 1)
        self.assertEqual(rules[0]["spec"]["groups"], self.load("alerts.yml")["groups"],
                         "deploy/kubernetes/monitoring.yaml's PrometheusRule differs from alerts.yml")


if __name__ == "__main__":
    unittest.main()
