"""PEFT LoRA on InfinityTrainer against the plain Trainer + PEFT: the same seeded tiny GPT-2 with LoRA on its
attention and MLP projections, at stage 2 and at stage 3 with the frozen base on NVMe. Logged losses within 1e-5
relative, the trained adapter weights within 1e-5; the optimizer holds the adapters only; save_model writes
PEFT's adapter files and nothing of the base, which PeftModel.from_pretrained loads onto a fresh base. Also:
Accelerate's loop with InfinityAccelerator (AdamW given the frozen base too), and QLoRA's layout without the
quantization (a frozen bf16 base, fp32 adapters) against the plain bf16 Trainer, adapters saved from the masters."""

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

LIVE_LIMIT = 6144  # stage3_max_live_parameters for the stage-3 run: a few of the tiny model's units at once


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
        config["zero_optimization"]["stage3_max_live_parameters"] = LIVE_LIMIT
    trainer = run(config, tmp_path / "infinity")
    got_steps = logged_steps(trainer)
    if stage == 3:  # the frozen base's units are released as backward passes them, as any model's
        units = trainer.engine.stage3.table.units
        assert sum(u.numel for u in units) > 4 * LIVE_LIMIT
        assert trainer.engine.zero_stats()["peak_live_numel"] <= LIVE_LIMIT + max(u.numel for u in units)
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


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_in_an_accelerate_loop_trains_the_adapters_only(stage):
    """Accelerate's documented loop with InfinityAccelerator, AdamW given all of model.parameters() as PEFT's
    examples do: the frozen base leaves the optimizer (as DeepSpeed's ZeRO keeps trainable parameters only), and
    losses, grad norms and the trained adapters (their fp32 masters) equal the plain Accelerator's."""
    from infinity.utils import safe_get_full_fp32_param
    from tests.integrations.test_accelerator import accelerate_loop, assert_close

    want_losses, want_norms, plain, plain_model = accelerate_loop(None, make_model=lora_gpt2)
    want = adapters(plain.unwrap_model(plain_model))
    losses, norms, accelerator, engine = accelerate_loop(stage_config(stage), make_model=lora_gpt2)
    assert_close(losses, want_losses, f"stage {stage} losses")
    assert_close(norms, want_norms, f"stage {stage} grad norms")
    optimized = sum(getattr(p, "ds_numel", p.numel()) for group in engine.zero_optimizer.groups for p in group)
    assert optimized == sum(t.numel() for t in want.values())
    trained = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters() if "lora_" in n}
    assert trained.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)
    engine.destroy()


def bf16_base_lora():
    """QLoRA's layout without the quantization: the base in bf16, frozen; PEFT's adapters in fp32 (its default
    autocast_adapter_dtype)."""
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_fc"],
                             fan_in_fan_out=True, init_lora_weights=False)  # fmt: skip
    base = tiny_gpt2(dropout=0.0).to(torch.bfloat16)
    torch.manual_seed(0)
    model = peft.get_peft_model(base, config)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    return model


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_base_with_fp32_adapters_trains_as_the_plain_bf16_trainer(stage, tmp_path):
    """bf16=True on both sides (the plain Trainer autocasts; the engine computes in bf16 with fp32 masters for
    the adapters), stage 3 with the base on NVMe: logged losses within 1e-5 and the saved adapters, written
    from the masters, in fp32 and within 1e-5 of the plain Trainer's."""
    kwargs = training_arguments(tmp_path / "plain", max_steps=6, bf16=True)
    plain = Trainer(model=bf16_base_lora(), args=TrainingArguments(**kwargs), train_dataset=CountingData(32))
    plain.train()
    plain.save_model(tmp_path / "plain-saved")
    config = stage_config(stage)
    if stage == 3:
        os.makedirs(tmp_path / "nvme")
        config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}
    args = InfinityTrainingArguments(infinity=config, **{**kwargs, "output_dir": str(tmp_path / "infinity")})
    trainer = InfinityTrainer(model=bf16_base_lora(), args=args, train_dataset=CountingData(32))
    trainer.train()
    assert [s["loss"] for s in logged_steps(trainer)] == pytest.approx([s["loss"] for s in logged_steps(plain)],
                                                                        rel=1e-5)  # fmt: skip
    trainer.save_model(tmp_path / "saved")
    trainer.engine.destroy()
    loaded = {}
    for name in ("plain-saved", "saved"):
        model = peft.PeftModel.from_pretrained(tiny_gpt2(dropout=0.0).to(torch.bfloat16), tmp_path / name)
        loaded[name] = adapters(model)
    want, got = loaded["plain-saved"], loaded["saved"]
    assert got.keys() == want.keys() and {v.dtype for v in got.values()} == {torch.float32}
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_parameters_narrower_than_the_compute_dtype_are_said(caplog):
    """A bf16 base under an fp32 config is computed in fp32 (one dtype per engine): said once with the fix; the
    same model under a bf16 config says nothing."""
    import logging

    import infinity

    for bf16, said in ((False, True), (True, False)):
        config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": bf16}, "zero_optimization": {"stage": 2},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="infinity"):
            engine, *_ = infinity.initialize(model=bf16_base_lora(), config=config)
        lines = [r.getMessage() for r in caplog.records if "the engine casts them" in r.getMessage()]
        assert len(lines) == int(said), lines
        if said:
            assert "are bfloat16" in lines[0] and '"bf16": {"enabled": true}' in lines[0]
        engine.destroy()


