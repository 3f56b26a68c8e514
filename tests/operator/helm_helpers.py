"""helm, as the chart tests run it: the binary built with the control plane, in a throwaway HOME."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from e2e.cluster.controlplane import bin_dir_from_env

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "memstrata"
KUBE = ("--kube-version", "v1.36.4")  # without a cluster helm assumes 1.20; the chart needs >= 1.30


def helm_binary() -> Path:
    if os.environ.get("MEMSTRATA_HELM"):  # a helm built elsewhere (development)
        return Path(os.environ["MEMSTRATA_HELM"])
    bin_dir, reason = bin_dir_from_env()
    if bin_dir is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but helm is not built: {reason}")
        pytest.skip(f"helm not built: {reason}")
    return bin_dir / "helm"


def run_helm(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {"HOME": str(tmp), "HELM_CACHE_HOME": str(tmp), "HELM_CONFIG_HOME": str(tmp), "HELM_DATA_HOME": str(tmp),
           "PATH": "/usr/bin:/bin"}
    return subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, timeout=120, env=env)
