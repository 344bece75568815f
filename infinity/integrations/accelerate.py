"""InfinityAccelerator: Accelerate's training loop API over the infinity engine, for users with their own loop.

    accelerator = InfinityAccelerator(infinity="ds_config.json", gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)      # the engine's backward and, at the boundary, its step
            optimizer.step()                # no-op: the engine stepped
            scheduler.step()
            optimizer.zero_grad()           # no-op

Accelerate cannot host a third-party engine: its DistributedType is a closed enum and its DEEPSPEED branches import
the real deepspeed package. So this subclass keeps the process state's own type (NO, MULTI_CPU, MULTI_GPU: launch
with `accelerate launch --multi_gpu`, a CPU multi-process config, or torchrun) and overrides the methods whose
DeepSpeed branches it reproduces, with DeepSpeed's semantics as Accelerate applies them:

- prepare: the model and optimizer go into ``infinity.initialize``; DataLoaders are sharded as Accelerate shards
  them. The optimizer returned is a wrapper whose step() and zero_grad() do nothing (the engine steps at the
  accumulation boundary, inside backward()); a scheduler from the JSON is stepped by the engine and returned
  behind a wrapper whose step() does nothing; the user's own scheduler is wrapped by Accelerate as usual (it steps
  only when gradients were synchronized and the step was not skipped).
- backward: engine.backward then engine.step on every micro-batch. The loss is divided by the accumulation steps
  inside the engine (not here), and Accelerate's ``sync_gradients`` says where a window ends.
- clip_grad_norm_: the engine clips in its step with the config's gradient_clipping; this returns the norm it
  measured. A different max_norm is an error (the step has run: it cannot clip again), stricter than Accelerate's
  DeepSpeed branch, which ignores max_norm; InfinityTrainer reads the norm without asking for a max_norm.
- no_sync: nothing to do (the engine reduces at the boundary it knows).
- unwrap_model, get_state_dict (gathered at stage 3), save_state / load_state through the engine's checkpoints.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.checkpointing import load_accelerator_state, save_accelerator_state
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler  # plain classes: no deepspeed import
from torch import nn

from infinity.config import AUTO, load_json
from infinity.engine import check_model_free
from infinity.errors import ConfigError
from infinity.integrations.accelerate_config import from_environment

logger = logging.getLogger("infinity")

CHECKPOINT_TAG = "pytorch_model"  # the folder Accelerate's DeepSpeed branch gives the engine's checkpoint


class InfinityOptimizer(AcceleratedOptimizer):
    """The engine's torch optimizer as the training loop sees it: its param groups (a scheduler may set their
    learning rates), with step() and zero_grad() left to the engine, as Accelerate's DeepSpeed wrapper does."""

    def __init__(self, optimizer: torch.optim.Optimizer, accelerator: InfinityAccelerator) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self._accelerator = accelerator

    def zero_grad(self, set_to_none=None) -> None:
        pass  # the engine's step frees the gradients

    def step(self, closure=None) -> None:
        # accelerator.backward() ran the engine's step at the boundary. Marked as called, so that a torch scheduler
        # built on the inner optimizer does not warn that it stepped before its optimizer.
        self.optimizer._opt_called = True

    @property
    def step_was_skipped(self) -> bool:
        """The engine skipped its last step (fp16 overflow): schedulers must not advance."""
        return self._accelerator.last_step_skipped


class InfinityScheduler(AcceleratedScheduler):
    """The JSON's scheduler, which the engine steps after each optimizer step it takes (inside backward()).

    Between that step and this wrapper's step() (a no-op), get_last_lr() gives the learning rates the step used,
    as a plain loop sees them there (the Trainer logs them at that point); after it, the scheduler's own."""

    def step(self, *args, **kwargs) -> None:
        accelerator = self._accelerator()
        if accelerator is not None:
            accelerator.step_lrs = None

    def get_last_lr(self) -> list[float]:
        used = getattr(self._accelerator(), "step_lrs", None)
        return list(used) if used is not None else self.scheduler.get_last_lr()

    def _accelerator(self) -> InfinityAccelerator | None:
        return next((o._accelerator for o in self.optimizers if isinstance(o, InfinityOptimizer)), None)


