"""A real Kueue controller manager against the e2e control plane (e2e.cluster), built from its Go module by
`make kueue-bins` (e2e/kueue/build; version KUEUE_VERSION in mk/cluster.mk).

What a cluster admin installs, minus the Deployment: the release's CRDs, its admission webhooks for Kueue's own
kinds (Workloads included, so every Workload the operator creates or patches is defaulted and validated by Kueue
itself, as in a cluster), and the manager with a Configuration that names FineTuneJob as an external framework.

The webhooks are reached at https://127.0.0.1:<port>: the manager serves them with the API server's own
certificate (its SANs include 127.0.0.1) and the API server checks it with the cluster's CA. Kueue 0.17 reads its
metrics server's certificate from a fixed path when it does not manage certificates itself
(/etc/kueue/metrics/certs); the same certificate is put there for the session and removed after.
"""
from __future__ import annotations

import base64
import os
import urllib.request
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster.controlplane import ControlPlane, ControlPlaneError, cache_root, cluster_versions
from e2e.cluster.procs import die_with_parent, free_port, terminate
from memstrata.api.finetunejob import GROUP, KIND, VERSION

METRICS_CERTS = Path("/etc/kueue/metrics/certs")  # fixed in Kueue 0.17's main.go
KUEUE_GROUP = "kueue.x-k8s.io"


def kueue_dir_from_env(to_run: bool = True) -> tuple[Path | None, str]:
    """Where `make kueue-bins` put Kueue (bin/kueue, share/kueue), and why not when it is absent; `to_run`: the
    controller is to be run here (not only its CRDs installed)."""
    env = os.environ.get("MEMSTRATA_KUEUE_DIR")
    path = Path(env) if env else cache_root() / f"kueue-{cluster_versions()['KUEUE_VERSION']}"
    if not (path / "bin" / ".built").exists():
        return None, f"Kueue is not built in {path}; run `make kueue-bins`"
    if to_run and os.geteuid() != 0:
        return None, f"Kueue {cluster_versions()['KUEUE_VERSION']} reads its metrics certificate from " \
                     f"{METRICS_CERTS}, which needs root to write"
    return path, ""


def configuration(webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": "kueue-system",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        # No job kind of Kueue's own: only the Workloads memstrata's operator makes. FineTuneJob as an external
        # framework, so that Kueue's pod integration (were it on) leaves a FineTuneJob's pods alone.
        "integrations": {"frameworks": [], "externalFrameworks": [f"{KIND}.{VERSION}.{GROUP}"]},
        "manageJobsWithoutQueueName": False,
        # All-or-nothing: a Workload whose pods do not all run within the timeout is evicted. On, and short, so
        # that a job whose operator never reports PodsReady is evicted within the tests' time.
        "waitForPodsReady": {"timeout": "10s", "blockAdmission": False},
    }


def webhooks(share: Path, port: int, ca_bundle: str) -> list[dict[str, Any]]:
    """The release's webhook configurations, only the hooks of Kueue's own kinds, each called at 127.0.0.1."""
    out = []
    for doc in yaml.safe_load_all((share / "manifests.yaml").read_text()):
        hooks = [h for h in doc["webhooks"] if all(KUEUE_GROUP in r["apiGroups"] for r in h["rules"])]
        for h in hooks:
            path = h["clientConfig"]["service"]["path"]
            h["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}
        doc["metadata"]["name"] = f"memstrata-e2e-kueue-{doc['metadata']['name']}"
        out.append({**doc, "webhooks": hooks})
    return out


def install_crds(cluster: ControlPlane, share: Path) -> None:
    """Kueue's CRDs as released (share/kueue), established."""
    crds = sorted(str(p) for p in share.glob(f"{KUEUE_GROUP}_*.yaml"))
    cluster.kubectl("apply", "--server-side", *(a for f in crds for a in ("-f", f)), timeout=120)
    for f in crds:
        cluster.wait_established(Path(f).stem.split("_", 1)[1] + "." + KUEUE_GROUP)


class Kueue:
    """Kueue's manager as a subprocess of the test session; start() returns once it serves its webhooks."""

    def __init__(self, cluster: ControlPlane, kueue_dir: Path) -> None:
        self.cluster = cluster
        self.binary = kueue_dir / "bin" / "kueue"
        self.share = kueue_dir / "share" / "kueue"
        self.workdir = cluster.workdir / "kueue"
        self.log = self.workdir / "kueue.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds = 0.0
        self._webhooks: list[str] = []
        self._placed: list[Path] = []

    def start(self, timeout: float = 90) -> "Kueue":
        began = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        install_crds(self.cluster, self.share)
        self.cluster.kubectl("create", "namespace", "kueue-system", check=False)
        pki = self.cluster.pki
        certs = self.workdir / "certs"
        for d in (certs, METRICS_CERTS):
            d.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(pki.server_cert, d / "tls.crt")
            shutil.copyfile(pki.server_key, d / "tls.key")
        self._placed = [METRICS_CERTS / "tls.crt", METRICS_CERTS / "tls.key"]
        webhook_port, health_port = free_port(), free_port()
        config = self.workdir / "config.yaml"
        config.write_text(yaml.safe_dump(configuration(webhook_port, health_port, certs)))
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), f"--config={config}",
                 # Its API server (pending workloads) wants a certificate at a fixed path, /visibility.
                 "--feature-gates=VisibilityOnDemand=false"], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.workdir, preexec_fn=die_with_parent,
                env={**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig)})
        self._wait_ready(health_port, timeout)
        ca = base64.b64encode(pki.ca_cert.read_bytes()).decode()
        docs = webhooks(self.share, webhook_port, ca)
        self.cluster.apply(*docs)
        self._webhooks = [f"{d['kind'].lower()}/{d['metadata']['name']}" for d in docs]
        self._wait_webhooks(timeout)
        self.startup_seconds = time.monotonic() - began
        return self

    def _wait_ready(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise ControlPlaneError(f"kueue exited with status {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"kueue not ready after {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.5)

    def _wait_webhooks(self, timeout: float) -> None:
        """Until the API server reaches the webhooks: a ResourceFlavor created through them (a dry run)."""
        probe = {"apiVersion": f"{KUEUE_GROUP}/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "probe"}}
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.cluster.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(probe))
                return
            except ControlPlaneError as exc:
                if time.monotonic() > deadline:
                    raise ControlPlaneError(f"Kueue's webhooks unreachable: {exc}\n{self.tail()}") from None
                time.sleep(0.5)

    def stop(self) -> None:
        if self._webhooks:
            self.cluster.kubectl("delete", "--ignore-not-found", *self._webhooks, check=False)
        if self.proc is not None:
            terminate(self.proc, grace_s=10)  # type: ignore[arg-type]
            self.proc = None
        for f in self._placed:  # what this session put there, and the directories it leaves empty
            f.unlink(missing_ok=True)
        for d in (METRICS_CERTS, METRICS_CERTS.parent, METRICS_CERTS.parent.parent):
            try:
                d.rmdir()
            except OSError:
                break

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no kueue log)"
