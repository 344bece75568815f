"""Transformers' Trainer on the infinity engine: two class names change in the user's script.

    args = InfinityTrainingArguments(output_dir="out", infinity="ds_config.json", ...)   # was TrainingArguments
    trainer = InfinityTrainer(model=model, args=args, train_dataset=...)                  # was Trainer

Trainer's DeepSpeed branches need the real deepspeed package (its distribution metadata and version), so they must
never run: InfinityTrainingArguments takes the config as ``infinity=`` (``deepspeed=`` is accepted and moved
there) and fills its "auto" values from the arguments, as Transformers does for DeepSpeed (hf_config.py);
InfinityTrainer runs Trainer's ordinary, non-DeepSpeed path with an InfinityAccelerator in place of Accelerate's,
which turns prepare(model, optimizer) into the engine. The Trainer then divides the loss by the accumulation steps
itself (the engine does not divide again), marks each micro-batch's ``sync_gradients`` (the engine's window
follows it) and runs non-final micro-batches under ``no_sync`` (nothing to switch off: the engine reduces as its
window requires). The Trainer's own scheduler is built on the engine's param groups and stepped once per optimizer
step; a scheduler from the JSON is stepped by the engine. evaluate() and predict() call the bare model: after
train() at stage 3 its modules carry the engine's hooks, which gather each unit as it runs; before train() no
engine is built (the model runs as it is, or, partitioned at load time, each module gathers its own parameters:
accelerate.EvaluationGathering). A second train() goes on with the same engine, as the Trainer goes on with the
same model and optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import sys
import weakref
from typing import Any

import torch
from accelerate.utils.deepspeed import DummyOptim  # a plain class: no deepspeed import
from torch import nn
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments
from transformers.trainer import SAFE_WEIGHTS_NAME, SCHEDULER_NAME, TRAINING_ARGS_NAME

from infinity.config import load_json
from infinity.errors import CheckpointError, ConfigError
from infinity.integrations.accelerate import InfinityAccelerator, InfinityScheduler, apply_mixed_precision
from infinity.integrations.hf_config import fill_from_model, fill_from_training_args
from infinity.integrations.hf_loading import HfInfinityConfig
from infinity.lr_schedules import build_schedule

logger = logging.getLogger("infinity")


@dataclasses.dataclass
class InfinityTrainingArguments(TrainingArguments):
    """TrainingArguments with ``infinity=`` (a DeepSpeed-style config: a dict or a JSON path). ``deepspeed=`` is
    taken as ``infinity=`` so that Transformers' DeepSpeed code never runs. After construction:
    ``infinity_config`` is the config with the arguments' "auto" values filled (phase 1; the model's and the
    schedule's are filled when training starts), and ``hf_infinity_config`` keeps it where from_pretrained looks
    for it (stage 3 partitions the model at load time), as TrainingArguments keeps ``hf_deepspeed_config``."""

    infinity: dict | str | None = dataclasses.field(
        default=None,
        metadata={"help": "The infinity (DeepSpeed-style) config: a JSON file's path or a dict; 'auto' allowed."},
    )

    def __post_init__(self) -> None:
        if self.deepspeed is not None:
            if self.infinity is not None and self.infinity != self.deepspeed:
                raise ConfigError(
                    f"InfinityTrainingArguments got infinity={self.infinity!r} and deepspeed={self.deepspeed!r}: "
                    "give the config once (either name)"
                )
            self.infinity, self.deepspeed = self.deepspeed, None
        if self.infinity is None:
            raise ConfigError(
                "InfinityTrainingArguments needs infinity=<a DeepSpeed-style config: a JSON file's path or a dict>"
            )
        if isinstance(self.infinity, os.PathLike):
            self.infinity = os.fspath(self.infinity)
        super().__post_init__()
        precision = "bf16" if self.bf16 else "fp16" if self.fp16 else "no"
        config = apply_mixed_precision(load_json(self.infinity), precision)  # as Accelerate's DeepSpeed plugin
        self.infinity_config = fill_from_training_args(config, self, world_size=self.world_size)
        # The engine owns precision (the config's fp16/bf16, filled from fp16/bf16 above) and loss scaling:
        # Accelerate must set up neither autocast nor a GradScaler.
        self.mixed_precision = "no"
        self.hf_infinity_config = HfInfinityConfig(self.infinity_config)

    @property
    def place_model_on_device(self) -> bool:
        """The engine places the model (at stage 3, one unit at a time): the Trainer must not move it whole."""
        return False


def _is_partitioned(param: nn.Parameter) -> bool:
    from infinity.zero.init import init_shard

    return init_shard(param) is not None


def gathered_state_dict(model: nn.Module, *, keep: bool) -> dict[str, torch.Tensor]:
    """Collective: the state dict of a model partitioned at load time (no engine yet), its modules' parameters
    gathered one module at a time; copies on the CPU where ``keep`` (the rank that writes), else {}."""
    from infinity.zero import GatheredParameters

    values: dict[int, torch.Tensor] = {}
    for module in model.modules():
        params = [p for p in module.parameters(recurse=False) if id(p) not in values]
        with GatheredParameters(params):
            for param in params:
                values[id(param)] = param.detach().to("cpu", copy=True) if keep else param.new_empty(0)
    if not keep:
        return {}
    return {key: values[id(value)] if id(value) in values else value.detach().to("cpu", copy=True)
            for key, value in model.state_dict(keep_vars=True).items()}  # fmt: skip


def is_peft_model(model: nn.Module) -> bool:
    """A PEFT model (LoRA and the like): it saves its adapters with save_pretrained(state_dict=...)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def trained_state_dict(engine, *, keep: bool) -> dict[str, torch.Tensor]:
    """Collective: the parameters the optimizer updates (a PEFT model's adapters) from their fp32 masters, what the
    optimizer trained (a bf16 run's compute weights are rounded copies; the plain Trainer saves fp32 adapters),
    and the input and output embeddings (PEFT saves them too where the vocabulary was resized or they are
    targeted: it picks from what it is given), whole, as CPU copies where ``keep`` (the rank that writes), else
    {}; at stage 3 only the units of untrained embeddings are gathered (the rest of the frozen base never)."""
    from infinity.partitioned_state import state_of
    from infinity.zero import GatheredParameters

    model = engine.module
    names = {id(p): n for n, p in model.named_parameters()}
    trained = [p for group in engine.zero_optimizer.groups for p in group if id(p) in names]
    values = {}
    for param in trained:
        master = state_of(param).get(param, None, local=False)  # collective
        if keep:
            values[names[id(param)]] = master.to("cpu")
    base = getattr(model, "get_base_model", lambda: model)()
    embeddings = []
    for get in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(base, get, lambda: None)()
        if module is not None:
            embeddings += [p for p in module.parameters() if id(p) in names]
    seen = {id(p) for p in trained}
    embeddings = [p for p in {id(p): p for p in embeddings}.values() if id(p) not in seen]
    with GatheredParameters(embeddings):
        if keep:
            values.update({names[id(p)]: p.detach().to("cpu", copy=True) for p in embeddings})
    return values if keep else {}