def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """Collective: the engine's model as a state dict on the CPU (every name of a tied weight included). Below
    stage 3 every rank has it whole; at stage 3 each unit is gathered in turn and rank 0 keeps the copies."""
    from infinity.checkpoint.state_map import parameter_names

    module = engine.module
    names, _ = parameter_names(module)
    if engine.stage3 is None:
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
    keep = engine.comm.rank == 0
    values: dict[str, torch.Tensor] = {}
    for unit in engine.stage3.table.units:
        gathered = engine.stage3.gather(unit.params)
        if keep:
            for param in unit.params:
                values[names[id(param)]] = param.detach().to("cpu", copy=True)
        engine.stage3.partition(gathered, modifier_rank=None)
    if not keep:
        return {}
    params = dict(module.named_parameters(remove_duplicate=False))
    state = {}
    for key, value in module.state_dict().items():
        state[key] = values[names[id(params[key])]] if key in params else value.detach().to("cpu", copy=True)
    return state


class EvaluationGathering:
    """Evaluation before any engine exists, for a model partitioned at load time by zero.Init (from_pretrained
    under a stage-3 HfInfinityConfig): each module gathers its own (direct) parameters in a forward pre-hook
    and partitions them again in its forward hook, so at most one module's weights are whole at a time.

    Limits: GatheredParameters is collective, so every rank must run the same modules (as evaluation does); a
    parameter read outside the forward of a module that owns it is not gathered (a tied weight is fine when the
    module using it owns it too, as GPT-2's lm_head owns the embedding's weight). No engine is built, so the
    config's training-only values ("auto" step counts) are filled later, by train()."""

    def __init__(self, model: nn.Module) -> None:
        from infinity.zero import GatheredParameters

        self._gathered: dict[int, list[GatheredParameters]] = {}
        self._handles = []
        for module in model.modules():
            params = [p for p in module.parameters(recurse=False) if _is_partitioned(p)]
            if params:
                self._handles.append(module.register_forward_pre_hook(functools.partial(self._gather, params)))
                self._handles.append(module.register_forward_hook(self._release, always_call=True))

    def _gather(self, params: list[nn.Parameter], module: nn.Module, args) -> None:
        from infinity.zero import GatheredParameters

        context = GatheredParameters(params)
        context.__enter__()
        self._gathered.setdefault(id(module), []).append(context)

    def _release(self, module: nn.Module, args, output) -> None:
        stack = self._gathered.get(id(module))
        if stack:
            stack.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _is_partitioned(param: nn.Parameter) -> bool:
    from infinity.zero.init import init_shard

    return init_shard(param) is not None


def _optimizer_of(engine) -> torch.optim.Optimizer:
    return engine.zero_optimizer.optimizer


def apply_mixed_precision(config: Mapping[str, Any], mixed_precision: str | None) -> dict:
    """Accelerate's rule for a DeepSpeed config (its DeepSpeed plugin's set_mixed_precision), so that fp16/bf16
    asked for outside the JSON is not dropped: a config without a section for the asked type gets
    {"enabled": true}; a config that enables the other type is an error."""
    config = dict(config)
    if mixed_precision not in ("fp16", "bf16"):
        return config
    other = "bf16" if mixed_precision == "fp16" else "fp16"
    section = config.get(other)
    if isinstance(section, Mapping) and str(section.get("enabled", False)).lower() == "true":
        raise ConfigError(
            f'mixed precision {mixed_precision} was asked for (mixed_precision / TrainingArguments.{mixed_precision}) '
            f'but the config enables "{other}": drop one of the two, or set {other}.enabled to "auto"'
        )
    if mixed_precision not in config:
        config[mixed_precision] = {"enabled": True}
    return config


def _wraps(wrapper: Any, obj: Any) -> bool:
    """obj is the wrapper, or the optimizer or scheduler inside it."""
    return any(obj is x for x in (wrapper, getattr(wrapper, "optimizer", None), getattr(wrapper, "scheduler", None)))


