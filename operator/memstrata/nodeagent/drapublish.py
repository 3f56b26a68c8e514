"""The node's ResourceSlice and the claims the DRA driver reads: the driver's side of the API server.

One slice per node (pool = the node's name), owned by the Node so that deleting the Node removes it.
It is written only when its devices change; each change bumps the pool's generation, as the scheduler
expects of a pool that is replaced. A slice another agent left (a restart) is taken over, its generation
continued. An unchanged slice is read back every VERIFY_S, and at once when the kubelet registers the plugin
(a starting kubelet deletes its node's slices): one found missing is written again.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from memstrata.api import dra

log = logging.getLogger(__name__)
# How often an unchanged slice is read back: a kubelet restart, a Node re-created or a hand-deleted slice leave
# nothing in the agent's own view, and the scheduler sees no devices until the slice is back.
VERIFY_S = 30.0


def api_client(kubeconfig: str | None) -> Any:
    """A kubernetes ApiClient from `kubeconfig`, or the pod's in-cluster identity."""
    from kubernetes import client, config

    if kubeconfig:
        return config.new_client_from_config(kubeconfig)
    config.load_incluster_config()
    return client.ApiClient()


def slice_name(node_name: str) -> str:
    return f"{node_name}-{dra.DRIVER}"


class SlicePublisher:
    """Keeps the node's ResourceSlice equal to what the driver offers. The constructor does no I/O."""

    def __init__(self, node_name: str, kubeconfig: str | None, verify_s: float = VERIFY_S) -> None:
        self.node_name = node_name
        self.kubeconfig = kubeconfig
        self.verify_s = verify_s
        self._client: Any = None
        self._devices: list[dict[str, Any]] | None = None  # what the slice holds, as last written or read
        self._checked = 0.0  # when the API server last showed the slice so (time.monotonic)
        self._generation = 0

    def forget(self) -> None:
        """Read the slice afresh at the next publish: a kubelet that (re)starts deletes its node's slices."""
        self._devices = None

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = api_client(self.kubeconfig)
        return self._client

    def _resource(self) -> Any:
        from kubernetes import client

        return client.ResourceV1Api(self.client)

    def publish(self, spec_of: Any) -> bool:
        """Make the slice hold `spec_of(generation)["devices"]`; True when it was written.

        `spec_of` renders the slice's spec for a pool generation (memstrata.nodeagent.draslice.slice_spec)."""
        from kubernetes.client.exceptions import ApiException

        wanted = spec_of(self._generation)["devices"]
        if wanted == self._devices and time.monotonic() - self._checked < self.verify_s:
            return False
        api = self._resource()
        name = slice_name(self.node_name)
        try:
            current = self.client.sanitize_for_serialization(api.read_resource_slice(name))
        except ApiException as exc:
            if exc.status != 404:
                raise
            current = None
        if current is not None:
            self._generation = max(self._generation, int(current["spec"]["pool"].get("generation", 0)))
            if current["spec"].get("devices", []) == wanted and current["spec"].get("nodeName") == self.node_name:
                self._devices, self._checked = wanted, time.monotonic()
                return False
        self._generation += 1
        body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "metadata": {"name": name, "ownerReferences": self._owner()}, "spec": spec_of(self._generation)}
        if current is None:
            api.create_resource_slice(body)
        else:
            body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            api.replace_resource_slice(name, body)
        self._devices, self._checked = wanted, time.monotonic()
        log.info("ResourceSlice %s: generation %d, devices %s", name, self._generation, [d["name"] for d in wanted])
        return True

    def _owner(self) -> list[dict[str, Any]]:
        from kubernetes import client

        node = client.CoreV1Api(self.client).read_node(self.node_name)
        return [{"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": node.metadata.uid,
                 "controller": True}]

    def claim(self, namespace: str, name: str) -> dict[str, Any]:
        """A ResourceClaim, as a plain dict."""
        return self.client.sanitize_for_serialization(
            self._resource().read_namespaced_resource_claim(name, namespace))
