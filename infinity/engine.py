"""initialize() and the Engine: DeepSpeed's training API over the ZeRO optimizer.

engine, optimizer, loader, scheduler = infinity.initialize(model=model, config="zero2.json",
                                                           model_parameters=model.parameters())
for batch in loader:
    loss = engine(batch)          # forward (floating inputs cast to the compute dtype)
    engine.backward(loss)         # scaled by loss scale / accumulation steps; gradients reduced
    engine.step()                 # the optimizer step only at the accumulation boundary
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from infinity.budget import owners_of, stage3_units
from infinity.config import AutoValues, Config, load_json, parse_config
from infinity.distributed import collective_timeout_s, compute_device, init_distributed
from infinity.engine_controls import EngineControls
from infinity.engine_getters import EngineGetters
from infinity.errors import CheckpointError, ConfigError, InfinityError
from infinity.generation import default_synced_generate
from infinity.logs import install_default_handler
from infinity.lr_schedules import build_schedule
from infinity.memory.host import (
    HeapWatch,
    SetupTrim,
    fix_heap_policy,
    give_back_if_short,
    policy_for,
    say_huge_pages,
    trim_heap,
)
from infinity.memory.nvme_store import DeferredReservation, _human, can_punch_holes
from infinity.memory.offload import agree_run_id, gradient_tier, optimizer_tiers
from infinity.memory.plan import (
    LayoutSizes,
    Node,
    Plan,
    SwapNeed,
    check_room,
    make_plan,
    nvme_paths,
    survey,
    swap_need,
)
from infinity.memory.tiers import Tier
from infinity.optim import config_optimizer_class
from infinity.precision import LossScaler, compute_dtype
from infinity.zero.bucket_optimizer import ZeroOptimizer
from infinity.zero.compact import codecs_for
from infinity.zero.coordinator import FetchStats
from infinity.zero.gradient_shards import FirstForwardProbe
from infinity.zero.grads import GRADIENT_DTYPES
from infinity.zero.init import init_swap_bytes, take_whole
from infinity.zero.optimizer import Offload
from infinity.zero.partition import plan as partition_plan
from infinity.zero.shards import parameter_shards
from infinity.zero.split_master import master_width
from infinity.zero.stage3 import Stage3, setup_stage3
from infinity.zero.tiles import rule_for
from infinity.zero.unit_optimizer import UnitOptimizer
from infinity.zero.units import fill_units

logger = logging.getLogger("infinity")


def _auto_values(model: nn.Module, optimizer, training_data) -> AutoValues:
    defaults = dict(optimizer.param_groups[0]) if isinstance(optimizer, torch.optim.Optimizer) else {}
    micro = (
        getattr(training_data, "batch_size", None) if isinstance(training_data, torch.utils.data.DataLoader) else None
    )
    model_config = getattr(model, "config", None)
    hidden = getattr(model_config, "hidden_size", None) or getattr(model_config, "n_embd", None)
    betas = defaults.get("betas")
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    model_dtype = str(floating[0]).removeprefix("torch.") if floating else None
    return AutoValues(
        model_dtype=model_dtype,
        lr=defaults.get("lr"),
        betas=tuple(betas) if betas else None,
        eps=defaults.get("eps"),
        weight_decay=defaults.get("weight_decay"),
        momentum=defaults.get("momentum"),
        micro_batch_size=micro,
        hidden_size=hidden,
    )


def _param_groups(model: nn.Module, model_parameters) -> list[dict]:
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if params and isinstance(params[0], Mapping):
        groups = [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in params]
    else:
        groups = [{"params": [p for p in params if p.requires_grad]}]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ConfigError("the model has no trainable parameters (requires_grad=True); nothing to optimize")
    return groups


@dataclass(frozen=True, slots=True)
class _Owner:
    engine: weakref.ref  # the engine that holds the model
    partitioned: bool  # a stage-3 engine moved its weights into its partitions: the model itself has none left


# The engine of each model, by id (a model class need not be hashable); an entry goes when its model does.
_OWNERS: dict[int, _Owner] = {}


def _say_cast(model: nn.Module, dtype: torch.dtype) -> None:
    """The engine holds every parameter in the compute dtype (its shards, units and flat weights have one dtype).
    A model with parameters in another 16-bit dtype (a bf16 base under LoRA adapters in fp32) is therefore
    computed in the config's dtype, where DeepSpeed without fp16/bf16 would leave each as it is: said once, with
    the change that keeps the model's precision. fp32 parameters cast to the 16-bit compute dtype are mixed
    precision as configured, and say nothing."""
    other = [(name, p.dtype) for name, p in model.named_parameters()
             if p.is_floating_point() and p.dtype not in (dtype, torch.float32)]  # fmt: skip
    if not other:
        return
    kinds = sorted({str(d).removeprefix("torch.") for _, d in other})
    target = str(dtype).removeprefix("torch.")
    keys = [f'"{_CONFIG_KEY[k]}": {{"enabled": true}}' for k in kinds if k in _CONFIG_KEY]
    advice = f"enable {' or '.join(keys)} in the config" if keys else f"cast the model to {target} before initialize()"
    logger.warning(
        "%d of the model's parameters are %s (%r first) but the config computes in %s: the engine casts them, so "
        "their math is %s's, not the model's own. To compute in the model's precision %s (trainable parameters "
        "keep fp32 masters)", len(other), "/".join(kinds), other[0][0], target, target, advice,
    )  # fmt: skip


_CONFIG_KEY = {"bfloat16": "bf16", "float16": "fp16"}  # the config section that computes in a dtype


def check_model_free(model: nn.Module) -> None:
    """A model a live engine holds cannot go to another one: said here, not as a shape error deep inside. Nor can
    one a stage-3 engine partitioned, once that engine is destroyed or dropped: its weights went with it."""
    owner = _OWNERS.get(id(model))
    if owner is None:
        return
    name = type(model).__name__
    engine = owner.engine()
    if engine is not None and not engine.destroyed:
        raise ConfigError(
            f"this {name} already belongs to a live infinity engine (built by initialize(), an "
            "InfinityAccelerator or an InfinityTrainer): call engine.destroy() on that engine first (trainer.engine "
            "or the model prepare() returned), or keep using it"
        )
    if owner.partitioned:
        raise ConfigError(
            f"this {name} was partitioned by a stage-3 engine, now destroyed or dropped, which kept its weights in "
            "its partitions: save the weights before destroy() (engine.save_16bit_model, trainer.save_model or "
            "accelerator.get_state_dict) and build the model again from them"
        )


def live_engines() -> list[Engine]:
    """The engines that hold a model and are not destroyed."""
    found = (owner.engine() for owner in list(_OWNERS.values()))
    return [engine for engine in found if engine is not None and not engine.destroyed]


def claim_model(model: nn.Module, engine: Engine, *, partitioned: bool) -> None:
    key = id(model)
    if key not in _OWNERS:
        weakref.finalize(model, _OWNERS.pop, key, None)
    _OWNERS[key] = _Owner(weakref.ref(engine), partitioned)


def _remove_hooks(zero_optimizer, stage3: Stage3 | None) -> None:
    """The hooks on the model's parameters and modules refer to the optimizer and the stage-3 runtime: without
    removing them, a dropped engine would live (and keep training state) as long as the model. An inference
    engine has no optimizer (None)."""
    if zero_optimizer is not None:
        zero_optimizer.close()
    if stage3 is not None:
        stage3.close()


def _drop_frozen(optimizer: torch.optim.Optimizer, *, say: bool) -> None:
    """Parameters that do not require grad leave the optimizer's groups (an empty group stays, so group indices
    and schedules hold), as DeepSpeed's ZeRO optimizers keep only trainable ones: a PEFT model's whole
    ``model.parameters()`` handed to AdamW trains the adapters and keeps no masters or states for the frozen base."""
    dropped = 0
    for group in optimizer.param_groups:
        kept = [p for p in group["params"] if p.requires_grad]
        dropped += len(group["params"]) - len(kept)
        group["params"] = kept
    if not dropped:
        return
    trainable = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for param in [p for p in optimizer.state if id(p) not in trainable]:
        del optimizer.state[param]
    if say:
        logger.info("the optimizer was given %d parameters that do not require grad: left out of it, as DeepSpeed "
                    "does (frozen; never updated)", dropped)  # fmt: skip


def _not_optimized(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The model's parameters in no param group: frozen ones, and trainable ones left out of model_parameters
    (DeepSpeed casts them to the compute dtype and does not update them)."""
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [p for p in model.parameters() if id(p) not in optimized]


