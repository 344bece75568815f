"""ZeRO-Inference: initialize() without an optimizer gives an InferenceEngine, DeepSpeed's way to run a model too
large for memory.

    engine, *_ = infinity.initialize(model=model, config=ds_config)   # no optimizer=, no "optimizer" section
    engine.module.eval()
    tokens = engine.module.generate(input_ids, max_new_tokens=16)     # or engine.generate(...), engine(batch)

At stage 3 the model is partitioned into units with the same hooks and fetch coordinator as training
(zero/stage3.py); with ``offload_param: {device: nvme}`` every rank's pieces live on NVMe and each forward streams
them through the staging ring unit by unit, read ahead along the recorded no-grad trace (zero/coordinator.py), so
a model larger than host memory generates text. Below stage 3 the model sits on the device in the compute dtype.
Nothing of training is made: no gradient buffers, no optimizer state, no loss scaler; backward(), step() and the
engine checkpoints are errors that say what to add. At world size > 1 under stage 3, generate() keeps the ranks
in step ([Note: synced generation] in generation.py).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from infinity.config import AUTO
from infinity.engine import Engine, _cast_inputs, _remove_hooks, claim_model
from infinity.errors import ConfigError
from infinity.memory.host import SetupTrim, trim_heap
from infinity.memory.offload import agree_run_id
from infinity.zero.coordinator import FetchStats
from infinity.zero.init import take_whole
from infinity.zero.stage3 import setup_stage3
from infinity.zero.units import fill_units

logger = logging.getLogger("infinity")

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
TO_TRAIN = 'pass optimizer= to infinity.initialize() or add an "optimizer" section to the config'


def is_inference(raw_config: Mapping[str, Any], optimizer) -> bool:
    """DeepSpeed's rule: no optimizer given and none configured means an engine for inference."""
    return optimizer is None and raw_config.get("optimizer") is None


def inference_config(raw_config: Mapping[str, Any]) -> tuple[dict, list[str]]:
    """The config as an inference engine reads it, and the keys it leaves out, so a training config runs unchanged
    (Transformers' evaluation without training removes only the optimizer): the batch keys size training only, so
    when none is set (or they are "auto", with nothing to fill them) a micro batch of 1 stands in; "scheduler",
    which DeepSpeed only builds with an optimizer, and an "auto" gradient_clipping are left out."""
    raw = dict(raw_config)
    if all(raw.get(key) in (None, AUTO) for key in BATCH_KEYS):
        for key in BATCH_KEYS:
            raw.pop(key, None)
        raw["train_micro_batch_size_per_gpu"] = 1
    unused = []
    if raw.pop("scheduler", None) is not None:
        unused.append("scheduler")
    if raw.get("gradient_clipping") == AUTO:
        unused.append(f"gradient_clipping={raw.pop('gradient_clipping')!r}")
    return raw, unused


