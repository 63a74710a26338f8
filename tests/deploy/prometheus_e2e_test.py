"""A real Prometheus in the loop: Debian's `prometheus` scrapes two stowage_servers on loopback, each
with two (simulated) devices and the pipeline replicated on both (a static scrape config, one-second
interval, deploy/prometheus/alerts.yml loaded), the test sends Generate requests to both through the
Python client, then asks Prometheus' HTTP API for

  * every PromQL expression of deploy/grafana/stowage-dashboard.json (panel targets and template
    variable queries, Grafana's variables replaced by what Grafana sends for "All"): each must return
    at least one series with a finite value, so a panel naming a metric or label the server does not
    export fails here, and so does one whose aggregation or join breaks with several servers and
    devices (a many-to-many match is an error);
  * every stowage_* metric that an alert in alerts.yml names, and every rule's health after
    Prometheus evaluated it on the live data;
  * the Prometheus adapter's rule (deploy/kubernetes/prometheus-adapter.yaml) as the adapter would
    run it for the HPA of autoscaling.yaml.

The server's config group-offloads the transformer, runs a workflow strategy and turns batching on,
so the placement families (evictions, group offload) and the batch histograms have series. Run by Bazel as an sh_test (tests/deploy/BUILD).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request

import yaml

from stowage_client import StowageClient, StowageError

SERVER = os.environ["STOWAGE_SERVER_BIN"]
DASHBOARD = os.environ["STOWAGE_DASHBOARD"]
ALERTS = os.environ["STOWAGE_ALERTS"]
ADAPTER = os.environ["STOWAGE_ADAPTER_CONFIG"]
HPA = os.environ["STOWAGE_HPA"]
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"

# What the kubernetes_sd relabelling (prometheus.yml) or the ServiceMonitor puts on every series in
# a cluster; the static target here gets the same labels so the adapter's rule can select on them.
NAMESPACE, PODS = "stowage-test", ("stowage-0", "stowage-1")
POD = PODS[0]
RATE_WINDOW = "30s"  # For $__rate_interval: many one-second scrapes, all after the server started.

SERVER_CONFIG = """
devices { kind: KIND_SIMULATED index: 0 memory_budget_bytes: 4294967296 }
devices { kind: KIND_SIMULATED index: 1 memory_budget_bytes: 4294967296 }
pipelines {
  name: "zimage-tiny" builtin: "zimage-tiny" devices: "sim:0" devices: "sim:1"
  group_offload {
    enabled: true
    defaults { offload_type: BLOCK_LEVEL use_stream: true prefetch_depth: 1 }
    exclude: "vae" exclude: "text_encoder"
  }
  batching { max_batch_size: 4 max_queue_delay_ms: 0 }
}
strategy { workflow { rules { after { component: "text_encoder" offload: "text_encoder" } }
                      rules { keep_resident: "vae" } } }
"""


def free_port() -> int:
    """A port that was free a moment ago (Prometheus cannot report a port 0 it bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grafana_expr(expr: str, variables: dict[str, str]) -> str:
    """`expr` as Grafana sends it: template variables replaced ($name and ${name}), the rate
    interval by RATE_WINDOW. Raises KeyError for a variable the dashboard does not define."""
    expr = expr.replace("$__rate_interval", RATE_WINDOW).replace("$__interval", RATE_WINDOW)

    def sub(m: re.Match) -> str:
        return variables[m.group(1) or m.group(2)]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, expr)


