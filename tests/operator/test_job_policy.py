"""The operator never gives a job more than its submitter could have had (issue 29): volumes, image and command
held to the chart's jobPolicy, the disk group only on pods handed NVMe namespaces, and what a container wrote
reaching the job's status only bounded and sanitised. Pure logic; e2e/operator/test_job_policy.py runs the
same paths against the real API server as a user who may create FineTuneJobs and nothing else."""
from __future__ import annotations

from typing import Any, Sequence

import pytest
from ftj_factories import inventory, job_dict, node_dict, pod_dict

from memstrata.operator.actions import CreateAttempt, CreateInspection, PatchStatus
from memstrata.operator.jobpolicy import JobPolicy
from memstrata.operator.lifecycle import LifecyclePolicy, decide
from memstrata.operator.main import build_parser, config_from_args
from memstrata.operator.nodes import node_view
from memstrata.operator.observe import MESSAGE_CHARS, container_text, job_view, pod_view
from memstrata.api.podidentity import DISK_GID
from memstrata.operator.render import gang_objects
from memstrata.operator.scheduling import place

NODES = [node_view(node_dict("gpu-1", inventory("gpu-1", dram_gib=1024)))]
TOKEN = "eyJhbGciOiJSUzI1NiIsImtpZCI6Ik1ZIn0.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQifQ.c2lnbmF0dXJlLWJ5dGVz"


def _job(**spec: Any) -> dict[str, Any]:
    """examples/finetune.yaml (three claims) with `spec`'s volumes added to its own and its other fields set."""
    job = job_dict("llama")
    job["spec"]["volumes"] += spec.pop("volumes", [])
    job["spec"].update(spec)
    return job


def _decide(job: dict[str, Any], policy: JobPolicy = JobPolicy(), pods: Sequence[dict[str, Any]] = ()) -> Any:
    return decide(job_view(job), [pod_view(p) for p in pods], job_view(job).created,  # type: ignore[arg-type]
                  lambda s: place(s, NODES, {}), LifecyclePolicy(jobs=policy))


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"volumes": [{"name": "root", "hostPath": {"path": "/"}}]},
     "spec.volumes[3].hostPath: volume type hostPath is not allowed"),
    ({"volumes": [{"name": "token", "secret": {"secretName": "db-password"}}]},
     "spec.volumes[3].secret: volume type secret is not allowed"),
    ({"volumes": [{"name": "p", "projected": {"sources": [{"secret": {"name": "s"}}]}}]},
     "spec.volumes[3].projected: volume type projected is not allowed"),
    ({"image": "docker.io/library/busybox:1.36"}, "spec.image: docker.io/library/busybox:1.36 is not allowed"),
    ({"image": "ghcr.io/memstrata/runtime-evil:1"}, "spec.image: ghcr.io/memstrata/runtime-evil:1 is not allowed"),
    ({"command": ["sh", "-c", "cat /secret/* > /dev/termination-log"]},
     "spec.command: a custom command is not allowed"),
]


@pytest.mark.parametrize("spec,message", REFUSED, ids=[m.split(":")[0] for _, m in REFUSED])
def test_a_job_asking_for_more_than_the_policy_fails_naming_the_field_and_gets_no_pod(spec: dict[str, Any],
                                                                                      message: str) -> None:
    decision = _decide(_job(**spec))
    assert not decision.of(CreateAttempt) and not decision.of(CreateInspection)
    (patch,) = decision.of(PatchStatus)
    failed = next(c for c in patch.patch["conditions"] if c["type"] == "Failed")
    assert patch.patch["phase"] == "Failed" and failed["reason"] == "NotAllowed", patch.patch
    assert message in failed["message"] and "the chart's jobPolicy" in failed["message"], failed


def test_what_the_admin_opens_and_the_runtimes_own_command_run() -> None:
    opened = JobPolicy(volume_types=("hostPath", "secret", "projected"), images=("*",), custom_commands=True)
    for spec, _ in REFUSED:
        assert opened.refusal(job_view(_job(**spec)).spec) is None  # type: ignore[arg-type]
        assert _decide(_job(**spec), opened).of(CreateAttempt)
    safe = _job(volumes=[{"name": "b", "emptyDir": {}},
                         {"name": "c", "configMap": {"name": "cm"}}], command=["memstrata", "pod"],
                image="ghcr.io/memstrata/runtime@sha256:" + "0" * 64)
    assert _decide(safe).of(CreateAttempt)


def test_the_operators_flags_set_the_policy_and_a_bad_pattern_is_named() -> None:
    args = build_parser().parse_args(["--allowed-volume-type", "nfs", "--allowed-image", "registry.corp/ml/*",
                                      "--allow-custom-commands"])
    assert config_from_args(args).policy.jobs == JobPolicy(("nfs",), ("registry.corp/ml/*",), True)
    assert config_from_args(build_parser().parse_args([])).policy.jobs == JobPolicy()
    with pytest.raises(SystemExit, match=r"image pattern 'a\*b': expected an image reference, or a prefix"):
        config_from_args(build_parser().parse_args(["--allowed-image", "a*b"]))


def test_the_disk_group_only_on_a_pod_handed_nvme_namespaces() -> None:
    """The group opens every disk the container can see: a pod without namespaces has no use for it."""
    job = job_view(_job())
    groups = {}
    for dram in (64, 1024):  # the job's state spills to NVMe on the small node, fits in DRAM on the big one
        nodes = [node_view(node_dict("gpu-1", inventory("gpu-1", dram_gib=dram)))]
        plan = place(job.spec, nodes, {}).plan  # type: ignore[arg-type]
        assert plan is not None
        sc = gang_objects(job, ("gpu-1",), plan, 0)[1][0]["spec"]["securityContext"]
        groups[bool(plan.requests.get("memstrata.dev/nvme-ns"))] = sc.get("supplementalGroups")
    assert groups == {True: [DISK_GID], False: None}


def test_what_a_container_wrote_reaches_the_status_bounded_and_without_credentials() -> None:
    pod = pod_dict("llama-0", 0, "Failed", node="gpu-1", exit_code=1)
    pem = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----"
    term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    term["message"] = f"token {TOKEN}\n{pem}\nkey {'A1b2' * 12}\x1b[2J\n" + "x " * 4000
    job = _job()
    job["status"] = {"phase": "Running", "activePod": "llama-0", "attempts": 1}
    (patch,) = _decide(job, pods=[pod]).of(PatchStatus)
    last = patch.patch["lastFailure"]
    assert last["reason"] == "Error" and last["pod"] == "llama-0"
    for secret in (TOKEN, "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC", "A1b2A1b2A1b2", "\x1b", "\n"):
        assert secret not in last["message"] and secret not in patch.patch["message"]
    assert "token [redacted] [redacted] key [redacted]" in last["message"]
    assert len(last["message"]) < MESSAGE_CHARS + 100
    # What the runtime itself writes on a failure still reads as it was written.
    why = "error: spec.dataset.path /data/chat/train.jsonl: no such file"
    assert container_text(why) == why


def test_a_failure_reason_is_from_the_fixed_vocabulary() -> None:
    pod = pod_dict("llama-0", 0, "Failed", node="gpu-1", exit_code=137)
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] = "OOMKilled"
    assert pod_view(pod).failure_reason == "OOMKilled"
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] = "hunter2"
    assert pod_view(pod).failure_reason == "Failed"
