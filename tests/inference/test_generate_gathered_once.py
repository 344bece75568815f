"""generate() at stage 3 gathers the whole model once for the call when it fits stage3_max_live_parameters
([Note: generation gathered once] in infinity/generation.py): the same tokens as the plain model, no fetch during
the call (the hooks step aside), the units released after, at world size 1 and 2 (ranks whose sequences stop at
different lengths need no collective per token then); a model over the limit streams, and the engine says so."""

from __future__ import annotations

import logging

import torch

import infinity
from tests.distributed.harness import run_distributed
from tests.inference.models import greedy, load_tiny_gpt2, save_tiny_gpt2

PROMPTS = {0: [5, 17, 33, 2], 1: [9, 41, 7, 100, 12, 3]}


def config(max_live: int) -> dict:
    return {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_max_live_parameters": max_live}}  # fmt: skip


def _generate(*, rank: int, world_size: int, model_dir: str, max_live: int) -> dict:
    plain = load_tiny_gpt2(model_dir)
    prompt = torch.tensor([PROMPTS[rank]])
    new_tokens = 4 if rank == 0 else 9  # the ranks stop at different lengths
    reference = greedy(plain, prompt, max_new_tokens=new_tokens, eos_token_id=None)
    engine, *_ = infinity.initialize(model=load_tiny_gpt2(model_dir), config=config(max_live))
    coordinator = engine.stage3.coordinator
    events = []
    original = coordinator.on_event
    coordinator.on_event = lambda *args: (events.append(args), original(*args))[1]
    generated = greedy(engine.module, prompt, max_new_tokens=new_tokens, eos_token_id=None)
    released = all(unit.state.value == "released" for unit in engine.stage3.table.units if not unit.persistent)
    engine.destroy()
    return {"equal": torch.equal(generated, reference), "events": len(events), "released": released}


def test_a_model_within_the_limit_is_gathered_once_for_generate(tmp_path):
    model_dir = save_tiny_gpt2(tmp_path / "model")
    for world_size in (1, 2):
        (tmp_path / f"w{world_size}").mkdir()
        for result in run_distributed(_generate, world_size, tmp_path / f"w{world_size}", timeout_s=120,
                                      model_dir=model_dir, max_live=10**9):  # fmt: skip
            assert result["equal"] and result["released"]
            assert result["events"] == 0  # no per-module fetching during generate()


def test_a_model_over_the_limit_streams_and_says_so(tmp_path, caplog):
    model_dir = save_tiny_gpt2(tmp_path / "model")
    with caplog.at_level(logging.INFO, logger="infinity"):
        result = _generate(rank=0, world_size=1, model_dir=model_dir, max_live=8192)
    assert result["equal"] and result["events"] > 0
    assert "generate() streams the weights unit by unit" in caplog.text


def test_unwrap_model_for_generation_gathers_once_whatever_the_limit(tmp_path):
    """DeepSpeed's unwrap_model_for_generation (TRL's way): inside it, generate() fetches nothing."""
    model_dir = save_tiny_gpt2(tmp_path / "model")
    plain = load_tiny_gpt2(model_dir)
    prompt = torch.tensor([PROMPTS[1]])
    engine, *_ = infinity.initialize(model=load_tiny_gpt2(model_dir), config=config(8192))
    events = []
    original = engine.stage3.coordinator.on_event
    engine.stage3.coordinator.on_event = lambda *args: (events.append(args), original(*args))[1]
    with infinity.runtime.zero.stage3.unwrap_model_for_generation(engine) as unwrapped:
        generated = greedy(unwrapped.module, prompt, max_new_tokens=6, eos_token_id=None)
    assert events == [] and torch.equal(generated, greedy(plain, prompt, max_new_tokens=6, eos_token_id=None))
    engine.destroy()


def test_a_forward_with_gradients_inside_a_whole_gather_releases_nothing(tmp_path):
    """GatheredParameters holds its units: a forward with gradients inside the block neither releases them nor
    leaves a later forward without gradients on placeholders."""
    model_dir = save_tiny_gpt2(tmp_path / "model")
    engine, *_ = infinity.initialize(model=load_tiny_gpt2(model_dir), config=config(10**9))
    prompt = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        want = engine(prompt).logits.clone()
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        with_grad = engine(prompt).logits
        with torch.no_grad():
            after = engine(prompt).logits
    assert torch.equal(with_grad.detach(), want) and torch.equal(after, want)
    assert engine.stage3.coordinator.held == {} and engine.stage3.coordinator.whole_held == 0
    engine.destroy()
