"""The learning-rate schedule: Hugging Face's warmup and decay, with a floor, at the steps where it turns."""
from __future__ import annotations

import math

import pytest

from memstrata.api.finetunejob import LearningRateSchedule, Training
from memstrata.runtime.train.schedule import build_scheduler, describe, lr_multiplier


def _s(type_: str = "constant", warmup: int = 0, floor: float = 0.0) -> LearningRateSchedule:
    return LearningRateSchedule.model_validate({"type": type_, "warmupSteps": warmup, "minLearningRateRatio": floor})


def test_warmup_rises_linearly_from_zero_to_the_peak() -> None:
    # `step` optimizer steps already taken: the first update runs at 0, as transformers' schedules do.
    s = _s("constant", warmup=4)
    assert [lr_multiplier(k, s, 10) for k in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


def test_constant_stays_at_the_peak_to_the_end() -> None:
    assert [lr_multiplier(k, _s(), 5) for k in (0, 4, 5)] == [1.0, 1.0, 1.0]


def test_linear_decays_from_the_peak_to_the_floor_at_the_last_step() -> None:
    s = _s("linear", warmup=2, floor=0.1)
    assert lr_multiplier(2, s, 12) == 1.0  # warmup done: the peak
    assert lr_multiplier(7, s, 12) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert lr_multiplier(12, s, 12) == pytest.approx(0.1)
    assert lr_multiplier(20, s, 12) == pytest.approx(0.1)  # past the end: the floor, never below


def test_cosine_follows_half_a_cosine_down_to_the_floor() -> None:
    s = _s("cosine", warmup=2, floor=0.2)
    assert lr_multiplier(2, s, 10) == 1.0
    assert lr_multiplier(6, s, 10) == pytest.approx(0.2 + 0.8 * 0.5)  # the middle of the decay
    assert lr_multiplier(4, s, 10) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_multiplier(10, s, 10) == pytest.approx(0.2)


def test_without_a_floor_decay_reaches_zero_as_transformers_does() -> None:
    assert lr_multiplier(10, _s("cosine"), 10) == pytest.approx(0.0)
    assert lr_multiplier(10, _s("linear"), 10) == pytest.approx(0.0)


def test_a_schedule_that_is_all_warmup_warms_up_to_its_last_update() -> None:
    s = _s("linear", warmup=5, floor=0.3)
    assert [lr_multiplier(k, s, 5) for k in range(5)] == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8])
    assert lr_multiplier(5, s, 5) == 1.0  # after the last update, as transformers computes it (no division by 0)


def test_a_negative_step_is_refused() -> None:
    with pytest.raises(ValueError, match="step"):
        lr_multiplier(-1, _s(), 5)


def test_the_torch_scheduler_sets_each_steps_rate() -> None:
    import torch

    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=0.5)
    training = Training(steps=6, learning_rate=0.5, schedule=_s("cosine", warmup=2, floor=0.1))
    scheduler = build_scheduler(optimizer, training)
    seen = []
    for _ in range(training.steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.5 * lr_multiplier(k, training.schedule, 6) for k in range(6)])
    # Its state is a step count and base rates: what a checkpoint stores and a resume restores.
    restored = build_scheduler(torch.optim.SGD([param], lr=0.5), training)
    restored.load_state_dict(scheduler.state_dict())
    assert restored.get_last_lr() == pytest.approx([0.5 * 0.1])


def test_the_report_names_the_schedule_briefly() -> None:
    assert describe(_s(), 100) == "constant"
    assert describe(_s("cosine", warmup=10, floor=0.1), 100) == "cosine to 0.1x, 10 warmup steps"
    assert describe(_s("linear", warmup=1), 100) == "linear to 0x, 1 warmup step"
    assert describe(LearningRateSchedule(type="linear", warmup_ratio=0.1), 25) == \
        "linear to 0x, 3 warmup steps (0.1 of 25)"


def test_a_warmup_ratio_is_that_fraction_of_the_steps_rounded_up_as_transformers_does() -> None:
    from transformers import get_linear_schedule_with_warmup  # the reference a TRL user's run follows
    import torch

    schedule = LearningRateSchedule(type="linear", warmup_ratio=0.1)
    assert schedule.warmup(25) == 3 and schedule.warmup(30) == 3 and schedule.warmup(31) == 4
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=3, num_training_steps=25)
    assert [lr_multiplier(k, schedule, 25) for k in range(25)] == pytest.approx(
        [reference.lr_lambdas[0](k) for k in range(25)])