class InferenceEngine(Engine):
    """An engine without an optimizer: forward and generate only. ``engine.module`` is the model, as in DeepSpeed."""

    def __init__(self, *, model: nn.Module, config, lr_scheduler=None, training_data=None, collate_fn=None) -> None:
        nn.Module.__init__(self)
        if lr_scheduler is not None:
            raise ConfigError(f"lr_scheduler= was given but no optimizer for it to drive; to train, {TO_TRAIN}")
        raw, unused = inference_config(config)
        self._join(model, raw, user_optimizer=None, training_data=training_data)
        zero = self.config.zero
        self.optimizer = self.zero_optimizer = self.lr_scheduler = None
        self.loss_scaler = None  # nothing is ever scaled
        self.stage3 = None
        self._fetch_stats = FetchStats()
        if zero.offload_optimizer.enabled:
            unused.append("zero_optimization.offload_optimizer")
        if unused and self.comm.rank == 0:
            logger.info("inference engine: no optimizer, so these settings are unused: %s", ", ".join(unused))
        if zero.stage == 3:
            self._partition_for_inference()
        else:
            for param in self.module.parameters():
                if param.is_floating_point():
                    param.data = param.data.to(dtype=self.compute_dtype)
        trim_heap()  # the model's own tensors, freed as they moved into the shards (infinity/memory/host.py)
        self._log_placement()
        weakref.finalize(self, _remove_hooks, None, self.stage3)  # a dropped engine lets go of the model
        if self.stage3 is None:
            claim_model(self.module, self, partitioned=False)
        self.training_dataloader = self._dataloader(training_data, collate_fn)
        self.global_steps = self.micro_steps = self.skipped_steps = 0
        self.last_grad_norm = None
        self._phase_seconds = {"forward": 0.0, "backward": 0.0, "step": 0.0}

    def _partition_for_inference(self) -> None:
        """Stage 3's units and hooks over the model, each rank's pieces in their home (device, host or NVMe);
        the values move in one unit at a time, as in training, with no optimizer masters to start."""
        zero = self.config.zero
        self._plan_run(None)  # the plan's sizes; a run the disk cannot hold fails here, before anything is written
        run_id = agree_run_id(self.comm) if zero.offload_param.device == "nvme" else None
        claim_model(self.module, self, partitioned=True)  # before any weight moves: also if the rest fails
        try:
            with self._setup_reservation():
                self.stage3 = setup_stage3(
                    self.module, distributed=self.distributed, zero=zero, dtype=self.compute_dtype,
                    device=self.device, make_shards=self._make_shards(run_id), training=False,
                )  # fmt: skip
                self._keep_generate_in_step()
                fill_units(self.stage3.table, comm=self.comm, full_value=take_whole, after_unit=SetupTrim())
        except BaseException:
            self._abandon(None)
            raise

    def _log_placement(self) -> None:
        if self.comm.rank != 0:
            return
        if self.stage3 is None:
            numel = sum(p.numel() for p in self.module.parameters())
            logger.info("inference engine (no optimizer), ZeRO stage %d: the whole model on %s in %s, %s parameters",
                        self.config.zero.stage, self.device, self.compute_dtype, f"{numel:,}")  # fmt: skip
            return
        units = sum(not unit.persistent for unit in self.stage3.table.units)
        where = self.config.zero.offload_param.device
        logger.info(
            "inference engine (no optimizer), ZeRO stage 3: %d units partitioned over %d ranks; parameters %s; "
            "rank 0 holds %s", units, self.comm.world_size,
            f"offloaded to {where}" if where != "none" else f"on {self.device}", self.stage3.table.shards.describe(),
        )  # fmt: skip

    # ---- inference ----
    def forward(self, *args, **kwargs):
        """The model's forward without gradients (no backward can follow): at stage 3 the pass ends with the
        root's forward, so the units are released and the next pass follows the recorded trace."""
        with torch.no_grad():
            return self.module(
                *_cast_inputs(args, self.compute_dtype, self.device),
                **_cast_inputs(kwargs, self.compute_dtype, self.device),
            )

    def generate(self, *args, **kwargs):
        """``module.generate`` (a transformers model's) with the inputs moved to the device; at stage 3 with
        world size > 1, synced_gpus defaults to True ([Note: synced generation] in generation.py)."""
        generate = getattr(self.module, "generate", None)
        if generate is None:
            raise ConfigError(f"engine.generate: the model ({type(self.module).__name__}) has no generate(); call "
                              "the engine (its forward) instead")  # fmt: skip
        return generate(*_cast_inputs(args, self.compute_dtype, self.device),
                        **_cast_inputs(kwargs, self.compute_dtype, self.device))  # fmt: skip

    def zero_stats(self) -> dict:
        """ZeRO-3 fetch telemetry of the forward passes since the last call (summed); empty below stage 3."""
        if self.stage3 is None:
            return {}
        return self.stage3.coordinator.take_step_stats().as_dict()

    # ---- what needs an optimizer ----
    def _no_optimizer(self, what: str):
        raise ConfigError(f"{what} on an inference engine: infinity.initialize() was given no optimizer (no "
                          f"optimizer= and no \"optimizer\" section in the config). To train, {TO_TRAIN}")  # fmt: skip

    def backward(self, loss, *args, **kwargs):
        self._no_optimizer("backward()")

    def step(self, *args, **kwargs) -> None:
        self._no_optimizer("step()")

    def get_lr(self) -> list[float]:
        self._no_optimizer("get_lr()")

    @property
    def loss_scale(self) -> float:
        return 1.0  # nothing is scaled

    def optimizer_state_bytes(self) -> int:
        return 0

    def save_checkpoint(self, *args, **kwargs) -> bool:
        self._no_optimizer("save_checkpoint() (a training checkpoint; save_16bit_model() saves the weights)")

    def load_checkpoint(self, load_dir=None, *args, **kwargs):
        """Refused, load_module_only=True included (the checkpoint loader maps arrays through the optimizer's
        partitions): the weights come in before initialize(), from safetensors."""
        raise ConfigError(
            f"load_checkpoint({load_dir!r}) on an inference engine is not supported, load_module_only=True "
            "included: turn the checkpoint into safetensors with `infinity ckpt to-fp32 CHECKPOINT OUT` and load "
            "the model from OUT (from_pretrained, or load_state_dict before infinity.initialize())"
        )
