"""A job on several nodes (spec.resources.nodes) as the operator runs it: M nodes chosen together or none,
M pods per attempt with stable DNS names through one headless Service, and gang semantics - one pod lost
fails the whole attempt once, its siblings are stopped, the next attempt is M new pods. Driven through the
pure lifecycle with the pods the renderer really makes."""
from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from ftj_factories import at, inventory, job_dict, node_dict

from memstrata.api.jobstatus import FineTuneJobStatus
from memstrata.api.runtimeconfig import RENDEZVOUS_PORT
from memstrata.operator import gang, names, render
from memstrata.operator.actions import CreateAttempt, Decision, DeletePods, Event, PatchStatus
from memstrata.operator.lifecycle import LifecyclePolicy, decide
from memstrata.operator.nodes import PodUse, node_view, usage_by_node
from memstrata.operator.observe import job_view, pod_view
from memstrata.operator.scheduling import place

POLICY = LifecyclePolicy(backoff_base_seconds=10, backoff_max_seconds=40, unschedulable_retry_seconds=30)
QUOTA_ERROR = ('POST /api/v1/namespaces/team-a/pods: 403 Forbidden: pods "llama-0-1" is forbidden: exceeded quota: '
               'pods, requested: pods=1, used: pods=1, limited: pods=1')


def _nodes(*names_: str, dram_gib: int = 1024) -> list[Any]:
    return [node_view(node_dict(n, inventory(n, dram_gib=dram_gib))) for n in names_]


def _job(nodes: int = 2, name: str = "llama", **kw: Any) -> dict[str, Any]:
    job = job_dict(name, **kw)
    job["spec"]["resources"]["nodes"] = nodes
    return job