def dashboard_queries(path: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(where, PromQL) of every panel target, and of every query variable's label_values()."""
    with open(path) as f:
        dashboard = json.load(f)
    variables = {}
    label_queries = []
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            variables[v["name"]] = v.get("allValue") or ".*"
            label_queries.append((f"variable {v['name']}", v["definition"]))
    targets = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                targets.append((f"panel {p['title']!r} {t['refId']}", grafana_expr(t["expr"], variables)))
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    labels = [(where, grafana_expr(q, variables)) for where, q in label_queries]
    return targets, labels


class PrometheusEndToEndTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        cls.procs: list[subprocess.Popen] = []
        cls.logs = []
        try:
            cls._start()
        except BaseException:
            cls._stop()
            raise

    @classmethod
    def _spawn(cls, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(os.path.join(cls.tmp, f"{name}.log"), "w")
        cls.logs.append(log)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        cls.procs.append(proc)
        return proc

    @classmethod
    def _log(cls, name: str) -> str:
        with open(os.path.join(cls.tmp, f"{name}.log")) as f:
            return f.read()[-4000:]

    @classmethod
    def _start(cls) -> None:
        if not os.access(PROMETHEUS, os.X_OK):
            raise RuntimeError(f"no {PROMETHEUS}: run ./stowage setup (Debian's prometheus package)")
        config = os.path.join(cls.tmp, "server.txtpb")
        with open(config, "w") as f:
            f.write(SERVER_CONFIG)
        cls.grpc_targets, metrics_targets = [], []
        for i, pod in enumerate(PODS):
            port_file = os.path.join(cls.tmp, f"ports{i}.json")
            server = cls._spawn(f"server{i}", [SERVER, f"--config={config}", "--grpc_address=127.0.0.1:0",
                                               "--metrics_address=127.0.0.1:0", f"--port_file={port_file}"])
            deadline = time.time() + 60
            while not os.path.exists(port_file) or os.path.getsize(port_file) == 0:
                if server.poll() is not None or time.time() > deadline:
                    raise RuntimeError("server did not start: " + cls._log(f"server{i}"))
                time.sleep(0.05)
            with open(port_file) as f:
                ports = json.load(f)
            cls.grpc_targets.append(ports["grpc_address"])
            metrics_targets.append((ports["metrics_address"], pod))
        cls.grpc_target = cls.grpc_targets[0]

        prometheus_config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [os.path.abspath(ALERTS)],
            "scrape_configs": [{
                "job_name": "stowage",  # The alerts select job="stowage".
                "static_configs": [{"targets": [target], "labels": {"namespace": NAMESPACE, "pod": pod}}
                                   for target, pod in metrics_targets],
            }],
        }
        prometheus_yml = os.path.join(cls.tmp, "prometheus.yml")
        with open(prometheus_yml, "w") as f:
            yaml.safe_dump(prometheus_config, f)
        for attempt in range(3):  # The free port may be taken between the probe and the bind.
            port = free_port()
            cls.api = f"http://127.0.0.1:{port}/api/v1"
            prometheus = cls._spawn("prometheus", [
                PROMETHEUS, f"--config.file={prometheus_yml}",
                f"--storage.tsdb.path={cls.tmp}/data{attempt}", f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn"])
            deadline = time.time() + 30
            while time.time() < deadline and prometheus.poll() is None:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2).read()
                    break
                except (urllib.error.URLError, ConnectionError):
                    time.sleep(0.2)
            else:
                if prometheus.poll() is None:
                    raise RuntimeError("prometheus not ready in 30 s: " + cls._log("prometheus"))
                continue  # Exited: most likely the port; try another.
            break
        else:
            raise RuntimeError("prometheus did not start: " + cls._log("prometheus"))

        # The first scrape, then traffic: successful requests, and one the server refuses. Each
        # request waits until Prometheus has scraped the one before: a series' first sample counts
        # as its start, not as an increase, so rate() needs the counters to grow between scrapes.
        cls.wait_for("sum(up) == 2", lambda r: bool(r) and float(r[0]["value"][1]) == 2)
        done = 0
        for target in cls.grpc_targets:
            with StowageClient(target, timeout=60) as client:
                for seed in range(3):
                    client.generate("a lighthouse", width=64, height=64, steps=2, seed=seed)
                    done += 1
                    cls.wait_for('sum(stowage_requests_total{code="ok"})',
                                 lambda r, n=done: bool(r) and float(r[0]["value"][1]) >= n)
                try:
                    client.generate("", steps=1)
                except StowageError:
                    pass
        time.sleep(2)  # A few more scrapes.

    @classmethod
    def _stop(cls) -> None:
        for proc in reversed(cls.procs):
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in cls.logs:
            log.close()

    @classmethod
    def tearDownClass(cls) -> None:
        cls._stop()

    @classmethod
    def get(cls, path: str, **params: str | list[str]) -> dict:
        url = f"{cls.api}/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as e:  # 400/422: a bad expression; the body says why.
            body = json.load(e)
        return body

    @classmethod
    def query(cls, expr: str) -> dict:
        return cls.get("query", query=expr)

    @classmethod
    def wait_for(cls, expr: str, done, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            reply = cls.query(expr)
            if reply.get("status") == "success" and done(reply["data"]["result"]):
                return
            time.sleep(0.25)
        raise RuntimeError(f"{expr} not satisfied in {timeout} s; prometheus: {cls._log('prometheus')}"
                           f"\nserver: {cls._log('server')}")

    def data_problem(self, expr: str) -> str | None:
        """None when `expr` returns at least one series with a finite value, else what is wrong."""
        reply = self.query(expr)
        if reply.get("status") != "success":
            return f"{reply.get('errorType')}: {reply.get('error')}"
        result = reply["data"]["result"]
        if reply["data"]["resultType"] == "scalar":
            result = [{"value": result}]
        if not result:
            return "no data"
        if not any(math.isfinite(float(s["value"][1])) for s in result):
            return f"no finite value: {result}"
        return None

    # ------------------------------------------------------------------------------------------

    def test_every_dashboard_expression_returns_data(self) -> None:
        targets, _ = dashboard_queries(DASHBOARD)
        self.assertGreaterEqual(len(targets), 20)
        problems = [f"{where}: {expr}: {why}" for where, expr in targets
                    if (why := self.data_problem(expr)) is not None]
        self.assertEqual(problems, [], "\n".join(problems))

    def test_every_dashboard_variable_has_values(self) -> None:
        _, variables = dashboard_queries(DASHBOARD)
        for where, definition in variables:
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", definition.strip())
            self.assertIsNotNone(m, f"{where}: {definition}")
            reply = self.get(f"label/{m.group(2)}/values", **{"match[]": m.group(1)})
            self.assertEqual(reply.get("status"), "success", reply)
            self.assertTrue(reply["data"], f"{where}: {definition} has no values")

    def test_the_check_fails_on_a_metric_that_does_not_exist(self) -> None:
        # The checker itself: a misspelt metric, or a label the metric does not have, is no data.
        targets, _ = dashboard_queries(DASHBOARD)
        queue = next(expr for _, expr in targets if "stowage_queue_depth" in expr)
        self.assertIsNone(self.data_problem(queue))
        self.assertEqual(self.data_problem(queue.replace("stowage_queue_depth", "stowage_queue_length")),
                         "no data")
        self.assertEqual(self.data_problem('sum by (component) (stowage_group_offload_bytes{kind="nope"})'),
                         "no data")

    def test_placement_figures_are_what_the_config_made(self) -> None:
        # The series behind the placement panels hold the facts of this server's config.
        reply = self.query('stowage_component_state{component="zimage-tiny/transformer"}')
        states = {s["metric"]["state"] for s in reply["data"]["result"]}
        self.assertEqual(states, {"group_offloaded"})
        reply = self.query('sum(stowage_placement_evictions_total{strategy="workflow",cause="after_run"})')
        self.assertGreaterEqual(float(reply["data"]["result"][0]["value"][1]), 6)
        reply = self.query('sum(stowage_group_offload_forwards_total{component="zimage-tiny/transformer"})')
        self.assertGreater(float(reply["data"]["result"][0]["value"][1]), 0)
        # Two servers, two devices each: four budgets, each the config's.
        reply = self.query('stowage_device_memory_bytes{kind="budget"}')
        budgets = {(s["metric"]["pod"], s["metric"]["device"]): float(s["value"][1]) for s in reply["data"]["result"]}
        self.assertEqual(budgets, {(pod, device): 4294967296 for pod in PODS for device in ("sim:0", "sim:1")})
        # Each device says how often its allocator ran short, by kind (the simulated one never retries).
        reply = self.query("stowage_device_allocator_shortfalls_total")
        shortfalls = {(s["metric"]["pod"], s["metric"]["device"], s["metric"]["kind"]): float(s["value"][1])
                      for s in reply["data"]["result"]}
        self.assertEqual(set(shortfalls), {(pod, device, kind) for pod in PODS for device in ("sim:0", "sim:1")
                                           for kind in ("retry", "oom")})
        self.assertTrue(all(v == 0 for (_, _, kind), v in shortfalls.items() if kind == "retry"), shortfalls)

    def test_dashboard_keeps_servers_and_devices_apart(self) -> None:
        # A panel that adds up one device's bytes with another server's, or joins many to many,
        # is wrong with several servers and devices: each per-device series of the placement and
        # streaming panels must carry both the instance and the device.
        targets, _ = dashboard_queries(DASHBOARD)
        for where, expr in targets:
            if not re.search(r"stowage_(device_memory|component_device|group_offload|host_to_device|device_to_host)", expr):
                continue
            with self.subTest(where):
                reply = self.query(expr)
                self.assertEqual(reply.get("status"), "success", reply)
                keys = [(s["metric"].get("instance"), s["metric"].get("device")) for s in reply["data"]["result"]]
                self.assertTrue(keys and all(i and d for i, d in keys), f"{expr}: {keys[:4]}")
                self.assertEqual(len({i for i, _ in keys}), 2, f"{expr}: one series per server expected")

    def test_alert_metrics_exist_and_rules_evaluate(self) -> None:
        with open(ALERTS) as f:
            groups = yaml.safe_load(f)["groups"]
        rules = [r for g in groups for r in g["rules"]]
        names = sorted({m for r in rules for m in re.findall(r"\bstowage_\w+", r["expr"])})
        self.assertTrue(names)
        for name in names:
            with self.subTest(name):
                self.assertIsNone(self.data_problem(name), f"alert metric {name}")
        deadline = time.time() + 15
        while True:
            loaded = {r["name"]: r for g in self.get("rules")["data"]["groups"] for r in g["rules"]}
            if all(loaded.get(r["alert"], {}).get("lastEvaluation", "0001").startswith("20")
                   for r in rules) or time.time() > deadline:
                break
            time.sleep(0.5)
        for r in rules:
            with self.subTest(r["alert"]):
                self.assertIn(r["alert"], loaded)
                self.assertEqual(loaded[r["alert"]]["health"], "ok", loaded[r["alert"]].get("lastError"))
        # Healthy, lightly loaded server: nothing fires.
        firing = [a for a in self.get("alerts")["data"]["alerts"] if a["state"] == "firing"]
        self.assertEqual(firing, [])

    def test_prometheus_adapter_rule_serves_the_hpa_metric(self) -> None:
        with open(ADAPTER) as f:
            adapter = yaml.safe_load(f)
        with open(HPA) as f:
            hpa = yaml.safe_load(f)
        wanted = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
        rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
        served = {}
        for rule in rules:
            series = self.get("series", **{"match[]": rule["seriesQuery"]})
            self.assertEqual(series.get("status"), "success", series)
            self.assertTrue(series["data"], f"adapter seriesQuery {rule['seriesQuery']} matches nothing")
            for s in series["data"]:
                name = re.sub(rule["name"]["matches"], rule["name"]["as"], s["__name__"])
                # As the adapter runs it for an HPA asking for one pod's value.
                expr = (rule["metricsQuery"].replace("<<.Series>>", s["__name__"])
                        .replace("<<.LabelMatchers>>", f'namespace="{NAMESPACE}",pod=~"{POD}"')
                        .replace("<<.GroupBy>>", "pod"))
                served[name] = expr
        self.assertTrue(wanted)
        for name in wanted:
            with self.subTest(name):
                self.assertIn(name, served, f"the HPA wants {name}; the adapter serves {sorted(served)}")
                self.assertIsNone(self.data_problem(served[name]), served[name])
                reply = self.query(served[name])
                self.assertEqual([s["metric"] for s in reply["data"]["result"]], [{"pod": POD}])


if __name__ == "__main__":
    unittest.main()
