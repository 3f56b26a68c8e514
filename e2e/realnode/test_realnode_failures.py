"""A run that fails inside its container on the real node says why where the user looks: the job's
`Failed` condition message and a Warning event on the job — not only the pod's termination message.

- a bad dataset (a line that is not JSON): the runtime's own error, naming the file and line;
- an OOM kill (the container outgrows the memory limit the plan set): the kernel's verdict, OOMKilled.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from e2e.realnode.conftest import RealCluster
from e2e.realnode.jobs import JobStorage, events_of, smollm2_job, wait_phase
from e2e.realnode.test_realnode_job import REPO, explain

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]


def failed_condition(body: dict) -> dict:
    conds = {c["type"]: c for c in body["status"].get("conditions") or []}
    assert conds.get("Failed", {}).get("status") == "True", body["status"]
    return conds["Failed"]


def warning_messages(rc: RealCluster, ns: str, name: str) -> list[str]:
    return [e["message"] for e in events_of(rc.cp, ns, name) if e.get("type") == "Warning"]


def test_a_bad_dataset_fails_the_job_with_the_runtimes_reason(
        real_cluster: RealCluster, job_ns: str, tmp_path: Path, smollm2_dir: Path) -> None:
    rc, ns = real_cluster, job_ns
    store = JobStorage(rc.cp, ns, tmp_path / "volumes")
    good = (REPO / "examples" / "chat-skill.jsonl").read_text().splitlines()
    # What a user produces by hand-editing a JSONL file: a trailing comma on line 3.
    broken = "\n".join([*good[:2], good[2] + ",", *good[3:]]) + "\n"
    store.create(smollm2_dir, broken)
    try:
        rc.cp.apply(smollm2_job("bad-data", rc.images.runtime), namespace=ns)
        body = wait_phase(rc.cp, ns, "bad-data", {"Succeeded", "Failed"}, timeout=600)
        message = failed_condition(body)["message"]
        assert "/data/chat.jsonl:3" in message, f"{message}\n{explain(rc, ns, 'bad-data')}"
        assert any("/data/chat.jsonl:3" in m for m in warning_messages(rc, ns, "bad-data")), \
            warning_messages(rc, ns, "bad-data")
    finally:
        store.delete()


def test_an_oom_killed_container_fails_the_job_with_oomkilled(
        real_cluster: RealCluster, job_ns: str, tmp_path: Path, smollm2_dir: Path) -> None:
    rc, ns = real_cluster, job_ns
    store = JobStorage(rc.cp, ns, tmp_path / "volumes")
    store.create(smollm2_dir, (REPO / "examples" / "chat-skill.jsonl").read_text())
    try:
        # The pod's limit is the plan's DRAM plus the runtime's own; this command takes far more, as a
        # leaking data loader would. (The memory limit, not the test, is what stops it.)
        grow = "b = []\nwhile True: b.append(bytearray(64 << 20))"
        job = smollm2_job("oom", rc.images.runtime, extra_spec={"command": ["python", "-c", grow]})
        rc.cp.apply(job, namespace=ns)
        body = wait_phase(rc.cp, ns, "oom", {"Succeeded", "Failed"}, timeout=600)
        message = failed_condition(body)["message"]
        assert "OOMKilled" in message, f"{message}\n{explain(rc, ns, 'oom')}"
        assert any("OOMKilled" in m for m in warning_messages(rc, ns, "oom")), warning_messages(rc, ns, "oom")
    finally:
        store.delete()
