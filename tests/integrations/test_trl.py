"""TRL's SFTTrainer and DPOTrainer on the engine (infinity/integrations/trl.py) against the same TRL trainers on
the plain Trainer: a seeded tiny GPT-2 with a character tokenizer built here, fp32, every logged metric within 1e-5
relative (SFT's loss, entropy and token accuracy; DPO's loss, rewards and log-probabilities), the trained weights
within 1e-5 (5e-5 absolute: WEIGHTS_ATOL). Both go through TRL's fused LM head, which reads the (tied) head weight
directly inside a custom autograd function, forward and backward. DPO's reference model becomes a partitioned
inference engine at stage 3 with its pieces on NVMe, and is blended into by sync_ref_model; with LoRA the
reference is the base with the adapters off. GRPO (a pair made by infinity_trainer) generates with the stage-3
model and trains. The world-size-2 run trains SFT and DPO, plain and infinity, in each of two gloo ranks."""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch

peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from infinity.errors import ConfigError  # noqa: E402
from infinity.integrations.accelerate import full_state_dict  # noqa: E402
from infinity.integrations.trl import (  # noqa: E402
    InfinityDPOConfig,
    InfinityDPOTrainer,
    InfinitySFTConfig,
    InfinitySFTTrainer,
    infinity_trainer,
)
from tests.distributed.harness import run_distributed  # noqa: E402
from tests.integrations.test_accelerator import VOCAB, stage_config, tiny_gpt2  # noqa: E402

REL = 1e-5
# Trained weights: c_attn's key bias gets gradients at rounding-noise level (softmax ignores a constant per row),
# which Adam divides by their own size, so the sum order of a reduction shows there (measured: 7.5e-6 at most).
WEIGHTS_ATOL = 5e-5
SFT_METRICS = ("loss", "entropy", "mean_token_accuracy")
DPO_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


def tokenizer() -> PreTrainedTokenizerFast:
    """One token per character a-z, the rest of the tiny vocabulary unused but the last (end and padding)."""
    vocab = {chr(ord("a") + i): i for i in range(26)} | {"<eos>": VOCAB - 1}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<eos>", pad_token="<eos>")


def letters(start: int, n: int) -> str:
    return "".join(chr(ord("a") + (start + i) % 26) for i in range(n))


def sft_data():
    return datasets.Dataset.from_dict({"text": [letters(s, 12) for s in range(16)]})


def dpo_data():
    return datasets.Dataset.from_dict({"prompt": [letters(s, 4) for s in range(16)],
                                       "chosen": [letters(s + 4, 5) for s in range(16)],
                                       "rejected": [letters(s + 9, 3)[::-1] + "zz" for s in range(16)]})  # fmt: skip


def arguments(output_dir, world_size: int = 1, **overrides) -> dict:
    return dict(output_dir=str(output_dir), per_device_train_batch_size=4 // world_size, gradient_accumulation_steps=2,
                learning_rate=1e-2, max_steps=4, logging_steps=1, report_to=[], seed=0, save_strategy="no",
                disable_tqdm=True, use_cpu=True, bf16=False, max_length=16, **overrides)  # fmt: skip


def nvme_stage3(folder) -> dict:
    """Stage 3 with the parameters (the reference model's too) and the optimizer states on NVMe."""
    config = stage_config(3, nvme_path=folder)
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(folder), "max_in_cpu": 0}
    return config


def lora(model):
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_fc"],
                             fan_in_fan_out=True, init_lora_weights=False)  # fmt: skip
    torch.manual_seed(0)
    return peft.get_peft_model(model, config)


def logged(trainer, names) -> list[list[float]]:
    return [[h[name] for name in names] for h in trainer.state.log_history if "loss" in h]


def weights(trainer) -> dict[str, torch.Tensor]:
    if getattr(trainer, "engine", None) is None:
        return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return full_state_dict(trainer.engine)


def sft(config, output_dir, world_size: int = 1):
    """(trainer, logged metrics); config None: TRL's SFTTrainer as it is."""
    kwargs = {"model": tiny_gpt2(dropout=0.0), "train_dataset": sft_data(), "processing_class": tokenizer()}
    if config is None:
        trainer = trl.SFTTrainer(args=trl.SFTConfig(**arguments(output_dir, world_size)), **kwargs)
    else:
        args = InfinitySFTConfig(infinity=config, **arguments(output_dir, world_size))
        trainer = InfinitySFTTrainer(args=args, **kwargs)
    trainer.train()
    return trainer, logged(trainer, SFT_METRICS)


