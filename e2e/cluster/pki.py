"""Certificates and keys for a throwaway control plane, made with the openssl CLI.

One CA signs the API server's serving certificate and an admin client
certificate (group system:masters); a separate RSA key signs service-account
tokens. ECDSA P-256 keeps generation to milliseconds, which matters because
every test session makes a fresh set.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

# The API server is reached as 127.0.0.1 from the host and, by in-cluster
# clients, through the `kubernetes` Service whose ClusterIP is the first
# address of the service range.
SERVICE_CIDR = "10.0.0.0/24"
KUBERNETES_SERVICE_IP = "10.0.0.1"
_SERVER_SANS = [
    "IP:127.0.0.1",
    f"IP:{KUBERNETES_SERVICE_IP}",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
]
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Pki:
    """Paths of every credential file the control plane's processes read."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path
    # The API server's client certificate towards kubelets (logs, exec); system:masters.
    kubelet_client_cert: Path
    kubelet_client_key: Path


def _openssl(*args: str) -> None:
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {proc.stderr.strip()}")


def _signed(
    directory: Path, name: str, subject: str, ca: tuple[Path, Path], extensions: list[str]
) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    ext_args = [a for e in extensions for a in ("-addext", e)]
    # `req -x509 -CA` (OpenSSL >= 3.0) issues a CA-signed leaf in one call.
    _openssl(
        "req", "-x509", *_EC, "-keyout", str(key), "-out", str(cert), "-days", "2",
        "-subj", subject, "-CA", str(ca[0]), "-CAkey", str(ca[1]), *ext_args,
    )  # fmt: skip
    return cert, key


def _client(directory: Path, name: str, user: str, group: str, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    return _signed(directory, name, f"/O={group}/CN={user}", ca,
                   ["basicConstraints=CA:FALSE", "extendedKeyUsage=clientAuth"])


def sign_client(pki: Pki, directory: Path, name: str, user: str, group: str) -> tuple[Path, Path]:
    """A client certificate for `user` in `group`, signed by the cluster's CA (a kubelet is
    system:node:<name> in system:nodes; kube-proxy is system:kube-proxy)."""
    directory.mkdir(parents=True, exist_ok=True)
    return _client(directory, name, user, group, (pki.ca_cert, pki.ca_key))


def client_kubeconfig(server: str, ca_cert: Path, cert: Path, key: Path, user: str = "client") -> str:
    """A kubeconfig for one client certificate."""
    return f"""apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: {server}
    certificate-authority: {ca_cert}
users:
- name: {user}
  user:
    client-certificate: {cert}
    client-key: {key}
contexts:
- name: e2e
  context: {{cluster: e2e, user: {user}}}
current-context: e2e
"""


def make_pki(directory: Path, extra_ips: tuple[str, ...] = ()) -> Pki:
    """Write a CA, serving and admin certificates and a service-account key pair. `extra_ips`: more
    addresses the API server is reached at (a real node's pods reach it at the host's address)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = directory / "ca.crt", directory / "ca.key"
    _openssl(
        "req", "-x509", *_EC, "-keyout", str(ca_key), "-out", str(ca_cert), "-days", "2",
        "-subj", "/CN=memstrata-e2e-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
    )  # fmt: skip
    ca = (ca_cert, ca_key)
    server_cert, server_key = _signed(
        directory, "apiserver", "/CN=kube-apiserver", ca,
        ["basicConstraints=CA:FALSE", "extendedKeyUsage=serverAuth",
         "subjectAltName=" + ",".join([*_SERVER_SANS, *(f"IP:{ip}" for ip in extra_ips)])],
    )  # fmt: skip
    admin_cert, admin_key = _client(directory, "admin", "memstrata-e2e-admin", "system:masters", ca)
    kubelet_client_cert, kubelet_client_key = _client(
        directory, "apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters", ca)
    # Service-account tokens are RS256 by default; the controller-manager's
    # token controller signs with the private half, the API server verifies.
    sa_key, sa_pub = directory / "sa.key", directory / "sa.pub"
    _openssl("genrsa", "-out", str(sa_key), "2048")
    _openssl("rsa", "-in", str(sa_key), "-pubout", "-out", str(sa_pub))
    return Pki(ca_cert, ca_key, server_cert, server_key, admin_cert, admin_key, sa_key, sa_pub,
               kubelet_client_cert, kubelet_client_key)


def kubeconfig_yaml(server: str, pki: Pki) -> str:
    """A kubeconfig that authenticates as the admin certificate."""
    return client_kubeconfig(server, pki.ca_cert, pki.admin_cert, pki.admin_key, user="admin")
