"""TLS end to end: a stowage_server whose config turns TLS on (a throwaway CA and server certificate
made with openssl here), reached through both clients with --tls, --ca_cert and a server-name
override; the ways a TLS connection must fail (plaintext, an unknown CA, a name the certificate does
not carry); and the Kubernetes probes exactly as deploy/kubernetes/stowage.yaml writes them.

Run by Bazel as an sh_test (tests/e2e/BUILD); paths come from the environment it sets.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import unittest

import grpc
import yaml

from stowage_client import AdminClient, StowageClient, StowageError

SERVER = os.environ["STOWAGE_SERVER_BIN"]
STOWCTL = os.environ["STOWCTL_BIN"]
MANIFEST = os.environ["STOWAGE_K8S_MANIFEST"]
PYTHONPATH = os.environ["PYTHONPATH"]

# The certificate names only this DNS name (no IP address), so reaching it at 127.0.0.1 needs the
# server-name override; the Kubernetes probes ask for "stowage" (see the manifest's comment).
SERVER_NAME = "stowage"
TOKEN = "tls-e2e-admin-token"


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory: str, name: str) -> None:
    """A self-signed CA: `name`.key and `name`.crt in `directory`."""
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)


def make_server_cert(directory: str, ca: str, dns_name: str) -> None:
    """server.key and server.crt for DNS name `dns_name`, signed by the CA `ca`."""
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "server.key", "-out", "server.csr", "-subj", f"/CN={dns_name}", cwd=directory)
    with open(os.path.join(directory, "server.ext"), "w") as f:
        f.write(f"subjectAltName=DNS:{dns_name}\nextendedKeyUsage=serverAuth\n"
                "basicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "server.ext",
             cwd=directory)


def manifest_probes() -> dict[str, list[str]]:
    """The exec command of each probe of the stowage container in the Kubernetes manifest."""
    with open(MANIFEST) as f:
        documents = [d for d in yaml.safe_load_all(f) if d]
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    container = next(c for c in deployment["spec"]["template"]["spec"]["containers"]
                     if c["name"] == "stowage")
    return {probe: container[probe]["exec"]["command"]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe")}


class TlsEndToEndTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        make_ca(cls.tmp, "ca")
        make_ca(cls.tmp, "other-ca")  # Trusted by nobody: the wrong-CA case.
        make_server_cert(cls.tmp, "ca", SERVER_NAME)
        cls.ca = os.path.join(cls.tmp, "ca.crt")
        with open(cls.ca, "rb") as f:
            cls.ca_pem = f.read()
        config = os.path.join(cls.tmp, "server.txtpb")
        with open(config, "w") as f:
            f.write(f'tls {{ cert_file: "{cls.tmp}/server.crt" key_file: "{cls.tmp}/server.key" }}\n'
                    f'auth {{ admin_token: "{TOKEN}" }}\n')
        port_file = os.path.join(cls.tmp, "ports.json")
        cls.log = os.path.join(cls.tmp, "server.log")
        cls.log_file = open(cls.log, "w")
        cls.proc = subprocess.Popen(
            [SERVER, f"--config={config}", "--grpc_address=127.0.0.1:0", "--metrics_address=none",
             f"--port_file={port_file}"], stdout=cls.log_file, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while not os.path.exists(port_file) or os.path.getsize(port_file) == 0:
            if cls.proc.poll() is not None or time.time() > deadline:
                cls.proc.kill()
                cls.proc.wait()
                raise RuntimeError("server did not start: " + open(cls.log).read())
            time.sleep(0.05)
        with open(port_file) as f:
            cls.target = json.load(f)["grpc_address"]

    @classmethod
    def tearDownClass(cls) -> None:
        cls.proc.terminate()
        try:
            cls.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            cls.proc.kill()
            cls.proc.wait()
        cls.log_file.close()

    def stowctl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([STOWCTL, f"--target={self.target}", "--timeout=20", *args],
                              capture_output=True, text=True, timeout=60)

    def stowctl_tls(self, *args: str) -> subprocess.CompletedProcess:
        return self.stowctl("--tls", f"--ca_cert={self.ca}", f"--server_name={SERVER_NAME}", *args)

    def python_cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["/usr/bin/python3", "-m", "stowage_client", "--target", self.target,
                               "--timeout", "20", *args], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHONPATH=PYTHONPATH))

    # --- The Python client --------------------------------------------------------------------

    def test_python_client_generates_over_tls(self) -> None:
        with StowageClient(self.target, timeout=60, tls=True, root_certificates=self.ca_pem,
                           server_name=SERVER_NAME) as client:
            self.assertEqual([p.name for p in client.list_pipelines()], ["zimage-tiny"])
            result = client.generate("a lock and key", width=64, height=64, steps=1, seed=4)
        self.assertTrue(result.image.startswith(b"\x89PNG\r\n\x1a\n"))
        self.assertEqual((result.width, result.height), (64, 64))

    def test_python_admin_client_over_tls(self) -> None:
        with AdminClient(self.target, TOKEN, timeout=30, tls=True, root_certificates=self.ca_pem,
                         server_name=SERVER_NAME) as admin:
            ids = sorted(c.id for c in admin.get_placement().components)
        self.assertEqual(ids, ["zimage-tiny/text_encoder", "zimage-tiny/transformer",
                               "zimage-tiny/vae", "zimage-tiny/vae_encoder"])

    def test_python_client_refuses_what_tls_must_refuse(self) -> None:
        with open(os.path.join(self.tmp, "other-ca.crt"), "rb") as f:
            other_ca = f.read()
        cases = {
            "plaintext": dict(),
            "unknown CA": dict(tls=True, server_name=SERVER_NAME, root_certificates=other_ca),
            "no name override": dict(tls=True, root_certificates=self.ca_pem),
            "wrong name": dict(tls=True, root_certificates=self.ca_pem, server_name="evil.example"),
        }
        for what, kwargs in cases.items():
            with self.subTest(what), StowageClient(self.target, timeout=10, **kwargs) as client:
                with self.assertRaises(StowageError) as caught:
                    client.list_pipelines()
                self.assertEqual(caught.exception.code, grpc.StatusCode.UNAVAILABLE)
        with self.assertRaises(ValueError):
            StowageClient(self.target, root_certificates=self.ca_pem)  # CA without tls=True.

    def test_python_cli_over_tls(self) -> None:
        ok = self.python_cli("--tls", "--ca-cert", self.ca, "--server-name", SERVER_NAME,
                             "pipelines", "--json")
        self.assertEqual(ok.returncode, 0, ok.stderr)
        self.assertEqual([p["name"] for p in json.loads(ok.stdout)], ["zimage-tiny"])
        # The underscore spellings (stowctl's) are accepted too.
        out = os.path.join(self.tmp, "cli.png")
        gen = self.python_cli("--tls", f"--ca_cert={self.ca}", f"--server_name={SERVER_NAME}",
                              "generate", "--prompt", "a key", "--width", "64", "--height", "64",
                              "--steps", "1", "--out", out)
        self.assertEqual(gen.returncode, 0, gen.stderr)
        with open(out, "rb") as f:
            self.assertTrue(f.read().startswith(b"\x89PNG"))
        admin = self.python_cli("--tls", "--ca-cert", self.ca, "--server-name", SERVER_NAME,
                                "--token", TOKEN, "placement", "--json")
        self.assertEqual(admin.returncode, 0, admin.stderr)
        plain = self.python_cli("pipelines")
        self.assertEqual(plain.returncode, 1, plain.stdout)
        self.assertIn("UNAVAILABLE", plain.stderr)
        usage = self.python_cli("--ca-cert", self.ca, "pipelines")
        self.assertEqual(usage.returncode, 2)
        self.assertIn("need --tls", usage.stderr)

    # --- stowctl ------------------------------------------------------------------------------

    def test_stowctl_over_tls(self) -> None:
        out = os.path.join(self.tmp, "stowctl.png")
        gen = self.stowctl_tls("generate", "--prompt=a padlock", "--width=64", "--height=64",
                               "--steps=1", f"--out={out}")
        self.assertEqual(gen.returncode, 0, gen.stderr)
        with open(out, "rb") as f:
            self.assertTrue(f.read().startswith(b"\x89PNG"))
        listing = self.stowctl_tls("pipelines")
        self.assertEqual(listing.returncode, 0, listing.stderr)
        self.assertIn("zimage-tiny", listing.stdout)
        placement = self.stowctl_tls(f"--token={TOKEN}", "placement")
        self.assertEqual(placement.returncode, 0, placement.stderr)
        self.assertIn("zimage-tiny/transformer", placement.stdout)
        health = self.stowctl_tls("health")
        self.assertEqual((health.returncode, health.stdout.strip()), (0, "SERVING"), health.stderr)

    def test_stowctl_refuses_what_tls_must_refuse(self) -> None:
        cases = {
            "plaintext": [],
            "system roots only": ["--tls", f"--server_name={SERVER_NAME}"],
            "unknown CA": ["--tls", f"--ca_cert={self.tmp}/other-ca.crt",
                           f"--server_name={SERVER_NAME}"],
            "no name override": ["--tls", f"--ca_cert={self.ca}"],
            "wrong name": ["--tls", f"--ca_cert={self.ca}", "--server_name=evil.example"],
        }
        for what, flags in cases.items():
            with self.subTest(what):
                result = self.stowctl("--timeout=5", *flags, "pipelines")
                self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
                self.assertIn("error: 14", result.stderr)  # UNAVAILABLE: the handshake failed.
        for flags in (["--ca_cert=" + self.ca], ["--server_name=x"],
                      ["--tls", f"--ca_cert={self.tmp}/missing.crt"]):
            with self.subTest(flags):
                self.assertEqual(self.stowctl(*flags, "pipelines").returncode, 2)

    # --- The Kubernetes probes ----------------------------------------------------------------

    def run_probe(self, command: list[str], pipelines: str | None = None) -> subprocess.CompletedProcess:
        """Runs a probe command from the manifest here: the image's paths and the pod's port are
        replaced by the test's, nothing else."""
        self.assertEqual(command[0], "/usr/local/bin/stowctl")
        args = [STOWCTL]
        for arg in command[1:]:
            arg = arg.replace("127.0.0.1:50051", self.target)
            arg = arg.replace("/etc/stowage/tls/ca.crt", self.ca)
            if pipelines is not None and arg.startswith("--pipelines="):
                arg = f"--pipelines={pipelines}"
            args.append(arg)
        return subprocess.run(args, capture_output=True, text=True, timeout=30)

    def test_kubernetes_probes_pass_against_the_tls_server(self) -> None:
        probes = manifest_probes()
        for name, command in probes.items():
            with self.subTest(name):
                self.assertIn("--tls", command)
                result = self.run_probe(command)
                self.assertEqual(result.returncode, 0, f"{command}: {result.stdout}{result.stderr}")
        self.assertIn("ready", probes["readinessProbe"])
        self.assertIn("--pipelines=zimage-tiny", probes["readinessProbe"])
        # The readiness probe fails for a pipeline the server does not host.
        missing = self.run_probe(probes["readinessProbe"], pipelines="zimage-tiny,absent")
        self.assertEqual(missing.returncode, 1, missing.stdout + missing.stderr)
        self.assertIn("absent (not hosted)", missing.stdout)