def _is_loader(obj: Any) -> bool:
    return isinstance(obj, torch.utils.data.DataLoader)


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler | DummyScheduler)


class InfinityAccelerator(Accelerator):
    """An Accelerator whose model, optimizer and scheduler run on the infinity engine. ``infinity`` is the
    DeepSpeed-style config (a dict or a JSON path; "auto" values allowed); without it, the settings `accelerate
    launch` exported for DeepSpeed (ACCELERATE_DEEPSPEED_*) are used. Other arguments are Accelerator's;
    mixed_precision fp16/bf16 adds the config's section when it has none (apply_mixed_precision)."""

    def __init__(self, *args, infinity: str | os.PathLike | Mapping[str, Any] | None = None, **kwargs) -> None:
        if kwargs.get("deepspeed_plugin") is not None or kwargs.get("deepspeed_plugins") is not None:
            raise ConfigError(
                "InfinityAccelerator does not take deepspeed_plugin: pass the DeepSpeed config as infinity=<dict or "
                "JSON path> instead"
            )
        super().__init__(*args, **kwargs)
        if infinity is None:
            infinity = from_environment()
        if infinity is None:
            raise ConfigError(
                "InfinityAccelerator needs infinity=<a DeepSpeed-style config dict or JSON path> (or the "
                "ACCELERATE_DEEPSPEED_* variables that `accelerate launch` exports)"
            )
        self.infinity_config: dict[str, Any] = apply_mixed_precision(load_json(infinity), self.mixed_precision)
        # The engine owns precision (its config's fp16/bf16) and loss scaling: no second scaler, no autocast.
        self.scaler = None
        self.native_amp = False
        self.engine = None
        self.last_step_skipped = False
        self.step_lrs: list[float] | None = None  # the last step's learning rates, until the scheduler's step()
        self._evaluation_gathering: EvaluationGathering | None = None
        self._engine_wrappers: list = []  # what prepare() built beside the engine; kept through free_memory()
        # The Trainer divides the loss by the accumulation steps itself and sets sync_gradients per micro-batch
        # (it sets this False); a user loop leaves the division to the engine, as DeepSpeed does.
        self.scale_wrt_gas = True
        # Called with (config, model) just before initialize(): the Trainer's second "auto" phase.
        self.finalize_config: Callable[[dict, nn.Module], dict] | None = None
        # Set by a Trainer: whether a model is the one it trains (any other prepared for evaluation is a reference).
        self.is_trained_model: Callable[[nn.Module], bool] | None = None
        self.reference_engines: list = []  # prepare_reference_model's engines

    # ---- prepare ----
    def prepare(self, *args, device_placement=None):
        own = [obj for obj in args if not _is_loader(obj)]
        if self.engine is not None and own and all(self._is_own(obj) for obj in own):
            # A second trainer.train() hands back what the first one prepared, as a plain Accelerator re-prepares.
            return self._prepare_again(args, device_placement)
        models = [obj for obj in args if isinstance(obj, nn.Module)]
        if not models:
            if any(isinstance(obj, torch.optim.Optimizer | DummyOptim) for obj in args):
                raise ConfigError(
                    "InfinityAccelerator.prepare: pass the optimizer in the same call as its model (the engine is "
                    "built from both)"
                )
            return super().prepare(*args, device_placement=device_placement)
        if len(models) > 1:
            raise ConfigError("InfinityAccelerator.prepare takes one model per accelerator (one engine)")
        if self.engine is not None:
            raise ConfigError(
                "InfinityAccelerator.prepare was already given a model; its engine exists. Use a new accelerator "
                "for another model"
            )
        check_model_free(models[0])  # before the "auto" checks: the more useful message
        self._end_evaluation_gathering()
        result = [self.prepare_data_loader(obj) if _is_loader(obj) else obj for obj in args]
        optimizer = next((obj for obj in args if isinstance(obj, torch.optim.Optimizer | DummyOptim)), None)
        scheduler = next((obj for obj in args if _is_scheduler(obj)), None)
        loaders = [obj for obj in args if _is_loader(obj)]
        engine, wrapped_optimizer, wrapped_scheduler = self._build_engine(models[0], optimizer, scheduler, loaders)
        for i, obj in enumerate(result):
            if obj is models[0]:
                result[i] = engine
            elif obj is optimizer:
                result[i] = wrapped_optimizer
            elif obj is scheduler:
                result[i] = wrapped_scheduler
        return tuple(result) if len(result) > 1 else result[0]

    def _is_own(self, obj: Any) -> bool:
        """The engine, its model, or an optimizer or scheduler this accelerator already prepared for it."""
        if obj is self.engine or obj is self.engine.module:
            return True
        return any(_wraps(w, obj) for w in self._engine_wrappers)

    def _prepare_again(self, args: tuple, device_placement):
        """What prepare() built, handed back (the Trainer's free_memory() emptied Accelerate's lists: refilled)."""
        result = []
        for obj in args:
            if _is_loader(obj):
                result.append(super().prepare(obj, device_placement=device_placement))
                continue
            own = self.engine if obj is self.engine or obj is self.engine.module else next(
                w for w in self._engine_wrappers if _wraps(w, obj)
            )
            registry = self._models if own is self.engine else (
                self._schedulers if isinstance(own, AcceleratedScheduler) else self._optimizers
            )
            if not any(own is x for x in registry):
                registry.append(own)
            result.append(own)
        return tuple(result) if len(result) > 1 else result[0]

    def prepare_model(self, model: nn.Module, device_placement=None, evaluation_mode: bool = False):
        """Evaluation before training (the Trainer's evaluate()/predict() before train()) builds no engine: the
        model runs bare on the device, or, partitioned at load time by zero.Init, with each module gathering its
        own parameters as it runs (EvaluationGathering) until prepare() builds the engine."""
        if self.engine is not None and model in (self.engine, self.engine.module):
            return self.engine
        if evaluation_mode and self._is_reference(model):
            return self.prepare_reference_model(model)
        if evaluation_mode and self.engine is None:
            return self._prepare_for_evaluation(model)
        return self.prepare(model)

    def _is_reference(self, model: nn.Module) -> bool:
        """A model prepared for evaluation that is not the one to train: the trainer's model is another (TRL's
        reference model), or the engine already trains another."""
        if any(model is ref or model is ref.module for ref in self.reference_engines):
            return True
        if self.engine is not None:
            return True
        return self.is_trained_model is not None and not self.is_trained_model(model)

    def prepare_reference_model(self, model: nn.Module):
        """A frozen model beside the trained one (a DPO reference, a teacher), as TRL prepares it with DeepSpeed's
        inference engine: an infinity inference engine with this accelerator's config, its optimizer and schedule
        left out, so at stage 3 it is partitioned over the ranks with its pieces where ``offload_param`` says
        (NVMe included), and below stage 3 it sits whole on the device in the compute dtype. Returns the engine
        (call it as the model); it lives as long as this accelerator."""
        import infinity
        from infinity.inference import InferenceEngine

        if isinstance(model, InferenceEngine):
            return model
        for engine in self.reference_engines:  # prepared already (TRL prepares once; a second call gets the same)
            if model is engine.module:
                return engine
        check_model_free(model)
        config = dict(self.infinity_config)
        if self.finalize_config is not None:
            config = self.finalize_config(config, model)
        config = {key: value for key, value in config.items() if key not in ("optimizer", "scheduler")}
        engine, *_ = infinity.initialize(model=model, config=config)
        engine.eval()
        self.reference_engines.append(engine)
        return engine

    def _prepare_for_evaluation(self, model: nn.Module) -> nn.Module:
        check_model_free(model)
        if any(_is_partitioned(p) for p in model.parameters()):
            if self._evaluation_gathering is None:
                self._evaluation_gathering = EvaluationGathering(model)
        else:
            model = model.to(self.device)
        if model not in self._models:
            self._models.append(model)
        return model

    def _end_evaluation_gathering(self) -> None:
        if self._evaluation_gathering is not None:
            self._evaluation_gathering.remove()
            self._evaluation_gathering = None
        self._models.clear()  # the bare model evaluation ran: the engine takes its place

    def _build_engine(self, model: nn.Module, optimizer, scheduler, loaders: list):
        import infinity

        config = self._fill_config(model, optimizer, scheduler, loaders)
        kwargs: dict[str, Any] = {"model": model, "config": config}
        if isinstance(optimizer, DummyOptim):
            kwargs["model_parameters"] = optimizer.params
            if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None:
                kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
        elif optimizer is not None:
            kwargs["optimizer"] = optimizer
        engine, _, _, engine_scheduler = infinity.initialize(**kwargs)
        self.engine = engine
        self._models.append(engine)
        wrapped_optimizer = InfinityOptimizer(_optimizer_of(engine), self)
        self._optimizers.append(wrapped_optimizer)
        wrapped_scheduler = None
        if isinstance(scheduler, DummyScheduler):
            wrapped_scheduler = InfinityScheduler(engine_scheduler, wrapped_optimizer)
        elif scheduler is not None:  # the user's, on the user's optimizer, whose param groups the engine steps
            wrapped_scheduler = AcceleratedScheduler(
                scheduler, wrapped_optimizer, step_with_optimizer=self.step_scheduler_with_optimizer,
                split_batches=self.split_batches,
            )  # fmt: skip
        if wrapped_scheduler is not None:
            self._schedulers.append(wrapped_scheduler)
        self._engine_wrappers = [w for w in (wrapped_optimizer, wrapped_scheduler) if w is not None]
        return engine, wrapped_optimizer, wrapped_scheduler

    def _fill_config(self, model: nn.Module, optimizer, scheduler, loaders: list) -> dict:
        """The "auto" values Accelerate's DeepSpeed branch fills at prepare() (the engine fills the optimizer's
        and the hidden-size ones from the model and optimizer), and its checks of optimizer/scheduler pairs."""
        config = dict(self.infinity_config)
        if self.finalize_config is not None:
            config = self.finalize_config(config, model)
        has_optimizer, has_scheduler = "optimizer" in config, "scheduler" in config
        if isinstance(optimizer, torch.optim.Optimizer) and has_optimizer:
            raise ConfigError(
                'the config has an "optimizer" section and prepare() got a torch optimizer too: remove the section, '
                "or pass accelerate.utils.DummyOptim(model.parameters()) instead of the optimizer"
            )
        if isinstance(optimizer, DummyOptim) and not has_optimizer:
            raise ConfigError('prepare() got a DummyOptim but the config has no "optimizer" section to build it from')
        if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) and has_scheduler:
            raise ConfigError(
                'the config has a "scheduler" section and prepare() got a scheduler too: remove the section, or '
                "pass accelerate.utils.DummyScheduler(optimizer) instead of the scheduler"
            )
        if isinstance(scheduler, DummyScheduler) and not has_scheduler and scheduler.lr_scheduler_callable is None:
            raise ConfigError(
                'prepare() got a DummyScheduler without lr_scheduler_callable and the config has no "scheduler" '
                "section: add one, or pass the callable"
            )
        micro = config.get("train_micro_batch_size_per_gpu")
        if micro == AUTO:
            sizes = [loader.batch_size for loader in loaders if getattr(loader, "batch_size", None) is not None]
            if not sizes:
                raise ConfigError(
                    'train_micro_batch_size_per_gpu is "auto" but prepare() got no DataLoader with a batch_size to '
                    "take it from: pass the training DataLoader in the same call, or set a number"
                )
            micro = min(sizes)
            if self.split_batches:
                micro //= self.num_processes
            config["train_micro_batch_size_per_gpu"] = micro
        if config.get("gradient_accumulation_steps", AUTO) == AUTO:
            config["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        accumulation = int(config["gradient_accumulation_steps"])
        if accumulation != self.gradient_accumulation_steps and self.scale_wrt_gas:
            logger.warning(
                "gradient accumulation steps: the accelerator has %d, the config %d; using the config's",
                self.gradient_accumulation_steps, accumulation,
            )  # fmt: skip
            self.gradient_accumulation_steps = accumulation
        if config.get("train_batch_size") == AUTO and isinstance(micro, int):
            config["train_batch_size"] = micro * accumulation * self.num_processes
        if config.get("gradient_clipping") == AUTO:
            config["gradient_clipping"] = 1.0  # Accelerate's value for DeepSpeed
        for precision in ("fp16", "bf16"):
            section = config.get(precision)
            if isinstance(section, dict) and section.get("enabled") == AUTO:
                config[precision] = {**section, "enabled": self.mixed_precision == precision}
        if isinstance(optimizer, DummyOptim):
            params = dict(config["optimizer"].get("params") or {})
            for key, value in (("lr", optimizer.lr), ("weight_decay", optimizer.weight_decay)):
                if params.get(key) == AUTO:
                    params[key] = value
            config["optimizer"] = {**config["optimizer"], "params": params}
        if isinstance(scheduler, DummyScheduler) and has_scheduler and scheduler.lr_scheduler_callable is None:
            params = dict(config["scheduler"].get("params") or {})
            max_lr = getattr(scheduler.optimizer, "lr", None)
            filled = {"warmup_min_lr": 0, "warmup_max_lr": max_lr,
                      "warmup_num_steps": max(1, scheduler.warmup_num_steps)}  # fmt: skip
            if scheduler.total_num_steps is not None:
                total = scheduler.total_num_steps
                filled["total_num_steps"] = total if self.split_batches else math.ceil(total / self.num_processes)
            for key, value in filled.items():
                if params.get(key) == AUTO and value is not None:
                    params[key] = value
            config["scheduler"] = {**config["scheduler"], "params": params}
        return config

    # ---- the training step ----
    def _require_engine(self, what: str):
        if self.engine is None:
            raise ConfigError(f"InfinityAccelerator.{what} needs the model prepared first: call prepare(model, ...)")
        return self.engine

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """The engine's backward and step for this micro-batch. Accelerate's ``sync_gradients`` ends the window:
        a window the data ends early (the last batches of an epoch) steps now; ``scale_wrt_gas`` (DeepSpeed's
        keyword) says whether the engine divides the loss by the accumulation steps."""
        engine = self._require_engine("backward")
        scale_wrt_gas = kwargs.pop("scale_wrt_gas", self.scale_wrt_gas)
        kwargs.pop("learning_rate", None)  # the Trainer passes it for LOMO optimizers only
        if kwargs:
            raise ConfigError(f"InfinityAccelerator.backward does not take {', '.join(sorted(kwargs))}")
        boundary = self.sync_gradients
        accumulation = engine.gradient_accumulation_steps()
        if boundary and not engine.is_gradient_accumulation_boundary():
            # A short window: move the engine's micro-step count to the window's last micro-step.
            engine.micro_steps += accumulation - 1 - engine.micro_steps % accumulation
        elif not boundary and engine.is_gradient_accumulation_boundary():
            raise ConfigError(
                f"the engine's gradient_accumulation_steps ({accumulation}) ends a window at this micro-batch but "
                f"the accelerator does not synchronize gradients here (its gradient_accumulation_steps is "
                f"{self.gradient_accumulation_steps}): make the two equal"
            )
        engine.backward(loss, scale_wrt_gas=scale_wrt_gas)
        skipped = engine.skipped_steps
        if boundary:  # the learning rates this step uses, before the engine steps its scheduler
            self.step_lrs = [group["lr"] for group in _optimizer_of(engine).param_groups]
        engine.step()
        if boundary:
            self.last_step_skipped = engine.skipped_steps != skipped

    @contextlib.contextmanager
    def no_sync(self, model):
        """Nothing to switch off: the engine reduces gradients only as its accumulation window requires."""
        yield

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The global gradient norm the engine measured in its last step (before clipping), as a tensor. The
        engine clipped to the config's gradient_clipping; max_norm must agree (inf asks for the norm only)."""
        engine = self._require_engine("clip_grad_norm_")
        if float(norm_type) != 2.0:
            raise ConfigError(f"clip_grad_norm_: the engine clips by the 2-norm only, got norm_type={norm_type}")
        clipping = float(engine.config.gradient_clipping or 0.0)
        if not math.isinf(float(max_norm)) and float(max_norm) != clipping:
            raise ConfigError(
                f"clip_grad_norm_(max_norm={max_norm}) but the config's gradient_clipping is {clipping}: the engine "
                "clips inside its step, with the config's value; set gradient_clipping to the same value (or "
                '"auto" from TrainingArguments.max_grad_norm)'
            )
        norm = engine.last_grad_norm
        return None if norm is None else torch.tensor(norm, dtype=torch.float32)

    # ---- the model ----
    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if self.engine is not None and model is self.engine:
            return self.engine.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    def get_state_dict(self, model, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Collective. The model's full state dict in the engine's compute dtype, on the CPU. At stage 3 the weights
        are gathered one unit at a time and kept by rank 0 only (other ranks get {}), as DeepSpeed does, and only
        with stage3_gather_16bit_weights_on_model_save (else an error, as Accelerate's under DeepSpeed)."""
        if self.engine is None or model not in (self.engine, self.engine.module):
            return super().get_state_dict(model, unwrap=unwrap)
        zero = self.engine.config.zero
        if zero.stage == 3 and not zero.stage3_gather_16bit_weights_on_model_save:
            raise ConfigError(
                "get_state_dict at ZeRO stage 3 gathers the 16-bit weights: set "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save true, or save the sharded checkpoint "
                "(save_state) and consolidate it with `infinity ckpt to-fp32`"
            )
        return full_state_dict(self.engine)

    # ---- checkpoints ----
    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs) -> str:  # fmt: skip
        """Collective: the engine's sharded checkpoint (weights, optimizer, the JSON's scheduler, counters) in
        ``<output_dir>/pytorch_model``, then what Accelerate saves beside it: the user's schedulers, the data
        loaders' sampler states, each process's RNG states."""
        engine = self._require_engine("save_state")
        if output_dir is None:
            raise ConfigError("InfinityAccelerator.save_state needs output_dir")
        output_dir = os.fspath(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        if save_model_func_kwargs:
            unknown = ", ".join(sorted(save_model_func_kwargs))
            raise ConfigError(f"InfinityAccelerator.save_state does not take {unknown}")
        engine.save_checkpoint(output_dir, tag=CHECKPOINT_TAG)
        location = save_accelerator_state(
            output_dir, [], [], self._user_schedulers(), self._dataloaders, self.state.process_index, self.step,
            None, save_on_each_node=self.project_configuration.save_on_each_node,
            safe_serialization=safe_serialization,
        )  # fmt: skip
        self.wait_for_everyone()
        return str(location)

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs) -> None:  # fmt: skip
        """Collective: what save_state wrote, into this accelerator's engine (any world size, stage or offload
        mode reads it), schedulers, data loaders and RNG states."""
        engine = self._require_engine("load_state")
        if input_dir is None or not os.path.isdir(input_dir):
            raise ConfigError(f"InfinityAccelerator.load_state: {input_dir!r} is not a folder save_state wrote")
        path, _ = engine.load_checkpoint(os.fspath(input_dir), tag=CHECKPOINT_TAG, **load_model_func_kwargs)
        if path is None:
            raise ConfigError(f"InfinityAccelerator.load_state: no engine checkpoint in {input_dir!r}")
        override = load_accelerator_state(
            os.fspath(input_dir), [], [], self._user_schedulers(), self._dataloaders, self.state.process_index,
            None, map_location="cpu", load_kwargs=load_kwargs,
        )  # fmt: skip
        if "step" in override:
            self.step = override["step"]

    def _user_schedulers(self) -> list:
        """The schedulers the engine does not save (the JSON's is in its checkpoint)."""
        return [s for s in self._schedulers if not isinstance(s, InfinityScheduler)]
