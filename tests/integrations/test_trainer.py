"""InfinityTrainer against the plain Trainer: the same seeded tiny GPT-2, data and TrainingArguments (accumulation
2, max_grad_norm 1.0, fp32), only the two class names changed. Logged losses and gradient norms must agree within
1e-5 relative, and evaluate() too, at stage 2 and 3 (and stage 3 with the optimizer on NVMe), at world size 1 and
in one world-size-2 run (which also runs the InfinityAccelerator loop). A DeepSpeed JSON full of "auto" values
runs unchanged (given as deepspeed=); save_model loads back with from_pretrained; a run resumed from its step-4
checkpoint reproduces steps 5-8."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from infinity.errors import ConfigError  # noqa: E402
from infinity.integrations.accelerate import InfinityAccelerator  # noqa: E402
from infinity.integrations.hf_loading import is_zero3_active  # noqa: E402
from infinity.integrations.transformers import InfinityTrainer, InfinityTrainingArguments  # noqa: E402
from infinity.zero import GatheredParameters  # noqa: E402
from tests.distributed.harness import run_distributed  # noqa: E402
from tests.integrations.test_accelerator import (  # noqa: E402
    CountingData,
    accelerate_loop,
    assert_close,
    fresh_accelerate_state,
    stage_config,
    tiny_gpt2,
)

HERE = Path(__file__).resolve().parent


def training_arguments(output_dir, **overrides) -> dict:
    args = dict(output_dir=str(output_dir), per_device_train_batch_size=2, per_device_eval_batch_size=2,
                gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=1e-2, max_steps=4, logging_steps=1,
                report_to=[], seed=0, save_strategy="no", disable_tqdm=True, use_cpu=True)  # fmt: skip
    return {**args, **overrides}


@dataclasses.dataclass
class Run:
    steps: list[dict]  # the per-step logs of the (first) train()
    metrics: dict  # evaluate() after it
    trainer: Trainer | None
    eval_before: dict | None = None  # evaluate() before train()
    again: list[dict] | None = None  # the logs of a second train() on the same trainer


def logged_steps(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


def train(config: dict | str | None, output_dir, *, train_samples: int = 16, resume=None, pretrained=None,
          evaluate_first: bool = False, twice: bool = False, **overrides) -> Run:  # fmt: skip
    """One Trainer run; config None is the plain Trainer. ``pretrained``: a saved model's folder, loaded after the
    arguments (at stage 3, partitioned as it loads)."""
    kwargs = training_arguments(output_dir, **overrides)
    data = {"train_dataset": CountingData(train_samples), "eval_dataset": CountingData(8, seed=2)}
    if config is None:
        trainer = Trainer(model=tiny_gpt2(), args=TrainingArguments(**kwargs), **data)
    else:  # the two lines a user changes
        args = InfinityTrainingArguments(infinity=config, **kwargs)
        model = tiny_gpt2() if pretrained is None else GPT2LMHeadModel.from_pretrained(pretrained)
        trainer = InfinityTrainer(model=model, args=args, **data)
    eval_before = trainer.evaluate() if evaluate_first else None
    trainer.train(resume_from_checkpoint=resume)
    run = Run(logged_steps(trainer), trainer.evaluate(), trainer, eval_before=eval_before)
    if twice:  # the Trainer allows it: the model and optimizer state go on, with a new schedule
        trainer.train()
        run.again = logged_steps(trainer)
    return run


def assert_same_steps(steps: list[dict], plain_steps: list[dict], what: str) -> None:
    assert [s["step"] for s in steps] == [s["step"] for s in plain_steps], what
    assert_close([s["loss"] for s in steps], [s["loss"] for s in plain_steps], f"{what} loss")
    assert_close([s["grad_norm"] for s in steps], [s["grad_norm"] for s in plain_steps], f"{what} grad_norm")
    assert [s["learning_rate"] for s in steps] == [s["learning_rate"] for s in plain_steps], what


def assert_same_run(got: Run, want: Run, what: str) -> None:
    assert_same_steps(got.steps, want.steps, what)
    assert math.isclose(got.metrics["eval_loss"], want.metrics["eval_loss"], rel_tol=1e-5), (what, got.metrics)
    if got.eval_before is not None:
        assert math.isclose(got.eval_before["eval_loss"], want.eval_before["eval_loss"], rel_tol=1e-5), what
    if got.again is not None:
        assert_same_steps(got.again, want.again, f"{what}, second train()")


def test_trainer_matches_plain_trainer(tmp_path):
    """Also: evaluate() before train() (no engine yet: the bare model, or at stage 3 a model partitioned as it
    loaded, each module gathering its own parameters), then train(), then a second train()."""
    # The Trainer's evaluate() draws from the RNG, so a run that evaluates first has its own plain reference.
    plain = train(None, tmp_path / "plain")
    plain_evaluated_first = train(None, tmp_path / "plain_eval_first", evaluate_first=True, twice=True)
    tiny_gpt2().save_pretrained(tmp_path / "tiny")
    for name, config, extra in (
        ("stage 2", stage_config(2), {}),
        ("stage 3, optimizer on nvme", stage_config(3, nvme_path=tmp_path / "swap"), {}),
        ("stage 3", stage_config(3), {"evaluate_first": True, "twice": True}),
        ("stage 3, loaded partitioned", stage_config(3), {"evaluate_first": True, "pretrained": tmp_path / "tiny"}),
    ):
        run = train(config, tmp_path / name.replace(" ", "_").replace(",", ""), **extra)
        assert_same_run(run, plain_evaluated_first if extra else plain, name)
        run.trainer.engine.destroy()


def test_deepspeed_auto_config_saves_and_resumes(tmp_path):
    """Transformers' docs' ZeRO-3 JSON ("auto" everywhere, its own AdamW and WarmupDecayLR, offload to the CPU),
    passed as deepspeed=: filled from the arguments and the model; save_model loads with from_pretrained; a
    resume from checkpoint-4 logs the same steps 5-8."""
    config = str(HERE / "ds_config_zero3_auto.json")
    args = training_arguments(tmp_path / "run", max_steps=8, save_strategy="steps", save_steps=4, deepspeed=config)
    trainer = InfinityTrainer(model=tiny_gpt2(), args=InfinityTrainingArguments(**args),
                              train_dataset=CountingData(32))  # fmt: skip
    assert trainer.args.deepspeed is None and trainer.args.infinity == config
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    engine = trainer.engine
    filled = engine.config
    assert (filled.train_micro_batch_size_per_gpu, filled.gradient_accumulation_steps) == (2, 2)
    assert filled.gradient_clipping == 1.0 and filled.zero.reduce_bucket_size == 32 * 32
    assert filled.zero.stage3_param_persistence_threshold == 10 * 32
    assert [s["learning_rate"] for s in steps][-1] < max(s["learning_rate"] for s in steps)  # warmup, then decay
    assert all(math.isfinite(s["loss"]) for s in steps) and len(steps) == 8

    trainer.save_model(tmp_path / "saved")
    state = trainer.accelerator.get_state_dict(engine)
    # The arguments' stage-3 config is alive, so from_pretrained partitions the model as it loads (as with
    # DeepSpeed's HfDeepSpeedConfig): gathered, it holds the saved weights.
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    assert is_zero3_active() and all(p.numel() == 0 for p in loaded.parameters())
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["n_embd"] == 32
    with GatheredParameters(list(loaded.parameters())):
        for key, value in loaded.state_dict().items():
            assert torch.equal(value, state[key]), key
    engine.destroy()

    resumed = InfinityTrainer(model=tiny_gpt2(), args=InfinityTrainingArguments(**args), train_dataset=CountingData(32))
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    # The history before step 5 comes back from the checkpoint's trainer_state.json.
    again = [h for h in resumed.state.log_history if "loss" in h and h["step"] > 4]
    assert [s["step"] for s in again] == [5, 6, 7, 8]
    assert_close([s["loss"] for s in again], [s["loss"] for s in steps[4:]], "resumed loss")
    assert [s["learning_rate"] for s in again] == [s["learning_rate"] for s in steps[4:]]
    resumed.engine.destroy()


def test_training_arguments_refuse_contradictions(tmp_path):
    config = {**stage_config(2), "gradient_clipping": 0.5}
    with pytest.raises(ConfigError, match=r"gradient_clipping=0.5 vs TrainingArguments max_grad_norm=1.0"):
        InfinityTrainingArguments(infinity=config, **training_arguments(tmp_path))
    with pytest.raises(ConfigError, match="give the config once"):
        InfinityTrainingArguments(infinity=stage_config(2), deepspeed=stage_config(3), **training_arguments(tmp_path))
    with pytest.raises(ConfigError, match="needs InfinityTrainingArguments"):
        InfinityTrainer(model=tiny_gpt2(), args=TrainingArguments(**training_arguments(tmp_path)))


def test_clipping_and_precision_as_with_deepspeed(tmp_path, caplog):
    """A JSON without gradient_clipping under the default max_grad_norm 1.0 runs as with DeepSpeed: the engine does
    not clip (one warning says so), as the plain Trainer with max_grad_norm 0 (and the JSON's warmup logs the
    learning rates the plain Trainer's warmup logs). fp16/bf16 from the arguments or the
    accelerator adds the missing section, as Accelerate's DeepSpeed plugin does; enabling the other type is refused."""
    config = stage_config(2)
    del config["gradient_clipping"]
    # The JSON's scheduler, which the engine steps inside backward(): the logged learning rate is still the one
    # each step used, as the plain Trainer logs its own linear warmup.
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "warmup_type": "linear"}}
    schedule = {"max_steps": 3, "warmup_steps": 4, "lr_scheduler_type": "constant_with_warmup"}
    with caplog.at_level("WARNING", logger="infinity"):
        run = train(config, tmp_path / "unclipped", twice=True, **schedule)  # the second: a fresh schedule
    assert sum("the engine clips with the config's value" in r.getMessage() for r in caplog.records) == 1
    run.trainer.engine.destroy()
    plain = train(None, tmp_path / "plain", max_grad_norm=0.0, twice=True, **schedule)
    assert [s["learning_rate"] for s in plain.steps] == [0.0, 0.0025, 0.005]
    assert_same_run(run, plain, "no gradient_clipping, the JSON's scheduler")

    # WarmupCosineLR takes ratios of the optimizer's lr: a second train() starts again from the full rate.
    cosine = {**stage_config(2), "scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": "auto", "warmup_num_steps": "auto", "warmup_type": "linear", "cos_min_ratio": 0.0001}}}
    run = train(cosine, tmp_path / "cosine", twice=True, max_steps=3, warmup_steps=1)
    assert [s["learning_rate"] for s in run.again] == [s["learning_rate"] for s in run.steps]
    run.trainer.engine.destroy()

    args = InfinityTrainingArguments(infinity=stage_config(2), **training_arguments(tmp_path, bf16=True))
    assert args.infinity_config["bf16"] == {"enabled": True} and "fp16" not in args.infinity_config
    with pytest.raises(ConfigError, match='mixed precision bf16 was asked for .* the config enables "fp16"'):
        InfinityTrainingArguments(infinity={**stage_config(2), "fp16": {"enabled": True}},
                                  **training_arguments(tmp_path, bf16=True))  # fmt: skip
    fresh_accelerate_state()
    accelerator = InfinityAccelerator(infinity=stage_config(2), mixed_precision="bf16", cpu=True)
    assert accelerator.infinity_config["bf16"] == {"enabled": True}


