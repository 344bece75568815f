"""The fp16 loss scaler follows DeepSpeed's dynamic rule."""

from infinity.config import Fp16Config
from infinity.precision import LossScaler


def test_disabled_and_static():
    assert LossScaler.from_config(Fp16Config()).scale == 1.0
    static = LossScaler.from_config(Fp16Config(enabled=True, loss_scale=128.0))
    static.update(overflow=True)
    assert static.scale == 128.0


def test_hysteresis_delays_the_first_halving_then_each_overflow_halves():
    scaler = LossScaler.from_config(Fp16Config(enabled=True, initial_scale_power=10, hysteresis=2))
    scaler.update(overflow=True)
    assert scaler.scale == 1024.0  # one unit of hysteresis spent
    scaler.update(overflow=True)
    assert scaler.scale == 512.0
    scaler.update(overflow=True)
    assert scaler.scale == 256.0  # the budget is not refilled until a clean window


def test_window_of_clean_steps_doubles_and_min_scale_holds():
    scaler = LossScaler.from_config(
        Fp16Config(enabled=True, initial_scale_power=2, hysteresis=1, loss_scale_window=3, min_loss_scale=2.0)
    )
    for _ in range(3):
        scaler.update(overflow=True)
    assert scaler.scale == 2.0  # 4 -> 2, then held at min_loss_scale
    for _ in range(2):
        scaler.update(overflow=False)
    assert scaler.scale == 2.0
    scaler.update(overflow=False)
    assert scaler.scale == 4.0  # three clean steps since the last overflow
