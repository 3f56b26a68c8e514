"""`kubectl get ... -o json` answered in-process by the real API server, through the Kubernetes Python client.

The tests poll the cluster (a pod's phase, a job's status, a Lease) every quarter second. Each poll through the
kubectl binary is a fresh Go process of about 50 ms of CPU; on the 2-core CI machine the suite's thousands of them
were minutes of CPU taken from every other test. The same GET through one long-lived client costs a few ms. What
comes back is what kubectl prints: the object, or a List whose items carry their kind and apiVersion.

Only the plain forms are read here (`RESOURCE [NAME] [-n NS | -A] [-l SELECTOR]`); anything else returns None and
the caller runs kubectl itself, so no form the tests use reads differently.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

_FLAGS_WITH_VALUE = {"-n": "namespace", "--namespace": "namespace", "-l": "selector", "--selector": "selector"}
_ALL_NAMESPACES = ("-A", "--all-namespaces")
REQUEST_TIMEOUT_S = 60  # what a kubectl poll was given (ControlPlane.kubectl)
MISS_RETRY_S = 10.0  # a name discovery did not know is looked up again (a full re-read) at most this often


class NotFound(LookupError):
    """The API server answered 404 for the object: what kubectl reports as `Error from server (NotFound)`."""


def parse_get(args: tuple[str, ...]) -> dict[str, Any] | None:
    """The parts of `kubectl get ARGS` this reader serves, or None where ARGS uses anything else."""
    out: dict[str, Any] = {"positional": [], "namespace": None, "selector": None, "all": False}
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if arg in _FLAGS_WITH_VALUE and rest:
            out[_FLAGS_WITH_VALUE[arg]] = rest.pop(0)
        elif arg in _ALL_NAMESPACES:
            out["all"] = True
        elif arg.startswith("-") or "/" in arg or "," in arg:
            return None  # another flag, a TYPE/NAME or a list of types: kubectl's own
        else:
            out["positional"].append(arg)
    if len(out["positional"]) == 2 and (out["all"] or out["selector"]):
        return None  # a name with -A or -l: kubectl refuses it, in its own words
    return out if 1 <= len(out["positional"]) <= 2 else None


def _as_printed(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as kubectl prints it: without metadata.managedFields (shown only with --show-managed-fields)."""
    (obj.get("metadata") or {}).pop("managedFields", None)
    return obj


class ApiReader:
    """GETs against one cluster through a kubeconfig, resolving resource names as kubectl does (plural,
    singular, short name or `plural.group`) through the API's discovery, once per name."""

    def __init__(self, kubeconfig: Path) -> None:
        from kubernetes import config, dynamic

        # Discovery's cache file beside the kubeconfig (the client's default is one in /tmp, left behind).
        self._client = dynamic.DynamicClient(config.new_client_from_config(config_file=str(kubeconfig)),
                                             cache_file=str(kubeconfig.parent / "discovery.json"))
        self._lock = threading.Lock()
        self._resources: dict[str, Any] = {}
        self._missed: dict[str, float] = {}

    def get(self, args: tuple[str, ...]) -> dict[str, Any] | None:
        """What `kubectl get ARGS -o json` prints, parsed; None where ARGS is not a form served here or names a
        resource the server does not list. Raises NotFound for a named object that does not exist."""
        parsed = parse_get(args)
        if parsed is None:
            return None
        resource = self._resource(parsed["positional"][0])
        if resource is None:
            return None
        from kubernetes.dynamic.exceptions import NotFoundError

        name = parsed["positional"][1] if len(parsed["positional"]) == 2 else None
        namespace = None if not resource.namespaced or (parsed["all"] and name is None) else (
            parsed["namespace"] or "default")
        try:
            got = resource.get(name=name, namespace=namespace, label_selector=parsed["selector"],
                               _request_timeout=REQUEST_TIMEOUT_S).to_dict()
        except NotFoundError as exc:
            if name is None:  # the resource itself is gone (a CRD deleted): forget it, kubectl says so
                with self._lock:
                    self._resources = {k: r for k, r in self._resources.items() if r is not resource}
                return None
            raise NotFound(f'{resource.kind} "{name}" not found ({exc.status} {exc.reason})') from None
        if name is not None:
            return _as_printed(got)
        kind, version = resource.kind, resource.group_version
        items = [_as_printed({"apiVersion": version, "kind": kind, **item}) for item in got.get("items") or []]
        return {"apiVersion": "v1", "kind": "List", "items": items, "metadata": {"resourceVersion": ""}}

    def _resource(self, name: str) -> Any:
        """The API resource `name` stands for, memoised; discovery is read again when no resource matches (a CRD
        installed since it was read), at most every MISS_RETRY_S for one name."""
        name = name.lower()
        with self._lock:
            for attempt in range(2):
                if name in self._resources:
                    break
                if attempt:
                    if time.monotonic() - self._missed.get(name, -MISS_RETRY_S) < MISS_RETRY_S:
                        break
                    self._missed[name] = time.monotonic()
                    self._client.resources.invalidate_cache()
                found = [r for r in self._client.resources.search() if _names(r, name)]
                if found:
                    self._resources[name] = next((r for r in found if getattr(r, "preferred", False)), found[0])
            return self._resources.get(name)


def _names(resource: Any, name: str) -> bool:
    """Whether kubectl would take `name` (lowercased) for `resource`: its plural, kind, singular or a short name, or
    `plural.group`."""
    own = getattr(resource, "name", None)  # discovery's List pseudo-resource has none
    if not own or "/" in own:  # nor is a subresource (pods/log) read here
        return False
    plural, _, group = name.partition(".")
    if group:
        return bool(own == plural and resource.group == group)
    kind = str(getattr(resource, "kind", "")).lower()
    return name in (own, kind, getattr(resource, "singular_name", None), *(getattr(resource, "short_names", None) or ()))