# DeepSpeed's own Adam (FusedAdam; DeepSpeedCPUAdam with optimizer offload) for the keys a config omits. With
# torch_adam DeepSpeed builds torch's class and gets torch's defaults (AdamW: weight decay 0.01); so do we. SGD is
# torch.optim.SGD there too.
DEEPSPEED_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False}


def _flag(params: dict, key: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"optimizer.params.{key} must be true or false, got {value!r}")
    return value


def build_optimizer(config: Config, groups: list[dict], *, on_cpu: bool) -> torch.optim.Optimizer:
    """The optimizer section as a torch optimizer, with DeepSpeed's defaults for the keys it omits. DeepSpeed's
    "Adam" decouples weight decay (adam_w_mode defaults to true), so it is AdamW unless adam_w_mode is false. On
    the CPU, Adam/AdamW use the fused kernel: as fast as a hand-written SIMD Adam there
    (docs/ARCHITECTURE.md, "Measured")."""
    spec = config.optimizer
    params = dict(spec.params)
    kind = spec.type.lower()
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    try:
        if kind in ("adam", "adamw"):
            torch_adam = _flag(params, "torch_adam", False)
            adam_w_mode = _flag(params, "adam_w_mode", True)
            _flag(params, "amsgrad", False)  # torch implements it (DeepSpeed's fused kernels refuse it)
            if not _flag(params, "bias_correction", True):
                raise ConfigError(
                    "optimizer.params.bias_correction false is not supported (Adam here always corrects the "
                    "moment estimates' bias); remove it or set it true"
                )
            for key in ("torch_adam", "adam_w_mode", "bias_correction"):
                params.pop(key, None)
            if not torch_adam:
                params = {**DEEPSPEED_ADAM_DEFAULTS, **params}
            cls = torch.optim.AdamW if (kind == "adamw" or adam_w_mode) else torch.optim.Adam
            if on_cpu and "fused" not in params and "foreach" not in params:
                params["fused"] = True
            return cls(groups, **params)
        if kind == "sgd":
            return torch.optim.SGD(groups, **{"lr": 1e-3, **params})
        return config_optimizer_class(spec.type)(groups, **params)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"optimizer.params for {spec.type}: {e}") from None