def dpo(config, output_dir, world_size: int = 1, *, adapters: bool = False, **overrides):
    """(trainer, logged metrics): with a reference model of the policy's initial weights, or LoRA adapters on the
    policy (the reference is the base, adapters off)."""
    model = lora(tiny_gpt2(dropout=0.0)) if adapters else tiny_gpt2(dropout=0.0)
    kwargs = {"model": model, "train_dataset": dpo_data(), "processing_class": tokenizer(),
              "ref_model": None if adapters else tiny_gpt2(dropout=0.0)}  # fmt: skip
    if config is None:
        trainer = trl.DPOTrainer(args=trl.DPOConfig(**arguments(output_dir, world_size, **overrides)), **kwargs)
    else:
        args = InfinityDPOConfig(infinity=config, **arguments(output_dir, world_size, **overrides))
        trainer = InfinityDPOTrainer(args=args, **kwargs)
    trainer.train()
    return trainer, logged(trainer, DPO_METRICS)


def assert_same_run(got, want, what: str) -> None:
    (got_trainer, got_logs), (want_trainer, want_logs) = got, want
    assert len(got_logs) == len(want_logs) == 4, (what, got_logs)
    for step, (a, b) in enumerate(zip(got_logs, want_logs, strict=True)):
        assert a == pytest.approx(b, rel=REL, abs=1e-6), (what, step, got_logs, want_logs)
    got_weights, want_weights = weights(got_trainer), weights(want_trainer)
    assert got_weights.keys() == want_weights.keys()
    for name, value in want_weights.items():
        torch.testing.assert_close(got_weights[name], value, rtol=REL, atol=WEIGHTS_ATOL, msg=f"{what}: {name}")


def destroy(trainer) -> None:
    for engine in (trainer.engine, *trainer.accelerator.reference_engines):
        engine.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_sft_trains_as_trl_on_the_plain_trainer(stage, tmp_path):
    """At stage 3 the parameters and optimizer states live on NVMe."""
    want = sft(None, tmp_path / "plain")
    config = nvme_stage3(tmp_path / "nvme") if stage == 3 else stage_config(2)
    got = sft(config, tmp_path / "infinity")
    assert_same_run(got, want, f"SFT stage {stage}")
    destroy(got[0])


@pytest.mark.parametrize("sync", [False, True], ids=["fixed-reference", "sync_ref_model"])
def test_dpo_reference_model_is_a_partitioned_inference_engine(sync, tmp_path):
    """Stage 3, everything on NVMe: the reference model is an inference engine whose pieces are on NVMe; the run
    equals TRL's, also with sync_ref_model blending the policy into the reference every 2 steps."""
    overrides = {"sync_ref_model": True, "ref_model_sync_steps": 2, "ref_model_mixup_alpha": 0.5} if sync else {}
    want = dpo(None, tmp_path / "plain", **overrides)
    got = dpo(nvme_stage3(tmp_path / "nvme"), tmp_path / "infinity", **overrides)
    reference = got[0].ref_model
    assert reference in got[0].accelerator.reference_engines and reference.stage3 is not None
    assert got[0].accelerator.prepare_model(reference.module, evaluation_mode=True) is reference  # prepared once
    assert reference.config.zero.offload_param.device == "nvme"
    assert not any(p._backward_hooks for p in reference.module.parameters())  # no gradient ever comes to it
    assert_same_run(got, want, "DPO")
    if sync:  # the blended reference, gathered, equals TRL's
        blended, plain = full_state_dict(reference), want[0].ref_model.state_dict()
        for name, value in blended.items():
            torch.testing.assert_close(value, plain[name], rtol=REL, atol=WEIGHTS_ATOL, msg=name)
    destroy(got[0])


def test_dpo_with_lora_takes_the_base_as_reference(tmp_path):
    """A LoRA policy at stage 3 with its base on NVMe: no reference model is made (the adapters are switched off
    for the reference pass), and the run equals TRL's."""
    want = dpo(None, tmp_path / "plain", adapters=True)
    got = dpo(nvme_stage3(tmp_path / "nvme"), tmp_path / "infinity", adapters=True)
    assert got[0].ref_model is None and not got[0].accelerator.reference_engines
    assert_same_run(got, want, "DPO + LoRA")
    destroy(got[0])


def kto_data():
    return datasets.Dataset.from_dict({"prompt": [letters(s, 4) for s in range(16)],
                                       "completion": [letters(s + 4, 4) if s % 2 else letters(s, 4)[::-1]
                                                      for s in range(16)],
                                       "label": [bool(s % 2) for s in range(16)]})  # fmt: skip


