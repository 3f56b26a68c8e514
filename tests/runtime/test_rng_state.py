"""A checkpoint's RNG state resumes wherever the job is resumed: a rank saves and restores its own GPU's generator,
not one per visible GPU (a pod resumed on a node that shows it fewer GPUs could not load those). torch.cuda is
stood in for by visible devices with a generator each, which refuse an ordinal they do not have, as CUDA does."""
from __future__ import annotations

import base64

import pytest
import torch

from memstrata.runtime.train.checkpoints.engine_state import capture_rng, restore_rng


class _VisibleGpus:
    def __init__(self, count: int, current: int) -> None:
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(count)}
        self.current = current

    def _index(self, device: object) -> int:
        index = self.current if device in ("cuda", None) else int(str(device).split(":")[-1])
        if index not in self.states:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        return index

    def get_rng_state(self, device: object = "cuda") -> torch.Tensor:
        return self.states[self._index(device)].clone()

    def set_rng_state(self, state: torch.Tensor, device: object = "cuda") -> None:
        self.states[self._index(device)] = state.clone()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.states[i].clone() for i in sorted(self.states)]

    def set_rng_state_all(self, states: list[torch.Tensor]) -> None:
        for i, state in enumerate(states):
            self.set_rng_state(state, f"cuda:{i}")

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(self.states))


def test_a_rank_on_one_of_eight_gpus_resumes_where_one_gpu_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    first = _VisibleGpus(8, current=3)  # rank 3 of a pod that saw eight GPUs
    first.states[3] = torch.arange(16, dtype=torch.uint8)
    first.install(monkeypatch)
    state = capture_rng()
    second = _VisibleGpus(1, current=0)  # resumed in a pod that is shown its one GPU
    second.install(monkeypatch)
    restore_rng(state)
    assert torch.equal(second.states[0], torch.arange(16, dtype=torch.uint8))


def test_a_checkpoint_with_a_state_per_visible_gpu_still_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Written by an earlier memstrata: one state per GPU the rank saw; the rank's own is taken."""
    old = _VisibleGpus(2, current=1)
    old.install(monkeypatch)
    state = capture_rng()
    state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in old.get_rng_state_all()]
    again = _VisibleGpus(2, current=1)
    again.states[1] = torch.zeros(16, dtype=torch.uint8)
    again.install(monkeypatch)
    restore_rng(state)
    assert torch.equal(again.states[1], torch.full((16,), 1, dtype=torch.uint8))