class ReadinessFollowsPipelinesTest(unittest.TestCase):
    """The readiness probe goes from passing to failing when the pipeline it names is unloaded,
    while the liveness probe (health) keeps passing: the pod leaves the endpoints, and is not
    restarted. A plaintext server: the probe's pipeline logic does not depend on TLS."""

    def test_unloading_the_pipeline_makes_the_pod_unready(self) -> None:
        tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        config = os.path.join(tmp, "server.txtpb")
        with open(config, "w") as f:
            f.write(f'auth {{ admin_token: "{TOKEN}" }}\n')
        port_file = os.path.join(tmp, "ports.json")
        proc = subprocess.Popen(
            [SERVER, f"--config={config}", "--grpc_address=127.0.0.1:0", "--metrics_address=none",
             f"--port_file={port_file}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 60
            while not os.path.exists(port_file) or os.path.getsize(port_file) == 0:
                self.assertIsNone(proc.poll(), "server exited")
                self.assertLess(time.time(), deadline, "server did not start")
                time.sleep(0.05)
            with open(port_file) as f:
                target = json.load(f)["grpc_address"]

            def ctl(*args: str) -> subprocess.CompletedProcess:
                return subprocess.run([STOWCTL, f"--target={target}", "--timeout=20", *args],
                                      capture_output=True, text=True, timeout=60)

            ready = ctl("ready", "--pipelines=zimage-tiny")
            self.assertEqual(ready.returncode, 0, ready.stdout + ready.stderr)
            self.assertEqual(ctl("ready").returncode, 0)
            unload = ctl(f"--token={TOKEN}", "unload-pipeline", "--name=zimage-tiny")
            self.assertEqual(unload.returncode, 0, unload.stderr)
            unready = ctl("ready", "--pipelines=zimage-tiny")
            self.assertEqual(unready.returncode, 1, unready.stdout + unready.stderr)
            self.assertIn("zimage-tiny (not hosted)", unready.stdout)
            self.assertEqual(ctl("ready").returncode, 1)  # No READY pipeline at all.
            self.assertEqual(ctl("health").returncode, 0)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    unittest.main()