class Gang:
    """A simulated namespace: decisions applied, pods as gang_objects renders them, phases set by hand."""

    def __init__(self, nodes: list[Any] | None = None, backoff_limit: int = 3, **kw: Any) -> None:
        self.job = _job(run_policy={"backoffLimit": backoff_limit}, **kw)
        self.nodes = nodes if nodes is not None else _nodes("n1", "n2", "n3")
        self.pods: dict[str, dict[str, Any]] = {}
        self.created: list[CreateAttempt] = []
        self.events: list[Event] = []
        self.companions: list[dict[str, Any]] = []
        self.devices: dict[str, tuple[str, ...]] = {}  # what each pod's DRA claim was allocated (the reconciler reads it)

    def step(self, t: float = 0.0, refuse: tuple[str, ...] = ()) -> Any:
        """One reconcile; the API server refuses to create the pods named in `refuse` (as a ResourceQuota would):
        the reconcile then stops there, recording the attempt as the reconciler does (gang.unfinished)."""
        d = decide(job_view(self.job), [pod_view(p, self.devices.get(n, ())) for n, p in self.pods.items()], at(t),
                   lambda spec: place(spec, self.nodes, {}), POLICY)
        for a in d.actions:
            if isinstance(a, CreateAttempt):
                self.created.append(a)
                self.companions, rendered = render.gang_objects(job_view(self.job), a.placed, a.plan, a.attempt)
                pods = [rendered[r] for r, _ in a.creates]
                for p in pods:
                    p.setdefault("status", {"phase": "Pending"})
                    if p["metadata"]["name"] not in refuse:
                        assert p["metadata"]["name"] not in self.pods, "created twice"
                        self.pods[p["metadata"]["name"]] = p
                if any(p["metadata"]["name"] in refuse for p in pods):
                    self.apply(gang.unfinished(job_view(self.job), at(t), a, QUOTA_ERROR))
                    return d
            elif isinstance(a, DeletePods):
                for n in a.names:
                    self.pods[n]["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
            else:
                self.apply(Decision((a,)))
        if "memstrata.dev/cleanup" not in self.job["metadata"].get("finalizers", []):
            self.job["metadata"].setdefault("finalizers", []).append("memstrata.dev/cleanup")
        return d

    def apply(self, d: Decision) -> Decision:
        for a in d.actions:
            if isinstance(a, PatchStatus):
                for k, v in a.patch.items():
                    self.status.pop(k, None) if v is None else self.status.__setitem__(k, v)
                FineTuneJobStatus.model_validate(self.status)  # every field the operator writes is declared, typed
            elif isinstance(a, Event):
                self.events.append(a)
        return d

    def attempt_pods(self, attempt: int) -> list[dict[str, Any]]:
        return sorted((p for p in self.pods.values() if p["metadata"]["labels"][names.LABEL_ATTEMPT] == str(attempt)),
                      key=lambda p: p["metadata"]["name"])

    def run(self, attempt: int, phase: str = "Running", exit_code: int | None = None) -> None:
        for p in self.attempt_pods(attempt):
            self.set(p, phase, exit_code)

    def set(self, pod: dict[str, Any], phase: str, exit_code: int | None = None, finished: str | None = None) -> None:
        pod["spec"]["nodeName"] = pod["metadata"]["annotations"]["memstrata.dev/planned-node"]
        pod["status"] = {"phase": phase}
        if exit_code is not None:
            pod["status"]["containerStatuses"] = [{"name": "runtime", "state": {"terminated": {
                "exitCode": exit_code, "reason": "Error" if exit_code else "Completed", "finishedAt": finished}}}]

    @property
    def status(self) -> dict[str, Any]:
        return self.job["status"]


def _env(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") or e["valueFrom"]["fieldRef"]["fieldPath"]
            for e in pod["spec"]["containers"][0]["env"]}


def test_two_nodes_get_two_pods_on_distinct_nodes_with_stable_dns_names_and_the_rendezvous_env():
    g = Gang()
    g.step()
    (create,) = g.created
    assert create.placed == ("n1", "n2") and create.node == "n1"
    pods = g.attempt_pods(0)
    assert [p["metadata"]["name"] for p in pods] == ["llama-0-0", "llama-0-1"]
    service = next(c for c in g.companions if c["kind"] == "Service")
    svc = service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["ports"][0]["port"] == RENDEZVOUS_PORT
    assert service["spec"]["selector"] == {names.LABEL_JOB_UID: "uid-1", names.LABEL_ATTEMPT: "0"}
    assert service["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert len([c for c in g.companions if c["kind"] == "ConfigMap"]) == 1  # one config serves both pods
    for rank, p in enumerate(pods):
        assert p["spec"]["hostname"] == f"llama-{rank}" and p["spec"]["subdomain"] == svc
        assert p["metadata"]["labels"][names.LABEL_NODE_RANK] == str(rank)
        terms = p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == [f"n{rank + 1}"]
        assert (_env(p)["MASTER_ADDR"], _env(p)["MASTER_PORT"], _env(p)["PET_NODE_RANK"], _env(p)["PET_NNODES"]) \
            == (f"llama-0.{svc}", str(RENDEZVOUS_PORT), str(rank), "2")
        # where the pod landed, for its own status.workers entry (the config names rank 0's node only)
        assert (_env(p)["POD_NAME"], _env(p)["MEMSTRATA_NODE_NAME"]) == ("metadata.name", "spec.nodeName")
    assert g.status["nodes"] == ["n1", "n2"] and g.status["node"] == "n1" and g.status["activePod"] == "llama-0-0"


def test_a_single_node_job_is_unchanged_one_pod_no_service_no_rendezvous_env():
    g = Gang()
    g.job["spec"]["resources"]["nodes"] = 1
    g.step()
    (pod,) = g.pods.values()
    assert pod["metadata"]["name"] == "llama-0" and "hostname" not in pod["spec"]
    assert names.LABEL_NODE_RANK not in pod["metadata"]["labels"]
    assert set(_env(pod)) == {"MEMSTRATA_RUNTIME_CONFIG"}
    assert not [c for c in g.companions if c["kind"] == "Service"] and "nodes" not in g.status


def test_running_only_when_every_pod_runs_and_succeeded_only_when_every_pod_succeeded():
    g = Gang()
    g.step()
    first, second = g.attempt_pods(0)
    g.set(first, "Running")
    g.step()
    assert g.status["phase"] == "Created" and "llama-0-1 waits for the scheduler" in g.status["message"]
    g.set(second, "Running")
    g.step()
    assert g.status["phase"] == "Running" and "llama-0-1 is running on n2" in g.status["message"]
    g.set(first, "Succeeded", 0)
    g.step()
    assert g.status["phase"] == "Running"  # rank 1 still trains
    g.set(second, "Succeeded", 0)
    g.step()
    assert g.status["phase"] == "Succeeded" and g.status["message"] == "pods llama-0-0, llama-0-1 completed"


def test_a_gangs_status_names_every_nodes_claimed_devices_by_node_rank():
    g = Gang()
    g.step()
    first, second = g.attempt_pods(0)
    g.devices = {first["metadata"]["name"]: ("n1/nvme0n1-aa",), second["metadata"]["name"]: ("n2/nvme0n1-bb",)}
    g.set(first, "Running")
    g.set(second, "Running")
    g.step()
    assert g.status["devices"] == ["n1/nvme0n1-aa", "n2/nvme0n1-bb"]


def test_a_lost_pod_fails_the_whole_attempt_once_and_the_next_attempt_is_a_new_pair():
    g = Gang()
    g.step()
    g.run(0)
    g.step()
    lost = g.pods.pop("llama-0-1")  # its node went away with it
    d = g.step()
    # The sibling is stopped; the failure names the lost pod, its node rank and node.
    assert d.of(DeletePods) and d.of(DeletePods)[0].names == ("llama-0-0",)
    assert g.status["failedPods"] == ["llama-0-1"]
    assert "llama-0-1 (node rank 1 on node n2) disappeared" in g.status["lastFailure"]["message"]
    assert g.status["phase"] == "Restarting"
    # The sibling ending under the deletion (exit 143), then going away, is no second failure.
    g.set(g.pods["llama-0-0"], "Failed", 143)
    g.step(1)
    g.pods.pop("llama-0-0")
    g.step(2)
    assert g.status["failedPods"] == ["llama-0-1"]
    g.step(11)  # past the 10s backoff
    assert [p["metadata"]["name"] for p in g.attempt_pods(1)] == ["llama-1-0", "llama-1-1"]
    assert g.status["restarts"] == 1 and g.status["activePod"] == "llama-1-0"
    assert lost["spec"]["hostname"] == g.pods["llama-1-1"]["spec"]["hostname"]  # the same DNS name again


def test_a_failed_pod_fails_the_job_over_the_backoff_limit_naming_the_pod_and_node():
    g = Gang(backoff_limit=0)
    g.step()
    g.run(0)
    g.step()
    g.set(g.pods["llama-0-1"], "Failed", 1)
    d = g.step()
    assert g.status["phase"] == "Failed"
    assert "pod llama-0-1 failed with exit code 1" in g.status["message"]
    assert "node rank 1 on node n2" in g.status["message"]
    assert d.of(DeletePods)[0].names == ("llama-0-0",)
    assert any(e.reason == "BackoffLimitExceeded" and "llama-0-1" in e.message for e in g.events)


def test_siblings_failing_together_count_one_failure():
    g = Gang(backoff_limit=1)
    g.step()
    g.run(0)
    g.step()
    g.run(0, "Failed", 1)  # the rendezvous broke: both ranks exit at once
    g.step()
    assert g.status["failedPods"] == ["llama-0-0"] and g.status["phase"] == "Restarting"


def test_the_pod_that_ended_first_is_blamed_and_the_message_says_its_sibling_failed_after_it():
    """With gloo rank 0's crash reaches rank 1 at once as a connection error: the operator may see both failed in
    one reconcile, and must not blame rank 0 just for its lower node rank."""
    g = Gang()
    g.step()
    g.run(0)
    g.step()
    g.set(g.pods["llama-0-0"], "Failed", 1, finished="2026-01-01T12:00:07Z")  # Connection reset by peer
    g.set(g.pods["llama-0-1"], "Failed", 1, finished="2026-01-01T12:00:05Z")  # the CUDA error: the cause
    g.step()
    assert g.status["failedPods"] == ["llama-0-1"] and g.status["lastFailure"]["pod"] == "llama-0-1"
    message = g.status["lastFailure"]["message"]
    assert message.startswith("pod llama-0-1 failed with exit code 1") and "node rank 1 on node n2" in message
    assert "pod llama-0-0 of the attempt failed after it" in message
    assert g.status["phase"] == "Restarting" and "llama-0-1 failed" in g.status["message"]


def test_a_new_attempt_drops_the_last_attempts_worker_reports():
    g = Gang()
    g.step()
    g.run(0)
    g.step()
    # What each pod's runtime reported for itself (status.workers, keyed by node rank).
    g.status["workers"] = {str(r): {"pod": f"llama-0-{r}", "node": f"n{r + 1}", "step": 40, "attempt": 0,
                                    "stage": "training"} for r in range(2)}
    g.set(g.pods["llama-0-1"], "Failed", 1)
    g.step()
    assert g.status["workers"]["0"]["step"] == 40  # still the attempt that just ended, until the next one starts
    g.step(11)  # past the backoff: attempt 2's pods are created
    assert [p["metadata"]["name"] for p in g.attempt_pods(1)] == ["llama-1-0", "llama-1-1"]
    assert "workers" not in g.status  # not step 40 of the pods that are gone, until the new pods report


def test_a_gang_created_in_part_is_completed_on_its_nodes_not_deleted_and_recreated():
    """A ResourceQuota allows one pod of the two: the attempt's second create is refused. Deleting the first pod
    and trying a new attempt would fail alike, for ever: pods created and deleted every second, the attempt
    counter climbing. The attempt is kept; its missing pod is created on the node chosen for it, and the status
    says why the job waits."""
    g = Gang()
    g.step(0, refuse=("llama-0-1",))
    assert list(g.pods) == ["llama-0-0"]
    assert "activePod" not in g.status  # not recorded as the current attempt: one of its pods does not exist
    assert g.status["nodes"] == ["n1", "n2"] and g.status["attempts"] == 1
    assert "exceeded quota" in g.status["message"] and "llama-0-1" in g.status["message"]
    created = next(c for c in g.status["conditions"] if c["type"] == "Created")
    assert created["status"] == "False" and created["reason"] == "PodCreateFailed"
    assert "exceeded quota" in created["message"]
    g.run(0)  # the pod that exists starts (and waits at the rendezvous)
    for t in range(1, 6):  # the quota still refuses: every reconcile asks for the same attempt's missing pod
        d = g.step(t, refuse=("llama-0-1",))
        assert not d.of(DeletePods), d
        (create,) = d.of(CreateAttempt)  # only the missing pod: the quota would charge a create of the other too
        assert (create.attempt, create.placed, create.creates) == (0, ("n1", "n2"), [(1, "n2")])
    assert list(g.pods) == ["llama-0-0"] and not g.pods["llama-0-0"]["metadata"].get("deletionTimestamp")
    assert g.status["attempts"] == 1 and "failedPods" not in g.status
    g.step(6)  # the quota was raised
    assert sorted(g.pods) == ["llama-0-0", "llama-0-1"]
    assert g.pods["llama-0-1"]["metadata"]["annotations"]["memstrata.dev/planned-node"] == "n2"
    assert g.status["activePod"] == "llama-0-0" and g.status["attempts"] == 1 and g.status["restarts"] == 0
    created = next(c for c in g.status["conditions"] if c["type"] == "Created")
    assert created["status"] == "True" and created["message"].startswith("created pod llama-0-1 for node n2: ")
    g.run(0)
    g.step(7)
    assert g.status["phase"] == "Running" and {c.attempt for c in g.created} == {0}


def test_a_gang_created_in_part_by_a_reconcile_that_recorded_nothing_is_deleted_and_made_whole():
    """An operator that stopped between the attempt's creates recorded nothing about it: its nodes are unknown,
    so its pods go and the next attempt is created whole (once: nothing repeats the stop)."""
    g = Gang()
    g.step()
    g.status.clear()
    g.pods.pop("llama-0-1")
    d = g.step(1)
    assert d.of(DeletePods)[0].names == ("llama-0-0",) and "not created whole" in d.of(DeletePods)[0].why
    g.step(2)  # (while it terminates)
    assert [p["metadata"]["name"] for p in g.attempt_pods(1)] == ["llama-1-0", "llama-1-1"]
    assert "failedPods" not in g.status and g.status["activePod"] == "llama-1-0"


def test_suspend_deletes_every_pod():
    g = Gang()
    g.step()
    assert len(g.pods) == 2
    g.job["spec"]["runPolicy"]["suspend"] = True
    d = g.step()
    assert set(d.of(DeletePods)[0].names) == {"llama-0-0", "llama-0-1"} and g.status["phase"] == "Suspended"
    assert "failedPods" not in g.status


def test_gang_placement_all_or_nothing():
    job = job_view(_job(3))
    assert job.spec is not None
    # Three nodes, one full: no room for the gang; none is created.
    busy = usage_by_node([PodUse("x/y", "n2", {"nvidia.com/gpu": 1}, False)])
    waiting = place(job.spec, _nodes("n1", "n2", "n3"), busy)
    assert waiting.outcome == "no-room" and "only 2 alike have room now" in waiting.message
    chosen = place(job.spec, _nodes("n1", "n2", "n3", "n4"), busy)
    assert chosen.outcome == "chosen" and chosen.nodes == ("n1", "n3", "n4")
    # Fewer nodes than needed can ever hold it: impossible, saying how many fit and how many are needed.
    short = place(job.spec, _nodes("n1", "n2"), {})
    assert short.outcome == "impossible" and short.reason == "InsufficientNodes"
    assert "only 2 node(s) can ever hold this job" in short.message and "3 needed" in short.message


def test_gang_placement_only_chooses_nodes_that_run_the_same_plan():
    job = job_view(_job(2))
    assert job.spec is not None
    # Nodes of one type reporting a little more or less DRAM run the same plan: one runtime config serves both.
    alike = place(job.spec, [*_nodes("a", dram_gib=1024), *_nodes("b", dram_gib=1023)], {})
    assert alike.outcome == "chosen" and alike.nodes == ("a", "b")
    # A small node would spill to NVMe where the big one keeps all in DRAM: never in one gang.
    unlike = place(job.spec, [*_nodes("a", dram_gib=1024), *_nodes("c", dram_gib=64)], {})
    assert unlike.outcome == "impossible" and "(1 of them alike" in unlike.message


def test_dns_names_stay_within_label_limits_for_long_job_names():
    long = "a" * 60 + ".b" * 90
    svc = names.service_name(long, "0123456789abcdef")
    host = names.pod_hostname(long, 63)
    assert len(svc) <= 63 and svc[0].isalpha() and "." not in svc and svc.endswith("-01234567")
    assert len(host) <= 63 and host.endswith("-63") and "." not in host
    assert names.service_name("9lives", "u")[0].isalpha()
    assert names.attempt_of(long, names.pod_name(long, 12, 1, 2)) == 12
    assert names.attempt_of("llama", "llama-3") == 3 and names.attempt_of("llama", "other-3") is None


def test_cpu_ranks_per_node_count_in_the_memory_request():
    body = job_dict("tiny", spec_file="examples/finetune-tiny.yaml")
    one = job_view(copy.deepcopy(body))
    body["spec"]["resources"]["ranksPerNode"] = 2
    two = job_view(body)
    assert one.spec is not None and two.spec is not None
    plan = place(one.spec, _nodes("n1"), {}).plan
    assert plan is not None
    assert render.container_requests(two.spec, plan)["memory"] - render.container_requests(one.spec, plan)["memory"] \
        == render.RUNTIME_PROCESS_BYTES


def test_a_claimed_pod_that_is_gone_stops_holding_its_node():
    """The reconciler counts the pods it just created against their nodes until its watch reports them. A pod
    of the gang lost before the next placement (deleted, gone with its node) must not keep its node looking
    full: the next attempt would wait for the claim to expire instead of starting."""
    pytest.importorskip("aiohttp", reason="the operator's dependencies are not installed; run `make install`")
    from memstrata.operator.kube import Kube
    from memstrata.operator.reconciler import Reconciler

    class Listing(Kube):
        def __init__(self) -> None:
            super().__init__("http://127.0.0.1:9", False)
            self.pods: list[dict[str, Any]] = []

        async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
            return self.pods

    class Offline(Reconciler):
        async def apply(self, job: Any, decision: Any) -> None:  # what is created is what the test lists
            self.applied = decision

    body = _job(2)
    key = ("team-a", "llama")

    async def go() -> tuple[Any, Any, Any]:
        kube = Listing()
        r = Offline(kube)
        r.nodes = lambda: _nodes("n1", "n2")
        r._bodies[key] = body
        await r.reconcile(key)
        (create,) = r.applied.of(CreateAttempt)
        spec = job_view(body).spec
        full = r._place(spec)  # both nodes claimed by the pods just created
        _, pods = render.gang_objects(job_view(body), create.placed, create.plan, create.attempt)
        kube.pods = pods
        await r._decide(key, body)  # the pods are listed: still claimed
        still = r._place(spec)
        kube.pods = []  # both gone before the watch ever reported them
        _, again = await r._decide(key, body)
        return full, still, again

    full, still, again = asyncio.run(go())
    assert full.outcome == "no-room" and still.outcome == "no-room"
    assert [c.placed for c in again.of(CreateAttempt)] == [("n1", "n2")]  # placed at once, not after the claim expires