def test_partitioned_model_saves_before_training_and_keeps_the_best(tmp_path):
    """Stage 3 without stage3_gather_16bit_weights_on_model_save: save_model before train() writes the whole model
    (gathered module by module from its load-time partitions); the checkpoints hold config.json beside the
    engine's checkpoint, and load_best_model_at_end finds the best one even when it is the newest."""
    tiny_gpt2().save_pretrained(tmp_path / "tiny")
    want = tiny_gpt2().state_dict()
    args = InfinityTrainingArguments(infinity=stage_config(3), **training_arguments(
        tmp_path / "run", max_steps=2, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
        load_best_model_at_end=True, metric_for_best_model="eval_loss"))  # fmt: skip
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "tiny")
    trainer = InfinityTrainer(model=model, args=args, train_dataset=CountingData(8),
                              eval_dataset=CountingData(8, seed=2))  # fmt: skip
    trainer.save_model(tmp_path / "before")
    saved = safetensors.torch.load_file(tmp_path / "before" / "model.safetensors")
    assert len(saved) > 0 and all(torch.equal(value, want[key]) for key, value in saved.items())
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    best_step = min(evals, key=lambda h: h["eval_loss"])["step"]
    assert best_step == 2  # the newest: its folder did not exist yet when the Trainer looked for it
    assert trainer.state.best_model_checkpoint == str(tmp_path / "run" / f"checkpoint-{best_step}")
    assert (tmp_path / "run" / "checkpoint-2" / "config.json").is_file()
    assert not (tmp_path / "run" / "checkpoint-2" / "model.safetensors").exists()
    trainer.engine.destroy()


