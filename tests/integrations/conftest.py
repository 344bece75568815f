"""Every test here leaves no stage-3 HfInfinityConfig alive: one would make every later from_pretrained in the
process partition its model (as a live HfDeepSpeedConfig does with DeepSpeed). Checked after tests that passed
(a failed test's traceback keeps its objects alive: that failure is the one to read)."""

from __future__ import annotations

import gc

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.call_passed = report.passed


@pytest.fixture(autouse=True)
def no_live_partitioning_config(request):
    yield
    if not getattr(request.node, "call_passed", False):
        return
    from infinity.integrations import hf_loading

    if hf_loading.live_config() is not None:
        gc.collect()  # a Trainer, its arguments and its accelerator refer to each other: cycles go with gc
    assert not hf_loading.is_zero3_active(), "a stage-3 HfInfinityConfig outlived its test"
