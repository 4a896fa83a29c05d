"""warmup_schedule and linear_scaled_lr: warm-up, cosine and step decay per optimizer step."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from ddpkit.training.schedules import WarmupSchedule, linear_scaled_lr, warmup_schedule


def _optimizer(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=lr, momentum=0.9)


def _rates(optimizer: torch.optim.Optimizer, scheduler: object, steps: int) -> list[float]:
    rates = [optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        optimizer.step()
        scheduler.step()  # type: ignore[attr-defined]
        rates.append(optimizer.param_groups[0]["lr"])
    return rates


def test_linear_warm_up_then_cosine_to_min_lr() -> None:
    opt = _optimizer(0.4)
    sched = warmup_schedule(opt, epochs=5, steps_per_epoch=4, warmup_epochs=1, min_lr=0.01,
                            warmup_start=0.1)  # fmt: skip
    assert isinstance(sched, WarmupSchedule)
    assert sched.per_step
    rates = _rates(opt, sched, 20)
    # Warm-up: 4 steps from 0.04 to 0.4 along a line.
    for step in range(5):
        assert rates[step] == pytest.approx(0.4 * (0.1 + 0.9 * step / 4))
    # Cosine over the other 16 steps, from the peak to min_lr.
    for step in range(4, 21):
        t = (step - 4) / 16
        assert rates[step] == pytest.approx(0.01 + (0.4 - 0.01) * (1 + math.cos(math.pi * t)) / 2)
    assert rates[-1] == pytest.approx(0.01)


def test_step_decay_drops_at_the_first_step_of_each_milestone_epoch() -> None:
    opt = _optimizer(1.0)
    sched = warmup_schedule(opt, epochs=6, steps_per_epoch=3, warmup_epochs=1, decay="step",
                            milestones=[3, 5], gamma=0.1)  # fmt: skip
    rates = _rates(opt, sched, 18)
    # rates[s] is the rate of step s (0-based); epoch e starts at step 3 * e.
    assert rates[3:9] == pytest.approx([1.0] * 6)
    assert rates[9:15] == pytest.approx([0.1] * 6)
    assert rates[15:18] == pytest.approx([0.01] * 3)


def test_without_warm_up_the_first_step_has_the_peak_rate() -> None:
    opt = _optimizer(0.2)
    rates = _rates(opt, warmup_schedule(opt, epochs=2, steps_per_epoch=5), 10)
    assert rates[0] == pytest.approx(0.2)
    assert rates[10] == pytest.approx(0.0)
    assert all(a >= b for a, b in itertools.pairwise(rates))


def test_fractional_warm_up_epochs_round_to_steps() -> None:
    opt = _optimizer(1.0)
    rates = _rates(opt, warmup_schedule(opt, epochs=4, steps_per_epoch=10, warmup_epochs=0.5,
                                        warmup_start=0.5), 6)  # fmt: skip
    assert rates[:6] == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.9, 1.0])


def test_a_restored_schedule_continues_exactly_mid_warm_up() -> None:
    def make() -> tuple[torch.optim.Optimizer, WarmupSchedule]:
        opt = _optimizer(0.3)
        return opt, warmup_schedule(opt, epochs=3, steps_per_epoch=5, warmup_epochs=1.2)

    opt, sched = make()
    whole = _rates(opt, sched, 15)
    opt, sched = make()
    _rates(opt, sched, 4)  # stopped inside the warm-up
    state = sched.state_dict()
    opt2, sched2 = make()
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(state)
    assert _rates(opt2, sched2, 11) == whole[4:]  # exactly, not approximately


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epochs": 0}, "epochs"),
        ({"steps_per_epoch": 0}, "steps_per_epoch"),
        ({"warmup_epochs": 5}, "warmup_epochs"),
        ({"warmup_epochs": -1}, "warmup_epochs"),
        ({"decay": "linear"}, "decay"),
        ({"milestones": [2]}, "milestones apply"),
        ({"decay": "step", "milestones": [0]}, "milestones must be"),
        ({"decay": "step", "milestones": [2.5]}, "milestones must be"),
        ({"decay": "step", "milestones": [1], "warmup_epochs": 1}, "inside the warm-up"),
        ({"warmup_start": 0}, "warmup_start"),
        ({"min_lr": -1}, "min_lr"),
        ({"decay": "step", "gamma": 0}, "gamma"),
    ],
)
def test_bad_values_are_named(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"epochs": 5, "steps_per_epoch": 10, **kwargs}
    with pytest.raises(ValueError, match=message):
        warmup_schedule(_optimizer(), **args)  # type: ignore[arg-type]


def test_linear_scaling_rule() -> None:
    assert linear_scaled_lr(0.1, 256) == pytest.approx(0.1)
    assert linear_scaled_lr(0.1, 1024) == pytest.approx(0.4)
    assert linear_scaled_lr(0.5, 64, reference=512) == pytest.approx(0.0625)
    with pytest.raises(ValueError, match="lr_base"):
        linear_scaled_lr(0.0, 256)
    with pytest.raises(ValueError, match="global_batch_size"):
        linear_scaled_lr(0.1, 0)


def test_a_run_resumed_with_more_epochs_stretches_the_decay_to_the_new_end() -> None:
    opt = _optimizer(1.0)
    short = warmup_schedule(opt, epochs=4, steps_per_epoch=5, warmup_epochs=1)
    _rates(opt, short, 12)  # stopped in epoch 3 of 4
    state = short.state_dict()
    opt2 = _optimizer(1.0)
    longer = warmup_schedule(opt2, epochs=8, steps_per_epoch=5, warmup_epochs=1)
    opt2.load_state_dict(opt.state_dict())  # as resume does: the optimizer, then the schedule
    longer.load_state_dict(state)
    rates = _rates(opt2, longer, 28)  # steps 12 .. 40
    assert rates[0] == pytest.approx(opt.param_groups[0]["lr"])  # it goes on from where it was
    assert all(a >= b for a, b in itertools.pairwise(rates))  # and only falls
    assert rates[-1] == pytest.approx(0.0, abs=1e-12)  # to reach 0 at the new end
    assert rates[8] > 0.05  # step 20, where the 4-epoch schedule had reached 0


def test_adding_a_warm_up_on_resume_is_refused() -> None:
    opt = _optimizer()
    state = warmup_schedule(opt, epochs=4, steps_per_epoch=5).state_dict()
    with pytest.raises(ValueError, match="warm-up was added or removed"):
        warmup_schedule(opt, epochs=4, steps_per_epoch=5, warmup_epochs=1).load_state_dict(state)


def test_a_run_resumed_on_another_number_of_ranks_is_placed_by_epochs() -> None:
    # 4 epochs of 10 steps on 2 ranks, stopped after 2.5 epochs; resumed on 4 ranks: 5 a epoch.
    opt = _optimizer(1.0)
    two = warmup_schedule(opt, epochs=4, steps_per_epoch=10, warmup_epochs=1)
    _rates(opt, two, 25)
    state = two.state_dict()
    opt4 = _optimizer(1.0)
    four = warmup_schedule(opt4, epochs=4, steps_per_epoch=5, warmup_epochs=1)
    opt4.load_state_dict(opt.state_dict())
    four.load_state_dict(state)
    fresh_opt = _optimizer(1.0)
    fresh = warmup_schedule(fresh_opt, epochs=4, steps_per_epoch=5, warmup_epochs=1)
    expected = _rates(fresh_opt, fresh, 20)
    rates = _rates(opt4, four, 8)  # 2.5 epochs in: step 12 (12.5 rounded) of 20, to the end
    assert rates == pytest.approx(expected[12:])  # as a fresh 4-rank run from there
    assert rates[-1] == pytest.approx(0.0, abs=1e-12)  # it still ends at the end


def test_a_warm_up_that_leaves_no_step_is_refused() -> None:
    with pytest.raises(ValueError, match="leaves no step"):
        warmup_schedule(_optimizer(), epochs=5, steps_per_epoch=3, warmup_epochs=4.9)
