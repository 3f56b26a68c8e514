"""The operator's only door to the Kubernetes API for its own writes: a small async client.

Why not the `kubernetes` package's client: it is synchronous, and 500 jobs
submitted at once would queue behind a handful of threads. Credentials still
come from the `kubernetes` package's loaders (kubeconfig or in-cluster), so
every auth form they understand works, including token rotation in a pod.
"""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from typing import Any, AsyncIterator, Callable, Mapping
from urllib.parse import quote

import aiohttp

log = logging.getLogger(__name__)

MERGE = "application/merge-patch+json"
APPLY = "application/apply-patch+yaml"  # JSON is valid YAML


class KubeError(Exception):
    def __init__(self, status: int, reason: str, message: str, method: str, path: str) -> None:
        super().__init__(f"{method} {path}: {status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


class NotLeading(KubeError):
    """A write refused before it was sent: this replica does not hold the Lease (see `write_gate`)."""


class NotFound(KubeError):
    pass


class Conflict(KubeError):
    """409: AlreadyExists on create, or a resourceVersion conflict."""


def api_path(api_version: str, plural: str, namespace: str | None = None, name: str | None = None,
             sub: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace:
        base += f"/namespaces/{quote(namespace)}"
    base += f"/{plural}"
    if name:
        base += f"/{quote(name)}"
    if sub:
        base += f"/{sub}"
    return base


PLURALS = {"Pod": "pods", "ConfigMap": "configmaps", "ServiceAccount": "serviceaccounts", "Role": "roles",
           "RoleBinding": "rolebindings", "Event": "events", "Lease": "leases", "Service": "services",
           "ResourceClaimTemplate": "resourceclaimtemplates", "Workload": "workloads"}


def object_path(obj: Mapping[str, Any], with_name: bool = True) -> str:
    meta = obj["metadata"]
    return api_path(obj["apiVersion"], PLURALS[obj["kind"]], meta.get("namespace"),
                    meta["name"] if with_name else None)


class Kube:
    """One connection pool to one API server. Construct with from_config(); close() when done."""

    def __init__(self, host: str, ssl_context: ssl.SSLContext | bool, config: Any = None,
                 connections: int = 64, timeout_s: float = 30.0) -> None:
        self.host = host.rstrip("/")
        self._ssl = ssl_context
        self._config = config  # kubernetes.client.Configuration, for auth headers and token refresh
        self._connections = connections
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._auth: str | None = None
        self._auth_at = 0.0
        self.requests = 0
        self.observe: Callable[[str, int, float], None] | None = None  # (verb, status or 0, seconds) per request
        # Checked right before every write is sent: one place that keeps a replica which lost its
        # Lease (or never had it) from writing, whichever code path the write comes from.
        self.write_gate: Callable[[], bool] | None = None

    @classmethod
    def from_config(cls, kubeconfig: str | None = None, **kw: Any) -> "Kube":
        from kubernetes import client, config

        cfg = client.Configuration()
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            try:
                config.load_incluster_config(client_configuration=cfg)
            except config.ConfigException:
                config.load_kube_config(client_configuration=cfg)
        ctx: ssl.SSLContext | bool = False
        if cfg.host.startswith("https"):
            ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert) if cfg.verify_ssl else \
                ssl._create_unverified_context()  # noqa: S323 — only when the kubeconfig says so
            if cfg.cert_file:
                ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        return cls(cfg.host, ctx, cfg, **kw)

    def credentials(self) -> dict[str, Any]:
        """Where and who, for another client of the same API server (Kopf's own connection)."""
        cfg = self._config
        self._auth_at = 0.0  # re-read a rotated token now
        auth = self._authorization()
        scheme, _, token = (auth or "").partition(" ")
        return {
            "server": self.host,
            "ca_path": getattr(cfg, "ssl_ca_cert", None),
            "insecure": not getattr(cfg, "verify_ssl", True),
            "certificate_path": getattr(cfg, "cert_file", None),
            "private_key_path": getattr(cfg, "key_file", None),
            "scheme": (scheme if token else None) or None,
            "token": (token if token else scheme) or None,
        }

    def _authorization(self) -> str | None:
        cfg = self._config
        if cfg is None:
            return None
        # In a pod the token file rotates; the loader's hook re-reads it at most once a minute.
        if time.monotonic() - self._auth_at > 30:
            if getattr(cfg, "refresh_api_key_hook", None):
                cfg.refresh_api_key_hook(cfg)
            self._auth = cfg.get_api_key_with_prefix("authorization") or cfg.get_api_key_with_prefix("BearerToken")
            self._auth_at = time.monotonic()
        return self._auth

    async def _session_(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._connections, ssl=self._ssl), timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(self, method: str, path: str, body: Any = None, *, params: Mapping[str, str] | None = None,
                      content_type: str = "application/json") -> dict[str, Any]:
        if method != "GET" and self.write_gate is not None and not self.write_gate():
            raise NotLeading(0, "NotLeading", "this replica does not hold the Lease", method, path)
        headers = {"Accept": "application/json", "Content-Type": content_type}
        auth = self._authorization()
        if auth:
            headers["Authorization"] = auth
        data = json.dumps(body) if body is not None else None
        session = await self._session_()
        self.requests += 1
        started, code = time.perf_counter(), 0
        try:
            async with session.request(method, self.host + path, data=data, params=params, headers=headers) as resp:
                code = resp.status
                text = await resp.text()
        finally:
            if self.observe is not None:
                self.observe(method, code, time.perf_counter() - started)
        if code >= 400:
            try:
                status = json.loads(text)
                reason, message = status.get("reason", ""), status.get("message", text)
            except ValueError:
                reason, message = resp.reason or "", text
            kind = NotFound if code == 404 else Conflict if code == 409 else KubeError
            raise kind(code, reason, message, method, path)
        return json.loads(text) if text else {}

    async def watch(self, path: str, params: Mapping[str, str],
                    opened: asyncio.Event | None = None) -> AsyncIterator[dict[str, Any]]:
        """Events of a watch (params must include watch=true), until the server ends it;
        `opened` is set once the server has accepted the watch."""
        headers = {"Accept": "application/json"}
        auth = self._authorization()
        if auth:
            headers["Authorization"] = auth
        session = await self._session_()
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        async with session.get(self.host + path, params=dict(params), headers=headers, timeout=timeout) as resp:
            if resp.status >= 400:
                raise KubeError(resp.status, resp.reason or "", await resp.text(), "WATCH", path)
            if opened is not None:
                opened.set()
            async for line in resp.content:
                if line.strip():
                    yield json.loads(line)

    # -- verbs --------------------------------------------------------------------------------------
    async def get(self, path: str) -> dict[str, Any]:
        return await self.request("GET", path)

    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        return (await self.request("GET", path, params=params)).get("items", [])

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", object_path(obj, with_name=False), obj)

    async def apply(self, obj: Mapping[str, Any], field_manager: str) -> dict[str, Any]:
        """Server-side apply: create or converge in one idempotent request."""
        return await self.request("PATCH", object_path(obj), obj, content_type=APPLY,
                                  params={"fieldManager": field_manager, "force": "true"})

    async def replace(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """PUT: with metadata.resourceVersion set, a compare-and-swap (409 if someone wrote first)."""
        return await self.request("PUT", object_path(obj), obj)

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", path, patch, content_type=MERGE)

    async def delete(self, path: str, propagation: str = "Background") -> None:
        try:
            await self.request("DELETE", path, {"propagationPolicy": propagation})
        except NotFound:
            pass

    async def delete_collection(self, path: str, label_selector: str) -> None:
        await self.request("DELETE", path, {"propagationPolicy": "Background"},
                           params={"labelSelector": label_selector})


async def gather_ok(*aws: Any) -> list[Any]:
    """asyncio.gather that waits for every request before raising the first error (no stray writes)."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results