def _lora_world_size_2(*, rank: int, world_size: int, tmp: str) -> dict:
    from infinity.utils import safe_get_full_fp32_param
    from tests.integrations.test_accelerator import accelerate_loop

    # Accelerate's CPU multi-process state reads the launcher's variables (the harness joined the gloo group)
    os.environ.update({"LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1"})

    def trained(engine) -> dict:
        return {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters() if "lora_" in n}

    results = {}
    for name, make_model, extra in (("lora", lora_gpt2, {}), ("bf16-base", bf16_base_lora, {"bf16": True})):
        plain_args = TrainingArguments(**training_arguments(f"{tmp}/{name}-plain", **extra))
        plain = Trainer(model=make_model(), args=plain_args, train_dataset=CountingData(32))
        plain.train()
        config = stage_config(3)
        os.makedirs(f"{tmp}/{name}-nvme-{rank}")
        config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": f"{tmp}/{name}-nvme-{rank}"}
        args = InfinityTrainingArguments(infinity=config, **training_arguments(f"{tmp}/{name}-infinity", **extra))
        trainer = InfinityTrainer(model=make_model(), args=args, train_dataset=CountingData(32))
        trainer.train()
        results[name] = {"plain": ([s["loss"] for s in logged_steps(plain)], adapters(plain.model)),
                         "infinity": ([s["loss"] for s in logged_steps(trainer)], trained(trainer.engine))}  # fmt: skip
        trainer.engine.destroy()
    want_losses, _, plain_accelerator, plain_model = accelerate_loop(None, make_model=lora_gpt2)
    losses, _, _, engine = accelerate_loop(stage_config(3), make_model=lora_gpt2)
    results["accelerate"] = {"plain": (want_losses, adapters(plain_accelerator.unwrap_model(plain_model))),
                             "infinity": (losses, trained(engine))}  # fmt: skip
    engine.destroy()
    return results


def test_lora_at_world_size_2(tmp_path):
    """Two gloo ranks, stage 3 with the base on NVMe (a folder per rank): LoRA on the Trainer, the bf16 base with
    fp32 adapters (bf16=True), and LoRA in Accelerate's loop: logged losses and trained adapters equal the plain
    Trainer's or Accelerator's (DDP) at the same world size, on both ranks."""
    from tests.distributed.harness import run_distributed

    for result in run_distributed(_lora_world_size_2, 2, tmp_path, timeout_s=240, tmp=str(tmp_path)):
        for name, runs in result.items():
            (got_losses, got), (want_losses, want) = runs["infinity"], runs["plain"]
            assert len(got_losses) >= 4 and got_losses == pytest.approx(want_losses, rel=1e-5), name
            assert got.keys() == want.keys()
            for key, value in want.items():
                torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