def _world_size_2(*, rank: int, world_size: int, tmp: str) -> dict:
    # Accelerate's CPU multi-process state reads the launcher's variables; the harness already joined the gloo
    # group (Accelerate keeps it) and runs both processes on this node.
    os.environ.update({"LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1"})
    out = {}
    for name, config in (("plain", None), ("stage 2", stage_config(2)), ("stage 3", stage_config(3))):
        run = train(config, os.path.join(tmp, name.replace(" ", "_")))
        out[name] = Run(run.steps, run.metrics, None)
        if config is not None:
            run.trainer.engine.destroy()
    for name, config in (("accelerate plain", None), ("accelerate stage 3", stage_config(3))):
        losses, norms, _, model = accelerate_loop(config)
        out[name] = (losses, norms)
        if config is not None:
            model.destroy()
    return out


def test_world_size_2(tmp_path):
    results = run_distributed(_world_size_2, 2, tmp_path, timeout_s=240, tmp=str(tmp_path))
    for rank, out in enumerate(results):
        for name in ("stage 2", "stage 3"):
            assert_same_run(out[name], out["plain"], f"rank {rank} {name}")
        assert_close(out["accelerate stage 3"][0], out["accelerate plain"][0], f"rank {rank} accelerate losses")
        assert_close(out["accelerate stage 3"][1], out["accelerate plain"][1], f"rank {rank} accelerate norms")
    # The accelerate loop's losses are each rank's own: different shares, so the data really was split.
    assert results[0]["accelerate plain"][0][0] != results[1]["accelerate plain"][0][0]
