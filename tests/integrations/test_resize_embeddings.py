"""resize_token_embeddings at stage 3 (a model built under a live stage-3 HfInfinityConfig, so partitioned before
initialize(), as DeepSpeed users resize): the new embedding and tied head equal plain Transformers' resize of the
same weights (new rows as Transformers initializes them, mean-resized or not), at world size 1 and 2, and then
train; after initialize() it is refused by name. And an edit of a few rows through GatheredParameters at bf16
leaves the fp32 masters of the other rows bit for bit as they were."""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, GPT2Config  # noqa: E402

import infinity  # noqa: E402
from infinity.errors import ConfigError  # noqa: E402
from infinity.integrations.hf_loading import HfInfinityConfig  # noqa: E402
from infinity.utils import safe_get_full_fp32_param  # noqa: E402
from infinity.zero import GatheredParameters  # noqa: E402
from tests.distributed.harness import run_distributed  # noqa: E402

GPT2 = dict(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=None, eos_token_id=None,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # fmt: skip


def _resize(*, rank: int, world_size: int) -> dict:
    config = GPT2Config(**GPT2)
    hf = HfInfinityConfig(CONFIG)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    del hf
    gc.collect()  # no live config: the plain model is built whole
    plain = AutoModelForCausalLM.from_config(config)
    with GatheredParameters(list(model.parameters())):
        plain.load_state_dict({n: p.detach().clone() for n, p in model.state_dict().items()})
    hf = HfInfinityConfig(CONFIG)
    differences = []
    for size, mean in ((80, False), (96, True)):
        for resized in (plain, model):
            torch.manual_seed(5)
            resized.resize_token_embeddings(size, mean_resizing=mean)
        with GatheredParameters(list(model.parameters())):
            got = {n: p.detach().clone() for n, p in model.named_parameters()}
        want = dict(plain.named_parameters())
        assert got.keys() == want.keys() and got["transformer.wte.weight"].shape == (size, 32)
        differences.append(max(float((got[n] - want[n].detach()).abs().max()) for n in want))
    tied = model.lm_head.weight is model.transformer.wte.weight
    engine, *_ = infinity.initialize(model=model, config=CONFIG)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(3):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    refused = None
    try:
        engine.module.resize_token_embeddings(100)
    except ConfigError as e:
        refused = str(e)
    engine.destroy()
    del hf
    return {"differences": differences, "tied": tied, "losses": losses, "refused": refused}


@pytest.mark.parametrize("world_size", [1, 2])
def test_resize_before_initialize_equals_transformers_and_trains(world_size, tmp_path):
    for result in run_distributed(_resize, world_size, tmp_path, timeout_s=120):
        assert result["differences"] == [0.0, 0.0] and result["tied"]
        assert result["losses"][-1] < result["losses"][0]
        assert "resize before infinity.initialize()" in result["refused"]


def test_an_edit_of_some_rows_keeps_the_other_masters_bits(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(**GPT2))
    engine, *_ = infinity.initialize(model=model, config={**CONFIG, "bf16": {"enabled": True}})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    weight = engine.module.transformer.wte.weight
    before = safe_get_full_fp32_param(weight)
    assert not torch.equal(before, before.bfloat16().float())  # the masters hold bits bf16 does not
    with GatheredParameters(weight, modifier_rank=0), torch.no_grad():
        weight[3] = 0.5
    after = safe_get_full_fp32_param(weight)
    assert torch.equal(after[3], torch.full((32,), 0.5))
    others = [row for row in range(64) if row != 3]
    assert torch.equal(after[others], before[others])
    engine.destroy()
