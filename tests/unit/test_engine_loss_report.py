"""The engine's steps_per_print line reports the loss as the caller computed it: the mean of the micro-batch
losses, whether the engine divides them by the accumulation steps (the default) or the caller already did
(``scale_wrt_gas=False``, as the Trainer does), so it agrees with the Trainer's own log."""

import re

import pytest
import torch

import infinity


def _reported(caplog) -> list[float]:
    return [float(m[1]) for r in caplog.records if (m := re.match(r"step \d+: loss (\S+)", r.getMessage()))]


@pytest.mark.parametrize("caller_divides", [False, True], ids=["engine-divides", "caller-divides"])
def test_logged_loss_is_the_mean_of_the_callers_losses(caplog, caller_divides):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}  # fmt: skip
    engine, *_ = infinity.initialize(model=model, config=config)
    means = []
    with caplog.at_level("INFO", logger="infinity"):
        for _ in range(2):
            losses = []
            for _ in range(2):
                loss = engine(torch.randn(4, 8)).pow(2).mean()
                losses.append(loss.item())
                if caller_divides:
                    engine.backward(loss / 2, scale_wrt_gas=False)
                else:
                    engine.backward(loss)
                engine.step()
            means.append(sum(losses) / 2)
    assert _reported(caplog) == pytest.approx(means, rel=1e-3)  # the line shows 4 decimals
    engine.destroy()
