"""The fine-tuned model's directory and files get the modes a plain mkdir and open would under the run's umask
(group-readable under 022, group-writable under 002), not the 0700 of a temporary directory and the 0600 that
safetensors writes shards with: on a shared volume the team can read the model."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")

from memstrata.runtime.train.model.export import (OutputPathError, atomic_output, check_output_path,  # noqa: E402
                                                   process_umask)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_the_output_has_the_modes_of_the_runs_umask(tmp_path: Path, umask: int) -> None:
    from safetensors.torch import save_file

    old = os.umask(umask)
    try:
        assert process_umask() == umask
        out = tmp_path / "model"
        with atomic_output(out) as into:
            save_file({"w": torch.zeros(4)}, str(into / "model.safetensors"))
            (into / "merged").mkdir()
            save_file({"w": torch.zeros(4)}, str(into / "merged" / "model.safetensors"))
            (into / "config.json").write_text("{}")
    finally:
        os.umask(old)

    def mode(p: Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    assert mode(out) == mode(out / "merged") == 0o777 & ~umask
    assert {mode(f) for f in (out / "model.safetensors", out / "merged" / "model.safetensors",
                              out / "config.json")} == {0o666 & ~umask}


def test_a_missing_parent_is_explained_for_a_local_run_too(tmp_path: Path) -> None:
    with pytest.raises(OutputPathError, match=r"spec.output.path: .*/nowhere: no such directory \(create it; in a "
                                              r"pod, mount a volume there\)"):
        check_output_path(tmp_path / "nowhere" / "model")
