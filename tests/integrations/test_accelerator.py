"""InfinityAccelerator against a plain Accelerator: the same seeded tiny GPT-2, data, optimizer and scheduler, the
loop Accelerate's docs show (accumulate(), backward, clip at sync, step, scheduler step, zero_grad). The losses
and the gradient norms must agree at stage 2 and 3; get_state_dict must be the plain model's; save_state then
load_state must reproduce the steps that followed. The world-size-2 loop runs in tests/integrations/test_trainer.py's
one distributed run."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from infinity.errors import ConfigError  # noqa: E402
from infinity.integrations.accelerate import InfinityAccelerator  # noqa: E402

VOCAB, SEQ = 128, 16
REL = 1e-5


def tiny_gpt2(dropout: float = 0.1) -> GPT2LMHeadModel:
    """Seeded, so every call (and every rank) builds the same weights; no special tokens (none in this vocab)."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=None,
                        eos_token_id=None, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)  # fmt: skip
    return GPT2LMHeadModel(config)


class CountingData(torch.utils.data.Dataset):
    """Sequences that count up from a seeded random token: learnable, the same on every rank."""

    def __init__(self, n: int, seed: int = 1) -> None:
        first = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
        self.ids = (first + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def stage_config(stage: int, nvme_path=None) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # partition every parameter of the tiny model
    if nvme_path is not None:
        os.makedirs(nvme_path, exist_ok=True)
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme_path)}
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": 1.0}  # fmt: skip


def fresh_accelerate_state() -> None:
    """Accelerate keeps its state in process-wide singletons; each loop here starts from none."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), (what, got, want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert math.isclose(a, b, rel_tol=REL), f"{what}[{i}]: {a!r} vs {b!r} (all: {got} vs {want})"


def accelerate_loop(config: dict | None, *, steps_per_epoch_samples: int = 16, resume_from=None, save_at=None,
                    make_model=None):  # fmt: skip
    """The documented loop over 8 micro-batches (accumulation 2: 4 optimizer steps). ``config`` None: plain
    Accelerator. Returns (losses, grad norms, accelerator, model)."""
    fresh_accelerate_state()
    # No dropout: the resumed loop starts its DataLoader after load_state, which draws from the restored RNG.
    model = tiny_gpt2(dropout=0.0) if make_model is None else make_model()
    loader = torch.utils.data.DataLoader(CountingData(steps_per_epoch_samples), batch_size=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    kwargs = {"gradient_accumulation_steps": 2, "cpu": True}
    accelerator = Accelerator(**kwargs) if config is None else InfinityAccelerator(infinity=config, **kwargs)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if resume_from is not None:
        accelerator.load_state(resume_from)
    losses, norms = [], []
    for i, batch in enumerate(loader):
        if resume_from is not None and i < 4:
            continue  # those micro-batches were before the saved state
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if save_at is not None and i == 3:
            accelerator.save_state(save_at)
    return losses, norms, accelerator, model


def test_accelerator_loop_matches_plain_accelerate(tmp_path):
    plain_losses, plain_norms, plain, plain_model = accelerate_loop(None)
    # Adam moves near-zero weights by ~lr whatever the gradient's size: 1e-5 absolute is 1e-3 of one step.
    plain_state = {k: v.detach().clone() for k, v in plain.get_state_dict(plain_model).items()}
    for stage in (2, 3):
        config = stage_config(stage)
        if stage == 3:  # get_state_dict gathers the 16-bit weights only with the flag, as under DeepSpeed
            config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        losses, norms, accelerator, engine = accelerate_loop(config, save_at=tmp_path / f"state{stage}")
        assert_close(losses, plain_losses, f"stage {stage} losses")
        assert_close(norms, plain_norms, f"stage {stage} grad norms")
        assert accelerator.unwrap_model(engine) is engine.module
        state = accelerator.get_state_dict(engine)
        assert state.keys() == plain_state.keys()
        for key, value in plain_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
        if stage == 3:  # without the gather flag: an error, as Accelerate's under DeepSpeed
            zero = dataclasses.replace(engine.config.zero, stage3_gather_16bit_weights_on_model_save=False)
            engine.config = dataclasses.replace(engine.config, zero=zero)
            with pytest.raises(ConfigError, match="stage3_gather_16bit_weights_on_model_save"):
                accelerator.get_state_dict(engine)
        engine.destroy()
        # The saved state (after micro-batch 4: two optimizer steps) resumes the last two steps exactly.
        resumed, resumed_norms, accelerator, engine = accelerate_loop(
            stage_config(stage), resume_from=tmp_path / f"state{stage}"
        )
        assert_close(resumed, losses[4:], f"stage {stage} resumed losses")
        assert_close(resumed_norms, norms[2:], f"stage {stage} resumed grad norms")
        engine.destroy()


def test_accelerator_refuses_what_it_cannot_honour():
    fresh_accelerate_state()
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(CountingData(4), batch_size=2)
    with_optimizer = {**stage_config(2), "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    accelerator = InfinityAccelerator(infinity=with_optimizer, cpu=True)
    with pytest.raises(ConfigError, match='"optimizer" section and prepare\\(\\) got a torch optimizer'):
        accelerator.prepare(model, optimizer, loader)
    accelerator = InfinityAccelerator(infinity=stage_config(2), cpu=True)
    with pytest.raises(ConfigError, match="needs the model prepared first"):
        accelerator.backward(torch.zeros((), requires_grad=True))
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with pytest.raises(ConfigError, match=r"clip_grad_norm_\(max_norm=0.5\) but the config's gradient_clipping is 1.0"):
        accelerator.clip_grad_norm_(engine.parameters(), 0.5)
    with pytest.raises(ConfigError, match="already given a model"):
        accelerator.prepare(tiny_gpt2())
    assert accelerator.prepare(optimizer) is optimizer  # what it prepared comes back (a second trainer.train())
    with pytest.raises(ConfigError, match=r"belongs to a live infinity engine .* engine.destroy\(\)"):
        InfinityAccelerator(infinity=stage_config(2), cpu=True).prepare(model, torch.optim.AdamW(model.parameters()))
    engine.destroy()
    # Below stage 3 the weights stay in the model: once its engine is destroyed, another may take it over.
    fresh_accelerate_state()
    again = InfinityAccelerator(infinity=stage_config(2), cpu=True)
    loader = torch.utils.data.DataLoader(CountingData(4), batch_size=2)
    engine, _, loader = again.prepare(model, torch.optim.AdamW(model.parameters()), loader)
    again.backward(engine(**next(iter(loader))).loss)
    engine.destroy()
    with pytest.raises(ConfigError, match="does not take deepspeed_plugin"):
        InfinityAccelerator(infinity=stage_config(2), deepspeed_plugin=object())
