"""Where the memstrata engine's NVMe stratum and CXL nodes come from: the device plugin's env, else the plan."""
from __future__ import annotations

from pathlib import Path

import pytest

from memstrata.api.strataplan import Plan
from memstrata.runtime.swap.stratamap import create_file_namespaces, namespace_bytes, swap_settings


def _plan(namespaces: list[str], cxl: list[int] | None = None) -> Plan:
    return Plan(parameters=10_000_000, engine="memstrata", feasible=True, categories=[], strata=[],
                nvme_namespaces=namespaces, cxl_nodes=cxl or [])


def test_local_run_gets_one_sparse_file_namespace_per_plan_namespace(tmp_path: Path) -> None:
    strata = swap_settings(_plan(["/scratch"], cxl=[2]), job="j", run_dir=tmp_path, env={})
    assert strata.source == "plan"
    assert strata.settings.nvme == [str(tmp_path / "nvme0.img")] == strata.file_namespaces
    assert strata.settings.cxl_nodes == [2] and strata.settings.job == "j"
    assert strata.file_bytes == namespace_bytes(10_000_000, 1) >= 10_000_000 * 18
    create_file_namespaces(strata)
    st = (tmp_path / "nvme0.img").stat()
    assert st.st_size == strata.file_bytes and st.st_blocks * 512 < 1 << 20, "sparse: no DRAM or disk spent up front"
    with pytest.raises(FileExistsError):
        create_file_namespaces(strata)  # never reuses (or truncates) a file it did not just create


def test_device_plugin_env_wins_over_the_plan(tmp_path: Path) -> None:
    env = {"MEMSTRATA_NVME_DEVICES": "/dev/nvme1n1,/dev/nvme2n1", "MEMSTRATA_CXL_NODES": "3,4"}
    strata = swap_settings(_plan(["/scratch"], cxl=[2]), job="j", run_dir=tmp_path, env=env)
    assert strata.source == "device-plugin" and strata.file_namespaces == []
    assert strata.settings.nvme == ["/dev/nvme1n1", "/dev/nvme2n1"] and strata.settings.cxl_nodes == [3, 4]


def test_bad_cxl_env_and_missing_stratum_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="MEMSTRATA_CXL_NODES='a,b'"):
        swap_settings(_plan(["/s"]), job="j", run_dir=tmp_path, env={"MEMSTRATA_CXL_NODES": "a,b"})
    with pytest.raises(ValueError, match="plan.nvme_namespaces is empty"):
        swap_settings(_plan([]), job="j", run_dir=tmp_path, env={})
