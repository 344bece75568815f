"""Every test here leaves no stage-3 HfInfinityConfig alive: one would make every later from_pretrained in the
process partition its model (as a live HfDeepSpeedConfig does with DeepSpeed)."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True)
def no_live_partitioning_config():
    yield
    from infinity.integrations import hf_loading

    if hf_loading.live_config() is not None:
        gc.collect()  # a Trainer, its arguments and its accelerator refer to each other: cycles go with gc
    assert not hf_loading.is_zero3_active(), "a stage-3 HfInfinityConfig outlived its test"