class InfinityTrainer(Trainer):
    """A Trainer whose model trains on the infinity engine (``args`` must be InfinityTrainingArguments).

    Overrides, and why:
    - create_accelerator_and_postprocess: an InfinityAccelerator in place of Accelerate's; the Trainer divides the
      loss itself (``scale_wrt_gas`` off) and the model's and schedule's "auto" values are filled just before
      the engine is built.
    - create_optimizer: with an "optimizer" section the engine builds it (a DummyOptim stands in, as with
      DeepSpeed); without one, the Trainer's optimizer is handed to the engine.
    - create_scheduler: the JSON's scheduler, stepped by the engine, behind a wrapper; else Trainer's own.
    - _clip_grad_norm: as the Trainer does under DeepSpeed, no clipping of its own: the engine clipped in its step
      to the config's gradient_clipping (none when the config has no such key, whatever max_grad_norm says: a
      warning says so once); the norm it measured is logged.
    - save_model: the weights gathered in 16 bits into model.safetensors with config.json (from_pretrained loads
      the folder); at stage 3 without stage3_gather_16bit_weights_on_model_save, config.json and the engine's
      checkpoint instead (as Transformers' DeepSpeed branch). Before train(), a model partitioned at load time is
      gathered module by module and saved whole by the writing rank.
    - _save_optimizer_and_scheduler / _load_optimizer_and_scheduler: the engine's sharded checkpoint (never rank
      0's optimizer.pt); the Trainer's own scheduler still goes to scheduler.pt.
    - _load_from_checkpoint: nothing before prepare; the engine's checkpoint brings the weights with the rest.
    - _load_best_model: the weights from the best checkpoint's engine checkpoint.
    """

    def create_accelerator_and_postprocess(self) -> None:
        if not isinstance(self.args, InfinityTrainingArguments):
            raise ConfigError(
                f"InfinityTrainer needs InfinityTrainingArguments (with infinity=...), got {type(self.args).__name__}"
            )
        if "trl" in sys.modules:  # a TRL trainer on the engine, however its class was made: TRL's gathers work
            from infinity.integrations import trl_patches  # ([Note: TRL's fused head])

            trl_patches.install()
        super().create_accelerator_and_postprocess()  # builds Accelerate's, with the Trainer's arguments
        kwargs = dict(self._accelerator_kwargs)
        kwargs.pop("deepspeed_plugin", None)
        self.accelerator = InfinityAccelerator(infinity=self.args.infinity_config, **kwargs)
        self.accelerator.scale_wrt_gas = False  # training_step divided the loss by the accumulation steps
        self.accelerator.finalize_config = self._finalize_config
        trainer = weakref.ref(self)
        self.accelerator.is_trained_model = lambda model: model is getattr(trainer(), "model", None)
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(
                self.gather_function, use_gather_object=self.args.eval_use_gather_object
            )

    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        self._accelerator_kwargs = dict(args)
        return args

    def _finalize_config(self, config: dict, model: nn.Module) -> dict:
        """Phase 2 of "auto": the hidden size from the model's config and the schedule's step counts."""
        model_config = getattr(self.accelerator.unwrap_model(model), "config", None)
        max_steps = getattr(getattr(self, "state", None), "max_steps", 0) or 0
        return fill_from_model(config, self.args, model_config=model_config, num_training_steps=max_steps)

    @property
    def engine(self):
        """The infinity engine, once train() has built it; else None."""
        return self.accelerator.engine

    def create_optimizer(self, model: nn.Module | None = None):
        if "optimizer" not in self.args.infinity_config:
            return super().create_optimizer(model)
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            self.optimizer = DummyOptim(params=[p for p in opt_model.parameters() if p.requires_grad])
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        engine = self.engine
        if self.lr_scheduler is None and engine is not None and engine.lr_scheduler is not None:
            if getattr(self, "_json_schedule_used", False):  # a later train(): a fresh schedule, as the plain
                engine.lr_scheduler = self._fresh_json_schedule(num_training_steps)  # Trainer builds one
            self._json_schedule_used = True
            self.lr_scheduler = InfinityScheduler(engine.lr_scheduler, self.optimizer)
            self._created_lr_scheduler = True
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    def _fresh_json_schedule(self, num_training_steps: int):
        """The JSON's scheduler built again from step 0 on the engine's optimizer, its step counts filled for
        this train() call (the engine's own schedule has run its course with the previous call)."""
        engine = self.engine
        model_config = getattr(engine.module, "config", None)
        filled = fill_from_model(self.args.infinity_config, self.args, model_config=model_config,
                                 num_training_steps=num_training_steps)  # fmt: skip
        schedule = dataclasses.replace(engine.config.scheduler, params=dict(filled["scheduler"].get("params") or {}))
        optimizer = engine.zero_optimizer.optimizer
        # A schedule of ratios (WarmupCosineLR) takes its base from the groups' lr, which the last one decayed.
        for group, base in zip(optimizer.param_groups, getattr(engine.lr_scheduler, "base_lrs", ()), strict=False):
            group["lr"] = base
        return build_schedule(schedule, optimizer)

    def _clip_grad_norm(self, model):
        clipping = float(self.engine.config.gradient_clipping or 0.0)
        if clipping != float(self.args.max_grad_norm) and not getattr(self, "_clipping_warned", False):
            self._clipping_warned = True
            logger.warning(
                "max_grad_norm is %s but the config's gradient_clipping is %s: the engine clips with the config's "
                "value, as DeepSpeed does (set gradient_clipping to \"auto\" to take max_grad_norm)",
                self.args.max_grad_norm, clipping or "absent",
            )  # fmt: skip
        return self.accelerator.clip_grad_norm_(model.parameters(), float("inf"))

    # ---- saving ----
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        engine = self.engine
        output_dir = self.args.output_dir if output_dir is None else os.fspath(output_dir)
        if engine is None:
            if any(_is_partitioned(p) for p in self.model.parameters()):
                state = gathered_state_dict(self.model, keep=self.args.should_save)  # collective
                if self.args.should_save:
                    self._save(output_dir, state_dict=state)
            else:
                super().save_model(output_dir, _internal_call)
            return
        model = self.accelerator.unwrap_model(self.model)
        if is_peft_model(model):  # the adapters only, in PEFT's format (as the Trainer saves a PEFT model)
            state = trained_state_dict(engine, keep=self.args.should_save)
            if self.args.should_save:
                model.save_pretrained(output_dir, state_dict=state)
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(output_dir)
                torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        elif engine.save_16bit_model(output_dir, SAFE_WEIGHTS_NAME):
            if self.args.should_save:
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(output_dir)
                torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        else:
            logger.warning(
                "save_model: stage3_gather_16bit_weights_on_model_save is false, so %s gets the model's config and "
                "the engine's checkpoint instead of model.safetensors (`infinity ckpt to-fp32` makes safetensors "
                "from it)", output_dir
            )  # fmt: skip
            if self.args.should_save:  # the folder exists now: the Trainer looks for the best checkpoint's next
                self._save_model_files(output_dir)
            if not (_internal_call and not self.args.save_only_model):  # _save_checkpoint saves it next anyway
                engine.save_checkpoint(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_model_files(self, output_dir: str) -> None:
        """What from_pretrained needs beside the weights (the model's config, its generation config), the
        processing class and the arguments, as the Trainer's DeepSpeed branch leaves them."""
        os.makedirs(output_dir, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model)
        for name in ("config", "generation_config"):
            part = getattr(model, name, None)
            if part is not None and hasattr(part, "save_pretrained"):
                part.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # A PEFT model's frozen base is not training state: its checkpoints hold the adapters (the resumed run
        # builds the base from where it came from, as this one did)
        peft = is_peft_model(self.accelerator.unwrap_model(self.model))
        self.engine.save_checkpoint(output_dir, exclude_frozen_parameters=peft)
        if self.args.should_save and not isinstance(self.lr_scheduler, InfinityScheduler):
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # ---- resuming ----
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if not os.path.isfile(os.path.join(resume_from_checkpoint, "latest")):
            raise CheckpointError(
                f"{resume_from_checkpoint!r} holds no infinity engine checkpoint (no 'latest' file): resume from a "
                "checkpoint-<step> folder that InfinityTrainer saved"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path, _ = self.engine.load_checkpoint(checkpoint)
        if path is None:
            raise CheckpointError(f"{checkpoint!r} holds no infinity engine checkpoint (no 'latest' file)")
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if not isinstance(self.lr_scheduler, InfinityScheduler) and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        logger.info("loading the best model from %s (score %s)", best, self.state.best_metric)
        path, _ = self.engine.load_checkpoint(best, load_optimizer_states=False, load_lr_scheduler_states=False,
                                              load_module_only=True)  # fmt: skip
        if path is None:
            raise CheckpointError(f"the best checkpoint {best!r} holds no infinity engine checkpoint")


@dataclasses.dataclass
class InfinitySeq2SeqTrainingArguments(InfinityTrainingArguments, Seq2SeqTrainingArguments):
    """Seq2SeqTrainingArguments (predict_with_generate, generation_max_length, ...) with ``infinity=``."""


class InfinitySeq2SeqTrainer(InfinityTrainer, Seq2SeqTrainer):
    """Seq2SeqTrainer on the infinity engine: evaluate() and predict() generate with the engine's model, in the
    config's dtype. At stage 3 with world size > 1 generate() keeps every rank in step (synced_gpus), which the
    Seq2SeqTrainer turns on by itself only for DeepSpeed and FSDP ([Note: synced generation] in
    infinity/generation.py)."""

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        engine = self.engine
        if engine is not None and engine.stage3 is not None and engine.world_size > 1:
            if not gen_kwargs and hasattr(self, "_gen_kwargs"):  # evaluate()'s and predict()'s, as the parent reads
                gen_kwargs = self._gen_kwargs.copy()  # them only when it is given none
            gen_kwargs.setdefault("synced_gpus", True)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)
