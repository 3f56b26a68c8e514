"""memstrata's own training processes skip torch.compile's inductor, which DeepSpeed's Muon module loads at import
(memstrata.runtime.train sets TORCHDYNAMO_DISABLE); a user's setting and the library drop-in are left alone."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# What DeepSpeed's ZeRO sanity check imports at every engine's construction (is_zero_supported_optimizer).
PROBE = """
import os, sys
{first}
import deepspeed.runtime.zero.muon.original_muon
print(os.environ.get("TORCHDYNAMO_DISABLE"), "torch._inductor.compile_fx" in sys.modules)
"""


def _probe(first: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], env={**clean, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()[-1].split()  # DeepSpeed logs its accelerator to stdout first


pytestmark = pytest.mark.usefixtures("deepspeed_ready")


def test_a_training_process_never_loads_the_inductor() -> None:
    assert _probe("import memstrata.runtime.train.local") == ["1", "False"]


def test_a_users_setting_is_kept() -> None:
    assert _probe("import memstrata.runtime.train.local", TORCHDYNAMO_DISABLE="0") == ["0", "True"]


def test_the_drop_in_initialize_leaves_torch_compile_on() -> None:
    assert _probe("from memstrata.runtime import initialize; initialize.__name__") == ["None", "True"]
