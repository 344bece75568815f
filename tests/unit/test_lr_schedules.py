"""DeepSpeed's schedules: the curves at their landmarks."""

import math

import pytest
import torch

from infinity.errors import ConfigError
from infinity.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR


def optimizer(lr=1.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def lrs(schedule, steps):
    values = [schedule.get_last_lr()[0]]
    for _ in range(steps):
        schedule.step()
        values.append(schedule.get_last_lr()[0])
    return values


def test_warmup_lr_log_and_linear():
    log = lrs(WarmupLR(optimizer(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10), 12)
    assert log[0] == 0.0 and log[9] == pytest.approx(1.0) and log[12] == 1.0
    assert log[4] == pytest.approx(math.log(5) / math.log(10))
    linear = lrs(WarmupLR(optimizer(), 0.1, 1.1, 4, warmup_type="linear"), 6)
    assert linear[:5] == pytest.approx([0.1, 0.35, 0.6, 0.85, 1.1])


def test_warmup_decay_reaches_zero_at_total():
    values = lrs(
        WarmupDecayLR(optimizer(), total_num_steps=20, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear"), 25
    )
    assert values[10] == pytest.approx(1.0) and values[15] == pytest.approx(0.5) and values[20] == 0.0
    assert values[25] == 0.0


def test_warmup_cosine_is_relative_to_the_optimizer_lr():
    values = lrs(
        WarmupCosineLR(
            optimizer(lr=2.0), total_num_steps=12, warmup_num_steps=2, warmup_type="linear", cos_min_ratio=0.1
        ),
        12,
    )
    assert values[0] == 0.0 and values[1] == pytest.approx(1.0)
    assert values[12] == pytest.approx(0.2)  # 2.0 x cos_min_ratio at the end
    assert all(a >= b for a, b in zip(values[2:], values[3:], strict=False))


def test_bad_warmup_type():
    with pytest.raises(ConfigError, match="warmup_type"):
        WarmupLR(optimizer(), warmup_type="cosine")
