"""A real Kubernetes control plane on 127.0.0.1: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok, built by `make cluster-bins`.

    cp = ControlPlane(bin_dir)   # no I/O yet
    cp.start()                   # seconds; raises ControlPlaneError with log tails
    cp.kubectl("get", "nodes")
    cp.stop()                    # every process gone, ports free

Each process runs in its own session so stop() can kill its whole group;
logs stay in the work dir (`cp.logs_tail()` shows the end of each).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2e.cluster.pki import SERVICE_CIDR, Pki, kubeconfig_yaml, make_pki
from e2e.cluster.kwok import MANAGED_ANNOTATION, MANAGED_VALUE
from e2e.cluster.procs import die_with_parent, free_port, terminate
from e2e.cluster.reader import ApiReader, NotFound

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok", "helm")
_REPO = Path(__file__).resolve().parents[2]


class ControlPlaneError(RuntimeError):
    """The control plane could not start, or a kubectl call failed."""


class ControlPlaneTimeout(ControlPlaneError, TimeoutError):
    """A condition waited for by wait_for() did not come true in time."""


def cache_root() -> Path:
    """Where `make` caches the real peers it builds ($CACHE, exported by the Makefile)."""
    return Path(os.environ.get("CACHE", Path.home() / ".cache" / "memstrata"))


def cluster_versions() -> dict[str, str]:
    """The pinned versions (K8S_VERSION, ETCD_VERSION, ...) as mk/cluster.mk, their one home, states them."""
    mk = (_REPO / "mk" / "cluster.mk").read_text()
    return dict(re.findall(r"^(\w+_VERSION)\s*:=\s*(\S+)", mk, re.M))


def bin_dir_from_env() -> tuple[Path | None, str]:
    """Where `make cluster-bins` put the binaries, and why not if they are absent.

    MEMSTRATA_K8S_BIN (exported by mk/cluster.mk) wins; otherwise the path is
    derived from the versions in mk/cluster.mk, so plain `pytest` finds them too.
    """
    env = os.environ.get("MEMSTRATA_K8S_BIN")
    if env:
        path = Path(env)
    else:
        v = cluster_versions()
        path = cache_root() / (
            f"k8s-{v['K8S_VERSION']}-etcd{v['ETCD_VERSION']}"
            f"-kwok{v['KWOK_VERSION']}-helm{v['HELM_VERSION']}"
        ) / "bin"
    missing = [b for b in BINARIES if not (path / b).is_file()]
    if not (path / ".built").exists() or missing:
        return None, f"control-plane binaries not built in {path} (missing: {missing or ['.built']}); run `make cluster-bins`"
    return path, ""


class ControlPlane:
    """One throwaway control plane; use start()/stop() or `with`."""

    def __init__(self, bin_dir: Path, workdir: Path | None = None, startup_timeout_s: float = 90.0,
                 advertise_address: str | None = None) -> None:
        """`advertise_address`: the host address a real node's pods reach the API server at (through the
        `kubernetes` Service and kube-proxy); the server then listens on every address, because the tests'
        kubeconfig keeps 127.0.0.1 and the pods need the host's address (every request still needs a client
        certificate or a token). None: 127.0.0.1 only, for clusters whose nodes are all kwok's."""
        self.bin_dir = bin_dir
        self.advertise_address = advertise_address
        self.share_dir = bin_dir.parent / "share" / "kwok"
        self._workdir_arg = workdir
        self.startup_timeout_s = startup_timeout_s
        self.workdir: Path = Path()
        self.kubeconfig: Path = Path()
        self.server = ""
        self.startup_seconds = 0.0
        # Seconds since start() at the end of each phase, for reports.
        self.phase_seconds: dict[str, float] = {}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._pki: Pki | None = None
        self._apiserver_args: list[str] = []
        self._reader: ApiReader | None = None

    # -- lifecycle -------------------------------------------------------
    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        began = time.monotonic()
        self.workdir = self._workdir_arg or Path(tempfile.mkdtemp(prefix="memstrata-cp-"))
        def phase(name: str) -> None:
            self.phase_seconds[name] = round(time.monotonic() - began, 2)

        try:
            self._pki = make_pki(self.workdir / "pki", extra_ips=(self.advertise_address,) if self.advertise_address else ())
            phase("pki")
            etcd_url = self._start_etcd()
            phase("etcd")
            self._start_apiserver(etcd_url)
            phase("apiserver")
            self._start_controllers()
            phase("controllers")
            self._install_kwok_stages()
            self._start_kwok()
            phase("kwok")
            self._wait_for_default_serviceaccount("default")
            phase("serviceaccount")
        except BaseException as e:
            tails = self.logs_tail()
            self.stop(keep_workdir=True)
            if isinstance(e, ControlPlaneError):
                raise ControlPlaneError(f"{e} (logs kept in {self.workdir})\n{tails}") from None
            raise
        self.startup_seconds = time.monotonic() - began

    def stop(self, keep_workdir: bool = False) -> None:
        """Terminate in reverse start order (SIGKILL each group after 10 s),
        then delete the work dir unless asked to keep it (for its logs) or
        the caller chose it."""
        for name in reversed(list(self._procs)):
            terminate(self._procs[name], grace_s=10)
        self._procs.clear()
        self._reader = None
        if not keep_workdir and self._workdir_arg is None and self.workdir.is_dir() and self.workdir != Path():
            shutil.rmtree(self.workdir, ignore_errors=True)

    def logs_tail(self, lines: int = 25) -> str:
        out = []
        for log in sorted(self.workdir.glob("*.log")) if self.workdir.is_dir() else []:
            text = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"----- {log} (last {len(text)} lines)\n" + "\n".join(text))
        return "\n".join(out)

    @property
    def pki(self) -> Pki:
        """The credentials of this cluster (a real node signs its kubelet's certificate with the CA)."""
        assert self._pki is not None, "start() first"
        return self._pki

    # -- helpers for tests ----------------------------------------------
    def kubectl(self, *args: str, input: str | None = None, timeout: float = 60, check: bool = True) -> str:
        """Run kubectl against this cluster; returns stdout, raises with stderr on failure."""
        cmd = [str(self.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def get_json(self, *args: str) -> dict[str, Any]:
        """`kubectl get ARGS -o json`, parsed: read in-process where ARGS is a plain form (e2e.cluster.reader),
        else, or when that read fails in any other way than NotFound, by kubectl itself (its errors are the ones
        the tests know)."""
        try:
            if self._reader is None and self.kubeconfig.is_file():
                self._reader = ApiReader(self.kubeconfig)
            got = self._reader.get(args) if self._reader is not None else None
        except NotFound as exc:
            raise ControlPlaneError(f"kubectl get {' '.join(args)} failed (1): Error from server (NotFound): {exc}"
                                    ) from None
        except Exception:  # noqa: BLE001 - a server restarting, a refused request: kubectl reports it
            got = None
        return got if got is not None else json.loads(self.kubectl("get", *args, "-o", "json"))

    def find_json(self, *args: str) -> dict[str, Any] | None:
        """get_json, or None where the object does not exist (`kubectl get --ignore-not-found`)."""
        try:
            return self.get_json(*args)
        except ControlPlaneError as exc:
            if "(NotFound)" in str(exc):
                return None
            raise

    def apply(self, *manifests: dict[str, Any], namespace: str | None = None) -> str:
        """Server-side apply of manifest dicts, into `namespace` when given."""
        return self._send("apply", ["--server-side", "--force-conflicts"], manifests, namespace)

    def create(self, *manifests: dict[str, Any], namespace: str | None = None) -> str:
        """`kubectl create` — keeps status fields, which fake nodes rely on."""
        return self._send("create", [], manifests, namespace)

    def _send(self, verb: str, flags: list[str], manifests: tuple[dict[str, Any], ...], ns: str | None) -> str:
        # One List document, so kubectl parses all of it before sending any.
        doc = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(manifests)})
        return self.kubectl(verb, *flags, *(["-n", ns] if ns else []), "-f", "-", input=doc)

    def helm(self, *args: str, timeout: float = 120) -> str:
        cmd = [str(self.bin_dir / "helm"), "--kubeconfig", str(self.kubeconfig), *args]
        env = {**os.environ, "HELM_CACHE_HOME": str(self.workdir / "helm"), "HELM_CONFIG_HOME": str(self.workdir / "helm")}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            raise ControlPlaneError(f"helm {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def create_namespace(self, name: str) -> None:
        """Create a namespace and wait for its default ServiceAccount, without
        which the ServiceAccount admission plugin rejects every pod."""
        self.kubectl("create", "namespace", name)
        self._wait_for_default_serviceaccount(name)

    def wait_established(self, crd: str, timeout: float = 60) -> None:
        """Until the CRD `crd` serves its kind. Polled here rather than by `kubectl wait`, which fails at once
        ("status.conditions accessor error") when it reads the CRD before the API server has written any condition."""
        def established() -> bool:
            conditions = (self.get_json("crd", crd).get("status") or {}).get("conditions") or []
            return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)

        self.wait_for(f"CRD {crd} established", established, timeout=timeout)

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float = 60, interval: float = 0.25) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            self._check_alive()
            if time.monotonic() > deadline:
                raise ControlPlaneTimeout(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(interval)

    # -- the processes, in start order -----------------------------------
    def _start_etcd(self) -> str:
        client, peer = free_port(), free_port()
        url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        self._spawn("etcd", [
            "--name=e2e", f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={url}", f"--advertise-client-urls={url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=e2e={peer_url}", "--log-level=warn",
            # A throwaway cluster: durability buys nothing and fsync costs seconds.
            "--unsafe-no-fsync", "--quota-backend-bytes=2147483648",
        ])  # fmt: skip
        self._wait_http("etcd health", f"{url}/health", insecure=False)
        return url

    def _start_apiserver(self, etcd_url: str) -> None:
        pki = self._pki
        assert pki is not None
        port = free_port()
        self.server = f"https://127.0.0.1:{port}"
        self.kubeconfig = self.workdir / "kubeconfig"
        self.kubeconfig.write_text(kubeconfig_yaml(self.server, pki))
        self._apiserver_args = [
            f"--etcd-servers={etcd_url}",
            f"--bind-address={'0.0.0.0' if self.advertise_address else '127.0.0.1'}",
            f"--advertise-address={self.advertise_address or '127.0.0.1'}",
            # Towards kubelets (kubectl logs/exec on a real node).
            f"--kubelet-client-certificate={pki.kubelet_client_cert}", f"--kubelet-client-key={pki.kubelet_client_key}",
            f"--secure-port={port}", f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki.server_cert}", f"--tls-private-key-file={pki.server_key}",
            f"--client-ca-file={pki.ca_cert}", "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}", f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true", "--profiling=false",
        ]  # fmt: skip
        self._spawn("kube-apiserver", self._apiserver_args)
        self._wait_http("kube-apiserver /readyz", f"{self.server}/readyz", insecure=False, client_cert=True)

    def restart_apiserver(self, down_seconds: float = 2.0, grace_s: float = 5.0) -> float:
        """Stop kube-apiserver (SIGTERM, then SIGKILL after grace_s: an upgrade that does not wait for
        every watch to drain), keep it down for `down_seconds`, start it again on the same address; returns
        the seconds until it answered /readyz again. Every client's watches and in-flight requests break."""
        began = time.monotonic()
        terminate(self._procs["kube-apiserver"], grace_s=grace_s)
        time.sleep(down_seconds)
        self._spawn("kube-apiserver", self._apiserver_args, append=True)
        self._wait_http("kube-apiserver /readyz", f"{self.server}/readyz", insecure=False, client_cert=True)
        return time.monotonic() - began

    def _start_controllers(self) -> None:
        pki = self._pki
        assert pki is not None
        kc = f"--kubeconfig={self.kubeconfig}"
        delegated = [f"--authentication-kubeconfig={self.kubeconfig}", f"--authorization-kubeconfig={self.kubeconfig}"]
        kcm_port, sched_port = free_port(), free_port()
        self._spawn("kube-controller-manager", [
            kc, *delegated, "--bind-address=127.0.0.1", f"--secure-port={kcm_port}",
            f"--cert-dir={self.workdir / 'kcm-certs'}", "--leader-elect=false",
            # Service accounts, their tokens and the kube-root-ca.crt ConfigMap
            # need the signing key and the CA; Jobs need the job controller (on by default).
            f"--service-account-private-key-file={pki.sa_key}", f"--root-ca-file={pki.ca_cert}",
            f"--cluster-signing-cert-file={pki.ca_cert}", f"--cluster-signing-key-file={pki.ca_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--controllers=*",
        ])  # fmt: skip
        self._spawn("kube-scheduler", [
            kc, *delegated, "--bind-address=127.0.0.1", f"--secure-port={sched_port}",
            f"--cert-dir={self.workdir / 'scheduler-certs'}", "--leader-elect=false",
        ])  # fmt: skip
        # Their serving certs are self-signed; /healthz is open to anyone.
        self._wait_http("kube-controller-manager /healthz", f"https://127.0.0.1:{kcm_port}/healthz", insecure=True)
        self._wait_http("kube-scheduler /readyz", f"https://127.0.0.1:{sched_port}/readyz", insecure=True)

    def _install_kwok_stages(self) -> None:
        files = sorted(self.share_dir.glob("*.yaml"))
        crd = self.share_dir / "crd-stages.yaml"
        if not crd.is_file():
            raise ControlPlaneError(f"kwok manifests missing in {self.share_dir}; re-run `make cluster-bins`")
        self.kubectl("apply", "--server-side", "-f", str(crd))
        self.wait_established("stages.kwok.x-k8s.io")
        stages = [f for f in files if f != crd]
        self.kubectl("apply", "--server-side", *(a for f in stages for a in ("-f", str(f))))

    def _start_kwok(self) -> None:
        # kwok always loads ~/.kwok/kwok.yaml when it exists, even with
        # --config; a HOME of its own keeps a developer's file out of tests.
        # No KwokConfiguration at all means kwok's defaults (a document with
        # empty options would zero its parallelism settings).
        self._spawn("kwok", [
            f"--kubeconfig={self.kubeconfig}",
            f"--manage-nodes-with-annotation-selector={MANAGED_ANNOTATION}={MANAGED_VALUE}",
            "--enable-crds=Stage", "--node-lease-duration-seconds=40", "--cidr=10.244.0.0/16",
            f"--node-port={free_port()}",
        ], env={**os.environ, "HOME": str(self.workdir)})  # fmt: skip

    def _wait_for_default_serviceaccount(self, namespace: str) -> None:
        def exists() -> bool:
            return self.find_json("serviceaccount", "default", "-n", namespace) is not None

        self.wait_for(f"ServiceAccount default in namespace {namespace}", exists, timeout=self.startup_timeout_s)

    # -- plumbing ---------------------------------------------------------
    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None, append: bool = False) -> None:
        log = open(self.workdir / f"{name}.log", "ab" if append else "wb")
        with log:
            self._procs[name] = subprocess.Popen(
                [str(self.bin_dir / name), *args], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.workdir,
                preexec_fn=die_with_parent, env=env,
            )  # fmt: skip

    def _check_alive(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise ControlPlaneError(f"{name} exited with status {proc.returncode}")

    def _wait_http(self, what: str, url: str, *, insecure: bool, client_cert: bool = False) -> None:
        ctx = ssl.create_default_context()
        if insecure:
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        elif self._pki is not None and url.startswith("https"):
            ctx.load_verify_locations(self._pki.ca_cert)
        if client_cert and self._pki is not None:
            ctx.load_cert_chain(self._pki.admin_cert, self._pki.admin_key)

        def ok() -> bool:
            try:
                with urllib.request.urlopen(url, timeout=2, context=ctx) as r:
                    return r.status == 200
            except OSError:
                return False

        self.wait_for(what, ok, timeout=self.startup_timeout_s, interval=0.1)
