"""PEFT LoRA on InfinityTrainer against the plain Trainer + PEFT: the same seeded tiny GPT-2 with LoRA on its
attention and MLP projections, at stage 2 and at stage 3 with the frozen base on NVMe. Logged losses within 1e-5
relative, the trained adapter weights within 1e-5; the optimizer holds the adapters only; save_model writes
PEFT's adapter files and nothing of the base, which PeftModel.from_pretrained loads onto a fresh base."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
peft = pytest.importorskip("peft")

from transformers import Trainer, TrainingArguments  # noqa: E402

from infinity.integrations.transformers import InfinityTrainer, InfinityTrainingArguments  # noqa: E402
from tests.integrations.test_accelerator import CountingData, stage_config, tiny_gpt2  # noqa: E402
from tests.integrations.test_trainer import logged_steps, training_arguments  # noqa: E402


def lora_gpt2():
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_fc"],
                             fan_in_fan_out=True, init_lora_weights=False)  # B not zero: every adapter moves
    torch.manual_seed(0)
    return peft.get_peft_model(tiny_gpt2(dropout=0.0), config)


def adapters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def run(config, output_dir, resume=None, **overrides):
    kwargs = training_arguments(output_dir, **{"max_steps": 4, **overrides})
    data = {"train_dataset": CountingData(32)}
    model = lora_gpt2()
    if config is None:
        trainer = Trainer(model=model, args=TrainingArguments(**kwargs), **data)
    else:
        trainer = InfinityTrainer(model=model, args=InfinityTrainingArguments(infinity=config, **kwargs), **data)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_trains_as_the_plain_trainer_and_saves_the_adapter_only(stage, tmp_path):
    plain = run(None, tmp_path / "plain")
    want_steps, want = logged_steps(plain), adapters(plain.model)
    config = stage_config(stage)
    if stage == 3:
        os.makedirs(tmp_path / "nvme")
        config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path / "nvme"),
                                                        "max_in_cpu": 0}  # fmt: skip
    trainer = run(config, tmp_path / "infinity")
    got_steps = logged_steps(trainer)
    assert [s["loss"] for s in got_steps] == pytest.approx([s["loss"] for s in want_steps], rel=1e-5)
    optimized = sum(getattr(p, "ds_numel", p.numel()) for group in trainer.engine.zero_optimizer.groups for p in group)
    assert optimized == sum(t.numel() for t in want.values())  # the adapters, nothing of the base
    trainer.save_model(tmp_path / "saved")
    saved = sorted(os.listdir(tmp_path / "saved"))
    assert "adapter_model.safetensors" in saved and "adapter_config.json" in saved
    assert "model.safetensors" not in saved, saved
    loaded = peft.PeftModel.from_pretrained(tiny_gpt2(dropout=0.0), tmp_path / "saved")
    got = adapters(loaded)
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    trainer.engine.destroy()


def test_a_lora_checkpoint_holds_the_adapters_and_resumes(tmp_path):
    """Stage 3, base on NVMe: the Trainer's checkpoint-4 holds no base weights; resumed from it, steps 5-8 log
    the losses of the uninterrupted run."""
    os.makedirs(tmp_path / "nvme")
    config = stage_config(3)
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}
    whole = run(config, tmp_path / "run", max_steps=8, save_strategy="steps", save_steps=4)
    want = logged_steps(whole)
    whole.engine.destroy()
    manifest = (tmp_path / "run" / "checkpoint-4" / "global_step4" / "manifest.json").read_text()
    assert '"params/base_model.model.transformer.h.0.attn.c_attn.base_layer.weight"' not in manifest
    assert '"frozen_excluded": [' in manifest and "lora_A" in manifest
    resumed = run(config, tmp_path / "run", resume=str(tmp_path / "run" / "checkpoint-4"), max_steps=8,
                  save_strategy="no")  # fmt: skip
    again = [s for s in logged_steps(resumed) if s["step"] > 4]
    assert [s["step"] for s in again] == [5, 6, 7, 8]
    assert [s["loss"] for s in again] == pytest.approx([s["loss"] for s in want[4:]], rel=1e-5)
    resumed.engine.destroy()


def test_a_lora_model_generates_gathered_once_with_the_plain_tokens(tmp_path):
    """A PeftModel's generate (*args, **kwargs) gets the stage-3 generate behaviour too: the model gathered once
    for the call, no fetch per token, the tokens of the same LoRA model in plain PyTorch."""
    import infinity

    plain = lora_gpt2().eval()
    prompt = torch.tensor([[5, 17, 33, 2]])
    want = plain.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    engine, *_ = infinity.initialize(model=lora_gpt2().eval(), config={
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})  # fmt: skip
    events = []
    original = engine.stage3.coordinator.on_event
    engine.stage3.coordinator.on_event = lambda *args: (events.append(args), original(*args))[1]
    got = engine.module.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want) and events == []
    engine.destroy()
