"""resize_token_embeddings at stage 3 (a model built under a live stage-3 HfInfinityConfig, so partitioned before
initialize(), as DeepSpeed users resize): the new embedding and tied head equal plain Transformers' resize of the
same weights (new rows as Transformers initializes them, mean-resized or not), at world size 1 and 2, and then
train; after initialize() it is refused by name. And an edit of a few rows through GatheredParameters at bf16
leaves the fp32 masters of the other rows bit for bit as they were."""

from __future__ import annotations

import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")

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


def _rank0_changes_the_shape(*, rank: int, world_size: int, nvme: str) -> dict:
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme}}}
    with infinity.zero.Init(config=config):
        layer = torch.nn.Linear(4, 6)
    with GatheredParameters(layer.weight, modifier_rank=0):
        if rank == 0:  # the other rank changes nothing
            layer.weight.data = torch.arange(40, dtype=torch.float32).view(10, 4)
    with GatheredParameters(layer.weight):
        value = layer.weight.detach().clone()
    from infinity.zero.init import init_shard

    return {"value": value, "on_nvme": init_shard(layer.weight).swapped is not None}


def test_a_new_shape_from_the_modifier_rank_alone_reaches_every_rank_and_stays_on_nvme(tmp_path):
    (tmp_path / "nvme").mkdir()
    results = run_distributed(_rank0_changes_the_shape, 2, tmp_path, timeout_s=60, nvme=str(tmp_path / "nvme"))
    for result in results:
        assert torch.equal(result["value"], torch.arange(40, dtype=torch.float32).view(10, 4))
        assert result["on_nvme"]


def test_a_model_whose_own_resize_reads_the_new_shape(tmp_path):
    """BART's resize_token_embeddings calls Transformers' and then reads the new embedding's shape to resize its
    final_logits_bias: it runs whole, inside the gather."""
    config = transformers.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64,
                                     max_position_embeddings=40, dropout=0.0)  # fmt: skip
    live = HfInfinityConfig(CONFIG)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config)
    model.resize_token_embeddings(80)
    assert tuple(model.final_logits_bias.shape) == (1, 80)
    assert model.get_input_embeddings().weight.ds_shape == (80, 32) and model.config.vocab_size == 80
    del live