class _EpochSampler(torch.utils.data.DistributedSampler):
    """Each pass over the data (start_pass) is the next epoch, a new shuffle, unless the caller chose the epoch
    with set_epoch() since the last pass (as DeepSpeed's loader does). A resumed run's next pass is the saved
    epoch, less the samples it had consumed (``resume``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._next_epoch = 0
        self._epoch_from_caller = False
        self._resume: tuple[int, int] | None = None  # (epoch, samples to skip) for the next pass
        self.skipped = 0  # samples the current pass skipped

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._epoch_from_caller = True

    def start_pass(self) -> None:
        self.skipped = 0
        if self._resume is not None:
            self.epoch, self.skipped = self._resume
            self._resume = None
        elif not self._epoch_from_caller:
            self.epoch = self._next_epoch
        self._epoch_from_caller = False
        self._next_epoch = self.epoch + 1

    def resume(self, epoch: int, skip: int) -> None:
        self._resume = (epoch, skip)

    def __iter__(self):
        indices = super().__iter__()
        return iter(list(indices)[self.skipped :]) if self.skipped else indices


class _TrainingDataLoader(torch.utils.data.DataLoader):
    """initialize()'s training loader: every iter() starts the sampler's next epoch; it counts the batches it
    hands out, so a checkpoint can resume the pass where it stopped (DeepSpeed's data sampler state)."""

    _consumed = 0  # batches of the current pass handed out (including those a resumed pass skipped)
    _in_pass = False
    _passes = 0  # which pass is the current one (a pass given up early ends when its iterator is dropped)

    def __iter__(self):
        self.sampler.start_pass()
        self._passes += 1
        mine = self._passes
        self._in_pass = True
        self._consumed = self.sampler.skipped // self.batch_size
        try:
            for batch in super().__iter__():
                self._consumed += 1
                yield batch
        finally:
            if self._passes == mine:  # exhausted, or the loop broke out and dropped it: the next iter() is a new epoch
                self._in_pass = False

    def position(self) -> dict:
        """Where the training data stands: the epoch, the batches of it consumed, the loader's generator."""
        return {"epoch": self.sampler.epoch, "batches": self._consumed, "in_pass": self._in_pass,
                "next_epoch": self.sampler._next_epoch, "generator": self.generator.get_state()}  # fmt: skip

    def resume(self, position: dict) -> None:
        """The next iter() continues the saved pass after its consumed batches (or starts the next epoch when
        the pass was over)."""
        if position.get("generator") is not None:
            self.generator.set_state(position["generator"])
        if not position["in_pass"]:
            self.sampler._next_epoch = position["next_epoch"]
        elif position["batches"] >= len(self):
            self.sampler._next_epoch = position["epoch"] + 1
        else:
            self.sampler.resume(position["epoch"], position["batches"] * self.batch_size)


def _cast_inputs(value, dtype: torch.dtype, device: torch.device):
    if torch.is_tensor(value):
        value = value.to(device)
        return value.to(dtype) if value.is_floating_point() and dtype != torch.float32 else value
    if isinstance(value, list | tuple):
        return type(value)(_cast_inputs(v, dtype, device) for v in value)
    if isinstance(value, Mapping):
        return {k: _cast_inputs(v, dtype, device) for k, v in value.items()}
    return value


class Engine(EngineControls, EngineGetters, nn.Module):
    """Wraps the model: forward, backward with loss scaling and gradient reduction, step at the boundary."""

    def __init__(
        self,
        *,
        model: nn.Module,
        config,
        optimizer=None,
        model_parameters=None,
        lr_scheduler=None,
        training_data=None,
        collate_fn=None,
    ) -> None:
        super().__init__()
        user_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self._join(model, load_json(config), user_optimizer=user_optimizer, training_data=training_data)
        zero = self.config.zero
        groups = _param_groups(self.module, model_parameters)
        if user_optimizer is not None:
            torch_optimizer = user_optimizer
        elif callable(optimizer):
            torch_optimizer = optimizer(groups)
        elif self.config.optimizer is not None:
            on_cpu = zero.offload_optimizer.enabled or self.device.type == "cpu"
            torch_optimizer = build_optimizer(self.config, groups, on_cpu=on_cpu)
        else:
            raise ConfigError(
                'no optimizer: pass optimizer= or add an "optimizer" section to train (for inference, call '
                "infinity.initialize(model=, config=) without one: it gives an InferenceEngine)"
            )
        _drop_frozen(torch_optimizer, say=self.comm.rank == 0)
        self.stage3: Stage3 | None = None
        self._plan_run(torch_optimizer)  # before anything is written: a run the disk cannot hold fails here
        nvme = "nvme" in (zero.offload_optimizer.device, zero.offload_param.device)
        run_id = agree_run_id(self.comm) if nvme else None  # names the swap folders, the same on every rank
        offload = None
        try:  # a failure from here on removes what was installed: hooks on the model, swap files
            with self._setup_reservation():
                offload = self._optimizer_offload(torch_optimizer, run_id)
                self._partition(torch_optimizer, offload, run_id)
            self.lr_scheduler = self._scheduler(torch_optimizer, lr_scheduler)
        except BaseException:
            self._abandon(offload)
            raise
        self.optimizer = self.zero_optimizer
        # whether the gradient is kept across steps, from the first training forward ([Note: gradient kept ...]);
        # none is held where the step runs in backward ([Note: step in backward])
        in_backward = self.zero_optimizer.steps_in_backward and self.config.gradient_accumulation_steps == 1
        held = None if in_backward else self.zero_optimizer.gradients_in_memory
        self._gradient_probe = FirstForwardProbe(held)
        trim_heap()  # the model's own tensors, freed as they moved into the shards (infinity/memory/host.py)
        if (zero.offload_param.enabled or zero.offload_optimizer.enabled) and self.comm.rank == 0:
            plan = self.plan
            logger.info(
                "plan: %d rank(s) per host, %s of host memory each (max_in_cpu's pieces within %s, staging rings "
                "within %s), optimizer tiles of <= %d elements", plan.local_ranks, _human(plan.host_share),
                _human(plan.host_cache_bytes), _human(plan.staging_bytes), plan.tile_numel,
            )  # fmt: skip
        if zero.offload_param.enabled and self.comm.rank == 0:
            logger.info("parameters offloaded to %s; rank 0 holds %s", zero.offload_param.device,
                        self.stage3.table.shards.describe())  # fmt: skip
        if zero.offload_optimizer.enabled and self.comm.rank == 0:
            tiled = self.zero_optimizer.tiled
            logger.info(
                "optimizer offloaded to %s: %d tiles of <= %d elements, masters %s; rank 0 holds %s",
                zero.offload_optimizer.device, len(tiled.tiles), max(t.numel for t in tiled.tiles),
                "split (16 bits beside the bf16 weights)" if tiled.splitter is not None else "fp32",
                tiled.manager.describe(),
            )  # fmt: skip
            if tiled.gradients is not None:
                logger.info("gradients on nvme with the optimizer in %s (more than a quarter of the host share); "
                            "rank 0 holds %s", self.config.infinity.offloaded_gradient_dtype,
                            tiled.gradients.manager.describe())  # fmt: skip
            elif zero.stage == 3 and zero.offload_optimizer.device == "nvme":
                logger.info("gradients in host memory, in fp32 (a quarter of the host share holds them; they "
                            "go to nvme with the optimizer when it does not, as infinity.offloaded_gradient_dtype "
                            "says)")  # fmt: skip
        weakref.finalize(self, _remove_hooks, self.zero_optimizer, self.stage3)  # a dropped engine lets go
        if self.stage3 is None:
            claim_model(self.module, self, partitioned=False)
        self.loss_scaler = LossScaler.from_config(self.config.fp16)
        self.training_dataloader = self._dataloader(training_data, collate_fn)
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.global_samples = 0  # DeepSpeed's: train_batch_size per optimizer step, skipped ones too
        self._step_applied = False  # whether the last step() changed the parameters (was_step_applied)
        self.last_grad_norm: float | None = None
        self._step_started = time.perf_counter()
        self._heap_watch = HeapWatch()  # KEEP's heap near its settled size (memory/host.py)
        self._backward_pending = False  # a backward whose gradients no step has taken yet
        self._fetch_stats = FetchStats()
        self._phase_seconds = {"forward": 0.0, "backward": 0.0, "step": 0.0}  # for wall_clock_breakdown
        self._window_loss = torch.zeros((), dtype=torch.float64, device=self.device)  # losses since the last report
        self._window_micro_steps = 0

    def _join(self, model: nn.Module, raw_config: dict, *, user_optimizer, training_data) -> None:
        """What every engine does first: the process group, the parsed config, the device and compute dtype, and
        the model (below stage 3 moved to the device; at stage 3 it moves unit by unit as it is partitioned, so
        the whole model never is), its floating buffers in the compute dtype. A model another live engine holds
        is refused first."""
        check_model_free(model)
        self.raw_config = dict(raw_config)  # as given: checkpoints record it
        self.distributed = init_distributed(collective_timeout_s(raw_config.get("collective_timeout")))
        self.comm = self.distributed.comm
        install_default_handler(self.comm.rank)  # steps_per_print lines appear without logging set up (logs.py)
        self.config: Config = parse_config(
            raw_config, world_size=self.comm.world_size, auto=_auto_values(model, user_optimizer, training_data)
        )
        self.device = compute_device()
        self.compute_dtype = compute_dtype(self.config)
        if self.comm.rank == 0:
            _say_cast(model, self.compute_dtype)
        self.node: Node = survey(self.comm, nvme_paths(self.config.zero))  # collective ([Note: one plan])
        on_nvme = bool(nvme_paths(self.config.zero))
        fix_heap_policy(policy_for(on_nvme=on_nvme, host_share=self.node.host_share))  # memory/host.py
        say_huge_pages()  # [Note: huge pages] in memory/host.py
        self.module = model if self.config.zero.stage == 3 else model.to(self.device)
        for buffer in self.module.buffers():
            dtype = self.compute_dtype if buffer.is_floating_point() else buffer.dtype
            buffer.data = buffer.data.to(device=self.device, dtype=dtype)

    def _partition(self, torch_optimizer: torch.optim.Optimizer, offload: Offload | None, run_id: str | None) -> None:
        """The ZeRO optimizer (and at stage 3 the units and their hooks) over the model."""
        zero = self.config.zero
        if zero.stage == 3:
            claim_model(self.module, self, partitioned=True)  # before any weight moves: also if the rest fails
            self.stage3 = setup_stage3(
                self.module, distributed=self.distributed, zero=zero, dtype=self.compute_dtype, device=self.device,
                make_shards=self._make_shards(run_id),
            )  # fmt: skip
            self.zero_optimizer = UnitOptimizer(
                torch_optimizer, comm=self.comm, table=self.stage3.table,
                compute_dtype=self.compute_dtype, device=self.device, overlap_comm=zero.overlap_comm, offload=offload,
                sub_group_size=self.plan.tile_numel,
                on_param_grad=self.stage3.coordinator.on_param_grad,
            )  # fmt: skip
            if offload is not None and offload.home is Tier.NVME:
                self.zero_optimizer.set_step_behind_forward(self.config.infinity.step_behind_forward)
            self.zero_optimizer.set_step_in_backward(
                self.config.infinity.step_in_backward, clip_norm=self.config.gradient_clipping,
                loss_scaling=self.config.fp16.enabled,
            )  # fmt: skip
            self._keep_generate_in_step()
            self.stage3.bind_reducer(self.zero_optimizer.reducer)
            self.stage3.coordinator.set_grad_params(self.zero_optimizer.grad_params_per_unit)
            self.stage3.on_piece_edited = self.zero_optimizer.load_unit_piece
            fill_units(self.stage3.table, comm=self.comm, full_value=take_whole,
                       on_piece=self.zero_optimizer.initialize_piece, after_unit=SetupTrim())  # fmt: skip
        else:
            self.zero_optimizer = ZeroOptimizer(
                torch_optimizer, comm=self.comm, stage=zero.stage, compute_dtype=self.compute_dtype,
                device=self.device, bucket_numel=zero.reduce_bucket_size, overlap_comm=zero.overlap_comm,
                offload=offload, gather_numel=self.plan.gather_numel,
                frozen=_not_optimized(self.module, torch_optimizer),
            )  # fmt: skip

    def _plan_run(self, optimizer: torch.optim.Optimizer | None) -> None:
        """The run's plan ([Note: one plan] in memory/plan.py) from the config, the node surveyed in _join and the
        layout's sizes; with NVMe, every rank's swap files set against the free space before any is opened.
        ``optimizer``: None for an inference engine. Also refuses an optimizer that offload cannot step."""
        zero = self.config.zero
        width = 0
        if optimizer is not None:
            rule = rule_for(optimizer)  # refuses, at any stage, an optimizer that flat pieces would change
            if zero.offload_optimizer.enabled:  # master + states, in fp32 units ([Note: compact states])
                codecs = codecs_for(self.config.infinity.optimizer_state_dtype, rule.states, type(optimizer).__name__)
                width = master_width(self.config.infinity.offloaded_master)
                width += sum(codec.bytes_per_element for codec in codecs) / 4
        self._planned_units: tuple[tuple[int, int], ...] | None = None
        self._defer_reservation = False  # zero.Init's pieces share the disk ([Note: deferred reservation])
        self.swap_need: SwapNeed | None = None  # bytes of this rank's swap files, as the plan counts them
        layout = self._layout_sizes(optimizer) if self.node.paths else None
        gradient_bytes = sum(layout.runs) * 4 if layout is not None and zero.stage == 3 else 0
        largest_unit = max(layout.runs, default=0) if layout is not None and zero.stage == 3 else 0
        gradient_itemsize = GRADIENT_DTYPES[self.config.infinity.offloaded_gradient_dtype].itemsize
        self.plan: Plan = make_plan(zero, world_size=self.comm.world_size, local_ranks=self.node.local_ranks,
                                    host_share=self.node.host_share, state_width=width,
                                    gradient_bytes=gradient_bytes, gradient_itemsize=gradient_itemsize,
                                    largest_unit_numel=largest_unit)  # fmt: skip
        if layout is None:
            return
        need = swap_need(self.plan, zero, layout, state_width=width, param_itemsize=self.compute_dtype.itemsize)
        self.swap_need = need
        per_path = need.by_path()
        detail = need.describe()
        init_bytes = init_swap_bytes(self.module.parameters())  # given back as taken: [Note: deferred reservation]
        for path, nbytes in init_bytes.items():
            planned = [p for p in per_path if os.path.abspath(p) == path]  # "d" and "d/" are one folder
            if not planned or not can_punch_holes(path):
                continue  # another folder, or the copy stays until its last piece is taken: no credit
            credit = nbytes
            for key in planned:
                taken = min(per_path[key], credit)
                per_path[key] -= taken
                credit -= taken
            detail += f", less zero.Init's copy there ({_human(nbytes)}, given back as it is taken)"
            self._defer_reservation = True
        check_room(self.node, per_path, what="initialize(): the run's NVMe swap files", detail=detail)

    def _setup_reservation(self) -> contextlib.AbstractContextManager:
        """Around setup: where zero.Init's pieces share the run's folder, the run's stores fill the space they
        give back and are reserved at the end ([Note: deferred reservation] in memory/nvme_store.py)."""
        return DeferredReservation() if self._defer_reservation else contextlib.nullcontext()

    def _layout_sizes(self, optimizer: torch.optim.Optimizer | None) -> LayoutSizes:
        """The partition's sizes, as _partition will lay it out: stage 3's units (the same rule as
        zero/units.py's build_units, checked against it in _make_shards), or the buckets of stages 1-2."""
        zero = self.config.zero
        if zero.stage == 3:
            owners = owners_of(self.module)
            persistent, units = stage3_units(owners, zero, self.comm.world_size)
            first = 1 if persistent else 0
            self._planned_units = tuple((first + i, piece) for i, (_, piece) in enumerate(units))
            runs = ([persistent // self.comm.world_size] if persistent else []) + [piece for _, piece in units]
            return LayoutSizes(units=self._planned_units, runs=tuple(runs) if optimizer is not None else (),
                               more_runs=sum(len(o.numels) for o in owners))  # fmt: skip
        if optimizer is None:
            return LayoutSizes()
        layouts = partition_plan([[p.numel() for p in group["params"]] for group in optimizer.param_groups],
                                 world_size=self.comm.world_size if zero.stage else 1,
                                 bucket_numel=zero.reduce_bucket_size)  # fmt: skip
        return LayoutSizes(runs=tuple(b.piece_numel for layout in layouts for b in layout.buckets))

    def _make_shards(self, run_id: str | None):
        """Stage 3's make_shards, with the plan's sizes; the units must be those the plan counted."""
        make = parameter_shards(self.config.zero, self.config.aio, self.comm, run_id=run_id,
                                dtype=self.compute_dtype, device=self.device, plan=self.plan)  # fmt: skip
        planned = self._planned_units

        def checked(layout, persistent: set[int]):
            movable = tuple((b.index, b.piece_numel) for b in layout.buckets if b.index not in persistent)
            if planned is not None and movable != planned:
                raise InfinityError(
                    f"internal: the plan counted {len(planned)} units, the engine laid out {len(movable)} (or of "
                    "other sizes): budget.py stage3_units no longer follows zero/units.py build_units"
                )
            return make(layout, persistent)

        return checked

    def _keep_generate_in_step(self) -> None:
        """Stage 3: the model's generate() gathers the whole model once for the call when it fits
        stage3_max_live_parameters ([Note: generation gathered once] in generation.py), and at world size > 1
        defaults synced_gpus to True ([Note: synced generation]); removed with the hooks."""
        from infinity.zero import GatheredParameters

        numel = sum(unit.numel for unit in self.stage3.table.units)
        limit = self.config.zero.stage3_max_live_parameters
        fits = numel <= limit

        def whole():
            return GatheredParameters(list(self.module.parameters()))

        installed = default_synced_generate(self.module, synced=self.comm.world_size > 1,
                                            whole=whole if fits else None)  # fmt: skip
        if installed is not None:
            self.stage3.handles.append(installed)
        if not fits and self.comm.rank == 0 and callable(getattr(self.module, "generate", None)):
            logger.info("generate() streams the weights unit by unit: the model's %s elements exceed "
                        "stage3_max_live_parameters (%s)", f"{numel:,}", f"{limit:,}")  # fmt: skip

    def _scheduler(self, torch_optimizer: torch.optim.Optimizer, lr_scheduler):
        if self.config.scheduler is not None:
            return build_schedule(self.config.scheduler, torch_optimizer)
        if lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(torch_optimizer)
        return lr_scheduler

    def _abandon(self, offload: Offload | None) -> None:
        """initialize() failed part way: remove the hooks and swap files made so far (the error is what matters)."""
        zero_optimizer = getattr(self, "zero_optimizer", None)
        try:
            if zero_optimizer is not None:
                zero_optimizer.close()
            elif offload is not None:
                offload.manager.close()
                if offload.gradients is not None:
                    offload.gradients.close()
            if self.stage3 is not None:
                self.stage3.close()
        except Exception:  # noqa: BLE001 - the original error is the one to report
            logger.exception("cleaning up after a failed initialize()")

    def _optimizer_offload(self, optimizer: torch.optim.Optimizer, run_id: str | None) -> Offload | None:
        """The optimizer's tiers, with the plan's tile size and gather bound (the same on every rank)."""
        zero = self.config.zero
        spec = zero.offload_optimizer
        if not spec.enabled:
            return None
        nvme = spec.device == "nvme"
        where = {"rank": self.comm.rank, "run_id": run_id, "plan": self.plan}
        manager, home = optimizer_tiers(zero, self.config.aio, **where)
        return Offload(
            manager=manager,
            home=home,
            tile_numel=self.plan.tile_numel,
            pipeline_read=spec.pipeline_read or not nvme,  # host homes: nothing to pipeline
            pipeline_write=spec.pipeline_write or not nvme,
            gradients=gradient_tier(zero, self.config.aio, **where),
            state_dtype=self.config.infinity.optimizer_state_dtype,
            gradient_dtype=GRADIENT_DTYPES[self.config.infinity.offloaded_gradient_dtype],
            master_layout=self.config.infinity.offloaded_master,
        )

    def _tier_managers(self) -> dict:
        managers = {}
        if self.zero_optimizer is not None and self.zero_optimizer.tiled is not None:
            managers["optimizer"] = self.zero_optimizer.tiled.manager
            if self.zero_optimizer.tiled.gradients is not None:
                managers["gradients"] = self.zero_optimizer.tiled.gradients.manager
        if self.stage3 is not None and self.stage3.table.shards.manager is not None:
            managers["parameters"] = self.stage3.table.shards.manager
        return managers

    def tier_stats(self) -> dict:
        """This rank's offloaded state: per owner ("optimizer", "gradients", "parameters"), bytes per tier and the
        NVMe traffic so far (bytes, requests, seconds blocked waiting)."""
        return {owner: manager.stats().as_dict() for owner, manager in self._tier_managers().items()}

    # ---- DeepSpeed's getters ----
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.zero_optimizer.param_groups]

    def get_mom(self) -> list:
        """DeepSpeed's: each param group's momentum (SGD, RMSprop) or betas (the Adam family), 0.0 where a group
        has none."""
        sgd_like = isinstance(self.zero_optimizer.optimizer, torch.optim.SGD | torch.optim.RMSprop)
        name = "momentum" if sgd_like else "betas"
        return [group.get(name, 0.0) for group in self.zero_optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """DeepSpeed's: the 2-norm of all gradients at the last optimizer step (before clipping, over every rank's
        partition); None before the first step."""
        return self.last_grad_norm

    def was_step_applied(self) -> bool:
        """DeepSpeed's: whether the latest step() updated the parameters; False inside an accumulation window and
        for a step skipped on fp16 overflow (not an error)."""
        return self._step_applied

    def optimizer_state_bytes(self) -> int:
        return self.zero_optimizer.state_bytes()

    # ---- training ----
    def forward(self, *args, **kwargs):
        self.check_states_here("forward", ("lp_params",))
        self._refuse_inside_a_backward_step("a forward")
        start = time.perf_counter()
        probe = getattr(self, "_gradient_probe", None)
        heap_before = None if probe is None else probe.begin()
        output = self.module(
            *_cast_inputs(args, self.compute_dtype, self.device),
            **_cast_inputs(kwargs, self.compute_dtype, self.device),
        )
        if heap_before is not None:
            probe.end(heap_before)
        self._phase_seconds["forward"] += time.perf_counter() - start
        return output

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagates loss * loss_scale / gradient_accumulation_steps and reduces the gradients. With
        ``scale_wrt_gas=False`` (DeepSpeed's keyword) the loss is not divided by the accumulation steps: the caller
        already did, as Transformers' Trainer does."""
        if loss.dim() != 0:
            raise ValueError(f"engine.backward expects a scalar loss, got shape {tuple(loss.shape)}")
        start = time.perf_counter()
        scale = self.loss_scaler.scale / (self.config.gradient_accumulation_steps if scale_wrt_gas else 1)
        scaled = loss.float() * scale
        self.zero_optimizer.begin_backward(
            scaled, boundary=self.is_gradient_accumulation_boundary(), loss_scale=self.loss_scaler.scale
        )
        self._backward_pending = True
        self._last_backward_at_boundary = self.is_gradient_accumulation_boundary()
        if self._last_backward_at_boundary:
            self.zero_optimizer.prefetch_states(gradients=False)
        scaled.backward()
        # The loss as the caller computed it (no sync here: read every steps_per_print steps), once its backward
        # has run (a refused or failed one counts nothing). A caller that divided it by the accumulation steps
        # itself (scale_wrt_gas off, as the Trainer does) gets it multiplied back, so the engine's line reports
        # what the Trainer's does, as DeepSpeed's monitor does.
        unscale = 1 if scale_wrt_gas else self.config.gradient_accumulation_steps
        self._window_loss += loss.detach().double() * unscale
        self._window_micro_steps += 1
        if self.stage3 is not None:
            self.stage3.coordinator.end_pass()  # every rank done with its fetches; all units released
        self.zero_optimizer.reducer.finish_backward()
        if self.is_gradient_accumulation_boundary():
            self.zero_optimizer.prefetch_states()  # the step's first reads run while the caller gets to step()
        self._phase_seconds["backward"] += time.perf_counter() - start
        return loss

    def step(self) -> None:
        """The optimizer step at the accumulation boundary; otherwise only counts the micro-step."""
        self.check_states_here("step", ("optim_states", "hp_params", "lp_params"))
        start = time.perf_counter()
        self._step_applied = False  # a step() inside an accumulation window changes nothing
        if self.is_gradient_accumulation_boundary():
            self._backward_pending = False
            result = self.zero_optimizer.step(
                loss_scale=self.loss_scaler.scale,
                clip_norm=self.config.gradient_clipping,
                check_overflow=self.config.fp16.enabled,
            )
            self.loss_scaler.update(overflow=not result.stepped)
            self._step_applied = result.stepped
            self.global_samples += self.config.train_batch_size
            if result.stepped:
                self.last_grad_norm = result.grad_norm
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            else:
                self.skipped_steps += 1
                logger.info(
                    "step %d skipped: fp16 overflow; loss scale now %g", self.global_steps, self.loss_scaler.scale
                )
            self.global_steps += 1
            self._heap_within_host()
            if self.stage3 is not None:
                self._fetch_stats = self.stage3.coordinator.take_step_stats()
            self._phase_seconds["step"] += time.perf_counter() - start
            if self.global_steps % self.config.steps_per_print == 0 and self.comm.rank == 0:
                self._report()
            self.micro_steps += 1
            self._after_boundary_step()
            return
        self.micro_steps += 1

    def finish_step(self, what: str = "reading or saving the training state") -> None:
        """Steps the units a step running behind the forward has not reached yet ([Note: step behind forward] in
        zero/unit_optimizer.py); anything that reads or replaces the whole training state calls this first. Between
        a backward that took the step and engine.step() ([Note: step in backward]) it refuses ``what`` instead."""
        if self.zero_optimizer is not None:
            self._refuse_inside_a_backward_step(what)
            self.zero_optimizer.finish_step()

    def _refuse_inside_a_backward_step(self, what: str) -> None:
        """The weights and states are the step's, but the step is not counted (step counts, the scheduler, the
        persistent parameters) until engine.step(): whatever reads them in between would mix the two."""
        if self.zero_optimizer is not None and self.zero_optimizer.gradient_taken_by_step:
            raise InfinityError(
                f"{what} between engine.backward() and engine.step(): that backward took the optimizer step unit "
                "by unit (infinity.step_in_backward, on where nothing needs the whole gradient), the gradient went "
                "with it, and the step counts once engine.step() runs; call engine.step() first, or set "
                '"infinity": {"step_in_backward": false}'
            )

    def _heap_within_host(self) -> None:
        """The heap's cache stays near its settled size, and gives way when the host runs short of memory
        (memory/host.py), said once."""
        if self._heap_watch.after_step():
            logger.debug("rank %d: the heap grew past its settled size; its free pages given back (%d times)",
                         self.comm.rank, self._heap_watch.trims)  # fmt: skip
        available = give_back_if_short(self.node.ranks[self.node.rank].host_bytes)
        if available is not None:
            logger.warning(
                "rank %d: host memory is short (%s available, under an eighth of the %s the plan found at "
                "initialize): freed blocks now go back to the kernel after each use, so steps are slower (each "
                "block is faulted in again); free host memory, or lower the micro-batch, to keep them cached",
                self.comm.rank, _human(available), _human(self.node.ranks[self.node.rank].host_bytes),
            )  # fmt: skip

    def _report(self) -> None:
        elapsed = time.perf_counter() - self._step_started
        loss = self._window_loss.item() / max(self._window_micro_steps, 1)
        grad_norm = "n/a" if self.last_grad_norm is None else f"{self.last_grad_norm:.4g}"
        logger.info(
            "step %d: loss %.4f (rank 0, mean of %d micro-steps), lr %s, grad norm %s, loss scale %g, %.3f s/step",
            self.global_steps, loss, self._window_micro_steps, ", ".join(f"{lr:.3g}" for lr in self.get_lr()),
            grad_norm, self.loss_scale, elapsed / self.config.steps_per_print,
        )  # fmt: skip
        self._window_loss.zero_()
        self._window_micro_steps = 0
        if self.config.wall_clock_breakdown:
            per_step = {k: v / self.config.steps_per_print for k, v in self._phase_seconds.items()}
            logger.info(
                "time per step: forward %.3g s, backward (with gradient reduction) %.3g s, optimizer step %.3g s",
                per_step["forward"], per_step["backward"], per_step["step"],
            )  # fmt: skip
        for owner, manager in self._tier_managers().items():
            if manager.store is None:
                continue
            window = manager.window()
            read, write = window["nvme_read"], window["nvme_write"]
            moved = (read.bytes + write.bytes) / 1e9
            blocked = read.blocked_s + write.blocked_s
            logger.info(
                "NVMe %s, last %d steps: read %.2f GB, wrote %.2f GB (%.2f GB/s over %.1f s); blocked %.3f s "
                "waiting, the rest hidden behind compute",
                owner, self.config.steps_per_print, read.bytes / 1e9, write.bytes / 1e9, moved / max(elapsed, 1e-9),
                elapsed, blocked,
            )  # fmt: skip
        if self.stage3 is not None:
            stats = self._fetch_stats
            logger.info(
                "ZeRO-3 last step: %d fetches, %.0f%% prefetched or kept gathered, %d elements gathered, peak %d "
                "live, %.3f s blocked on fetches",
                stats.fetches, 100 * stats.prefetched_fraction, stats.gathered_numel, stats.peak_live_numel,
                stats.blocked_s,
            )  # fmt: skip
        self._phase_seconds = dict.fromkeys(self._phase_seconds, 0.0)
        self._step_started = time.perf_counter()

    def zero_stats(self) -> dict:
        """ZeRO-3 fetch telemetry of the last optimizer step (all its micro-steps); empty below stage 3."""
        return self._fetch_stats.as_dict() if self.stage3 is not None else {}

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:  # fmt: skip
        """Collective (every rank calls it; a rank calling it alone gets a CollectiveUsageError): the model's
        weights in the compute dtype, written by rank 0 as safetensors (``.bin``/``.pt``: DeepSpeed's torch.save
        file), with a transformers model's config.json beside them (checkpoint/model16.py). At stage 3 the
        weights are gathered one unit at a time, and only with stage3_gather_16bit_weights_on_model_save;
        without it this returns False, as DeepSpeed does. ``exclude_frozen_parameters``: only the parameters the
        optimizer updates (a LoRA fine-tune's adapters) and the buffers."""
        from infinity.checkpoint.model16 import save_16bit

        self.distributed.check_call("save_16bit_model")
        self.check_states_here("save_16bit_model", ("lp_params",))
        self.finish_step()
        if self.stage3 is not None and not self.config.zero.stage3_gather_16bit_weights_on_model_save:
            logger.warning(
                "save_16bit_model: nothing saved; at stage 3 it needs "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save true"
            )
            return False
        save_16bit(self, save_dir, save_filename, exclude_frozen_parameters=exclude_frozen_parameters)
        return True

    # ---- checkpoints (infinity/checkpoint) ----
    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:  # fmt: skip
        """Collective: saves everything needed to resume exactly (weights and fp32 masters, optimizer states,
        scheduler, loss scaler, counters, data loader position, RNG, ``client_state``) as a universal Zarr
        checkpoint ``<save_dir>/<tag>`` (tag default ``global_step<N>``), written in parallel by every rank
        ([Note: crash-safe save] in checkpoint/save.py); ``latest`` names it. Only between optimizer steps.
        ``exclude_frozen_parameters``: without the parameters the optimizer does not update (a LoRA fine-tune's
        base); a load keeps the loading run's own values of those."""
        from infinity.checkpoint.save import save_engine

        self.distributed.check_call("save_checkpoint")
        self.check_states_here("save_checkpoint", ("optim_states", "hp_params", "lp_params"))
        self.finish_step()
        if self.micro_steps % self.config.gradient_accumulation_steps != 0 or self._backward_pending:
            raise CheckpointError(
                f"save_checkpoint called in the middle of gradient accumulation (micro-step {self.micro_steps}, "
                f"gradient_accumulation_steps {self.config.gradient_accumulation_steps}, a backward not yet "
                "stepped): the gradients accumulated so far are not saved. Save right after the engine.step() "
                "that ends a boundary"
            )
        self._drop_kept_buffers()
        self.last_checkpoint = save_engine(self, save_dir, tag, client_state, save_latest,
                                           exclude_frozen_parameters=exclude_frozen_parameters)
        return True

    def _drop_kept_buffers(self) -> None:
        """Before a checkpoint's own transfers: the step's buffers kept for the next step (stage 3's gradient
        buckets, outsized NVMe pieces' host buffers) go back, so that the two do not share the peak; the next
        step makes them again."""
        if self.zero_optimizer is not None:
            self.zero_optimizer.reducer.drop_spares(all_of_them=True)
        if self.stage3 is not None:
            self.stage3.table.shards.drop_spares()

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, *, weights_only: bool = True):  # fmt: skip
        """Collective: loads ``<load_dir>/<tag>`` (default: the tag ``latest`` names) into this engine, whatever
        world size, stage or offload mode saved it. Returns (path, client_state), or (None, None) when
        ``load_dir`` has no ``latest``. ``load_module_strict`` is accepted for DeepSpeed's signature: every
        parameter of the model must be in the checkpoint. ``weights_only`` (infinity's, as torch.load's): the
        checkpoint's pickled files are read without running code; False only for a checkpoint you trust
        (checkpoint/pickled.py)."""
        self.check_states_here("load_checkpoint")
        if self.zero_optimizer is not None and self.zero_optimizer.abandon_backward_step():
            # a backward stopped part way after stepping some units: the load replaces it all
            self._backward_pending = False
        self.finish_step()
        from infinity.checkpoint.load import load_engine

        self.distributed.check_call("load_checkpoint")
        self._drop_kept_buffers()
        return load_engine(
            self, load_dir, tag, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            weights_only=weights_only,
        )  # fmt: skip

    def _dataloader(self, training_data, collate_fn):
        """DeepSpeed's training loader: at every world size a DistributedSampler (shuffled, seed 0) gives this rank
        its share, dropping the tail so that every rank sees as many full micro-batches, and each pass over the
        data reshuffles (sampler.set_epoch() chooses the epoch)."""
        if training_data is None or isinstance(training_data, torch.utils.data.DataLoader):
            return training_data
        batch = {"batch_size": self.config.train_micro_batch_size_per_gpu, "collate_fn": collate_fn, "drop_last": True}
        if isinstance(training_data, torch.utils.data.IterableDataset):
            if self.comm.world_size > 1:
                raise ConfigError(
                    "training_data is an IterableDataset, which cannot be split across ranks by a sampler; pass a "
                    "DataLoader whose dataset yields each rank's share"
                )
            return torch.utils.data.DataLoader(training_data, **batch)
        sampler = _EpochSampler(
            training_data, num_replicas=self.comm.world_size, rank=self.comm.rank, shuffle=True, seed=0, drop_last=True
        )
        # Its own generator (seeded from the global one, once): each pass draws its workers' base seed from it, not
        # from the global RNG, so a checkpoint's RNG state resumes dropout and the like exactly.
        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, ()).item()))
        return _TrainingDataLoader(training_data, sampler=sampler, generator=generator, **batch)

    @property
    def destroyed(self) -> bool:
        """True once destroy() has run: the engine's hooks and process groups are gone."""
        return self.distributed.closed

    def destroy(self) -> None:
        """Collective (every rank calls it): finishes what is in flight, removes the engine's hooks, and tears
        down the process groups it created ([Note: teardown] in distributed.py). Also runs at interpreter exit
        for an engine still alive then, so a script may simply end."""
        self.drop_offloaded_states()
        _remove_hooks(self.zero_optimizer, self.stage3)
        self.distributed.close()
        trim_heap()  # the freed blocks the heap policy kept for the next step (memory/host.py)
