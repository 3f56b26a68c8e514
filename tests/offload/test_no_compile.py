"""The recipe's engine is built without torch.compile's inductor, which DeepSpeed's Muon module loads at import
(memstrata.runtime.train.building.no_compile around `initialize`); a user's setting, what runs after, and the library
drop-in are left alone."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# What DeepSpeed's ZeRO sanity check imports at every engine's construction (is_zero_supported_optimizer).
PROBE = """
import os, sys
{first}
print(os.environ.get("TORCHDYNAMO_DISABLE"), "torch._inductor.compile_fx" in sys.modules,
      os.environ.get("TORCHDYNAMO_DISABLE"))
"""
MUON = "import deepspeed.runtime.zero.muon.original_muon"
INSIDE = ("from memstrata.runtime.train.building import no_compile\n"
          "with no_compile():\n    " + MUON + "\n    inside = os.environ.get('TORCHDYNAMO_DISABLE')\n"
          "print(inside, end=' ')")


def _probe(first: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], env={**clean, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()[-1].split()  # DeepSpeed logs its accelerator to stdout first


pytestmark = pytest.mark.usefixtures("deepspeed_ready")


def test_building_the_engine_never_loads_the_inductor_and_leaves_the_environment_as_it_was() -> None:
    # Inside: set, and the inductor not loaded; after: the variable gone again.
    assert _probe(INSIDE) == ["1", "None", "False", "None"]


def test_a_users_setting_is_kept() -> None:
    assert _probe(INSIDE, TORCHDYNAMO_DISABLE="0") == ["0", "0", "True", "0"]


def test_the_drop_in_initialize_leaves_torch_compile_on() -> None:
    assert _probe(f"from memstrata.runtime import initialize; initialize.__name__\n{MUON}") == ["None", "True", "None"]