def test_any_trainer_subclass_gets_its_pair_which_trains_and_saves(tmp_path):
    """infinity_trainer builds the engine's pair for a TRL trainer without a ready-made one (KTO here): it trains
    to TRL's losses, and its arguments pickle (the Trainer saves them with the model and every checkpoint)."""
    trainer_class, config_class = infinity_trainer(trl.KTOTrainer, trl.KTOConfig)
    assert trainer_class.__mro__[1:3] == (InfinitySFTTrainer.__mro__[1], trl.KTOTrainer)
    assert config_class.__mro__[1:3] == (InfinitySFTConfig.__mro__[1], trl.KTOConfig)
    assert infinity_trainer(trl.KTOTrainer, trl.KTOConfig) == (trainer_class, config_class)  # made once
    with pytest.raises(ConfigError, match="InfinityDPOConfig is already .* another class"):
        infinity_trainer(trl.KTOTrainer, type("DPOConfig", (trl.DPOConfig,), {}))  # a user's own class, same name
    runs, sequential = [], {"train_sampling_strategy": "sequential"}  # KTO's KL term pairs neighbours
    for name in ("plain", "infinity"):
        common = {"model": tiny_gpt2(dropout=0.0), "ref_model": tiny_gpt2(dropout=0.0), "train_dataset": kto_data(),
                  "processing_class": tokenizer()}  # fmt: skip
        if name == "plain":
            trainer = trl.KTOTrainer(args=trl.KTOConfig(**arguments(tmp_path / name), **sequential), **common)
        else:
            args = config_class(infinity=nvme_stage3(tmp_path / "nvme"), **arguments(tmp_path / name), **sequential)
            trainer = trainer_class(args=args, **common)
        trainer.train()
        runs.append(([row[0] for row in logged(trainer, ("loss",))], weights(trainer)))
    assert trainer.ref_model in trainer.accelerator.reference_engines
    (got, got_weights), (want, want_weights) = runs[1], runs[0]
    assert len(got) == 4 and got == pytest.approx(want, rel=REL)
    for name, value in want_weights.items():
        torch.testing.assert_close(got_weights[name], value, rtol=REL, atol=WEIGHTS_ATOL, msg=name)
    trainer.save_model(tmp_path / "saved")
    saved = torch.load(tmp_path / "saved" / "training_args.bin", weights_only=False)
    assert type(saved) is config_class and saved.infinity_config["zero_optimization"]["stage"] == 3
    destroy(trainer)


def _world_size_2(*, rank: int, world_size: int, tmp: str) -> dict:
    # Accelerate's CPU multi-process state reads the launcher's variables (the harness joined the gloo group)
    os.environ.update({"LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1"})
    sync = {"sync_ref_model": True, "ref_model_sync_steps": 2, "ref_model_mixup_alpha": 0.5}
    recipes = {"sft": sft, "dpo": dpo, "dpo-lora": functools.partial(dpo, adapters=True),
               "dpo-sync": functools.partial(dpo, **sync)}  # fmt: skip
    runs = {}
    for name, run in recipes.items():
        plain_trainer, plain_logs = run(None, f"{tmp}/{name}-plain", world_size)
        trainer, logs = run(nvme_stage3(f"{tmp}/nvme-{rank}"), f"{tmp}/{name}-infinity", world_size)
        got = weights(trainer)  # collective; rank 0 keeps the copies
        runs[name] = {"plain": (plain_logs, weights(plain_trainer) if got else {}), "infinity": (logs, got)}
        destroy(trainer)
    return runs


def test_world_size_2(tmp_path):
    """Two gloo ranks, stage 3 with everything on NVMe (a folder per rank): SFT, DPO with a reference model,
    with LoRA and with sync_ref_model each equal TRL's run on the plain Trainer (DDP) at the same world size, on
    every rank."""
    for result in run_distributed(_world_size_2, 2, tmp_path, timeout_s=300, tmp=str(tmp_path)):
        for name, runs in result.items():
            (got_logs, got_weights), (want_logs, want_weights) = runs["infinity"], runs["plain"]
            assert len(got_logs) == len(want_logs) == 4, (name, got_logs)
            for a, b in zip(got_logs, want_logs, strict=True):
                assert a == pytest.approx(b, rel=REL, abs=1e-6), (name, got_logs, want_logs)
            assert got_weights.keys() == want_weights.keys()
            for key, value in want_weights.items():
                torch.testing.assert_close(got_weights[key], value, rtol=REL, atol=WEIGHTS_ATOL, msg=f"{name}: {key}")


def letters_said(completions, **_) -> list[float]:
    """A reward the tiny model can move: how many letters its completion says (most of its vocabulary is not in
    the tokenizer's and decodes to nothing)."""
    return [float(len(completion)) for completion in completions]


