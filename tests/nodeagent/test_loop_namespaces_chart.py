"""The chart's `nodeAgent.loopNamespaces`: off by default, passed to the agent only when set, and only loop names."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))  # helm, as the chart tests run it
from helm_helpers import CHART, KUBE, run_helm  # noqa: E402


def agent_args(tmp_path: Path, *sets: str) -> list[str]:
    flags = [a for s in sets for a in ("--set", s)]
    proc = run_helm("template", "x", str(CHART), *KUBE, "--namespace", "memstrata-system", *flags, tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ds = next(d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "DaemonSet")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return list(c["args"])


def test_loop_namespaces_reach_the_agent_only_when_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memstrata.nodeagent.main import parse_args

    monkeypatch.setenv("NODE_NAME", "n1")  # the DaemonSet's downward API (its DRA slice is named after it)

    default = agent_args(tmp_path)
    assert not any(a.startswith("--loop-namespaces") for a in default)
    assert parse_args(default[1:]).loop_namespaces == ()
    assert agent_args(tmp_path, "nodeAgent.loopNamespaces=null") == default
    args = agent_args(tmp_path, "nodeAgent.loopNamespaces={loop3,loop4}")
    assert "--loop-namespaces=loop3,loop4" in args
    assert parse_args(args[1:]).loop_namespaces == ("loop3", "loop4")  # what the agent's own parser takes


@pytest.mark.parametrize("value", ["nvme0n1", "/dev/loop3", "loop"])
def test_values_schema_takes_only_loop_device_names(tmp_path: Path, value: str) -> None:
    proc = run_helm("template", "x", str(CHART), *KUBE, "--set", f"nodeAgent.loopNamespaces={{{value}}}",
                    tmp=tmp_path)
    assert proc.returncode != 0
    assert f"/nodeAgent/loopNamespaces/0': '{value}' does not match pattern '^loop[0-9]+$'" in proc.stderr