def test_grpo_generates_and_trains_as_trl(tmp_path):
    """TRL's GRPOTrainer, made by infinity_trainer (no ready-made pair), given the model as a folder (TRL loads it,
    partitioned as it loads, and its KL reference from the same folder: an inference engine here): each step
    generates 4 completions per prompt with the stage-3 model on NVMe, scores them and trains; losses, rewards,
    KL and trained weights equal TRL's on the plain Trainer."""
    trainer_class, config_class = infinity_trainer(trl.GRPOTrainer, trl.GRPOConfig)
    tiny_gpt2(dropout=0.0).save_pretrained(tmp_path / "model")
    data = datasets.Dataset.from_dict({"prompt": [letters(s, 3) for s in range(8)]})
    kwargs = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=6, learning_rate=1e-2,
                  max_steps=3, beta=0.1, logging_steps=1, report_to=[], seed=0, save_strategy="no", disable_tqdm=True,
                  use_cpu=True, bf16=False)  # fmt: skip
    runs, trained = [], []
    for name in ("plain", "infinity"):
        common = {"model": str(tmp_path / "model"), "reward_funcs": letters_said, "train_dataset": data,
                  "processing_class": tokenizer()}  # fmt: skip
        if name == "plain":
            trainer = trl.GRPOTrainer(args=trl.GRPOConfig(output_dir=str(tmp_path / name), **kwargs), **common)
        else:
            args = config_class(infinity=nvme_stage3(tmp_path / "nvme"), output_dir=str(tmp_path / name), **kwargs)
            trainer = trainer_class(args=args, **common)
            assert trainer.ref_model in trainer.accelerator.reference_engines
        trainer.train()
        runs.append(logged(trainer, ("loss", "reward", "kl")))
        trained.append(weights(trainer))
    assert len(runs[1]) == len(runs[0]) == 3 and runs[0][-1][2] > 0, runs  # the policy moved away from its reference
    for got, want in zip(runs[1], runs[0], strict=True):
        assert got == pytest.approx(want, rel=REL, abs=1e-6), runs
    for name, value in trained[0].items():
        torch.testing.assert_close(trained[1][name], value, rtol=REL, atol=WEIGHTS_ATOL, msg=name)
    destroy(trainer)


def test_evaluate_before_train_on_a_model_partitioned_as_it_loaded(tmp_path):
    """The arguments made first (their stage-3 config partitions what loads after them), the model loaded from a
    folder, evaluate() before train(): no engine yet, and TRL's fused head gathers the partitioned head weight
    itself; the eval metrics equal the plain SFTTrainer's, and so do the losses of the training that follows."""
    tiny_gpt2(dropout=0.0).save_pretrained(tmp_path / "model")
    results = []
    for name in ("plain", "infinity"):
        if name == "plain":
            args = trl.SFTConfig(**arguments(tmp_path / name))
        else:
            args = InfinitySFTConfig(infinity=nvme_stage3(tmp_path / "nvme"), **arguments(tmp_path / name))
        model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "model")
        trainer_class = trl.SFTTrainer if name == "plain" else InfinitySFTTrainer
        trainer = trainer_class(model=model, args=args, train_dataset=sft_data(), eval_dataset=sft_data(),
                                processing_class=tokenizer())  # fmt: skip
        metrics = trainer.evaluate()
        trainer.train()
        results.append(([metrics["eval_loss"], metrics["eval_entropy"]], logged(trainer, SFT_METRICS)))
    (got_eval, got_logs), (want_eval, want_logs) = results[1], results[0]
    assert all(math.isfinite(v) for v in got_eval) and got_eval == pytest.approx(want_eval, rel=REL)
    for a, b in zip(got_logs, want_logs, strict=True):
        assert a == pytest.approx(b, rel=REL, abs=1e-6)
    destroy(trainer)


def test_every_trl_module_that_took_the_gather_helper_gets_the_engines():
    """TRL's distillation kernel imports maybe_gather_lm_head_ctx by name when it is first imported: installing
    after that import points it at the engine's gather too, as it does trl.trainer.utils."""
    import importlib

    from infinity.integrations import trl_patches

    kernel = importlib.import_module("trl.kernels.chunked_divergence")
    trl_patches.install()
    wrapper = trl.trainer.utils.maybe_gather_lm_head_ctx
    kernel.maybe_gather_lm_head_ctx = wrapper.__wrapped_original__  # as if imported before any install
    trl_patches.install()
    assert kernel.maybe_gather_lm_head_ctx is wrapper and trl.trainer.utils.maybe_gather_lm_head_ctx is wrapper
    assert getattr(wrapper, "__infinity__", False)
