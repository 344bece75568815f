"""DeepSpeed's engine methods that change training state between steps: zero_grad, set_train_batch_size,
set_gradient_accumulation_boundary, empty_partition_cache, offload_states and reload_states. A mixin of Engine
(engine.py), kept apart so the engine's module stays about forward, backward and step."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from infinity.errors import ConfigError, StatesOffloadedError
from infinity.memory.parking import Parking
from infinity.memory.tiers import Tier

logger = logging.getLogger("infinity")

# DeepSpeed's OffloadStateTypeEnum values
STATE_KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")
OFFLOAD_DEVICES = ("cpu", "nvme")


def _kind_name(value) -> str:
    """A DeepSpeed enum member or its value."""
    return str(getattr(value, "value", value))


class EngineControls:
    """Mixed into Engine: it provides config, comm, micro_steps, global_steps, zero_optimizer, stage3 and
    ``_backward_pending``."""

    _boundary_override: bool | None = None
    _parked: dict[str, Parking] | None = None  # offload_states: what is away, by state kind
    _parked_params: list = []  # (parameter, its data) pointed at placeholders while lp_params is away

    def zero_grad(self) -> None:
        """DeepSpeed's: the model's ``.grad`` fields go to None. The gradient ZeRO accumulates over the window is
        the engine's, as in DeepSpeed, and stays: a loop that calls zero_grad() after every micro-step still
        steps on the whole window. (Here ``.grad`` is None already: each gradient moves into the engine's buffers
        as it is made.)"""
        for param in self.module.parameters():
            param.grad = None

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: a new global batch size, reached by changing gradient_accumulation_steps (the micro-batch
        stays). Between optimizer steps only: the window in progress would otherwise be cut to another length."""
        micro, world = self.config.train_micro_batch_size_per_gpu, self.comm.world_size
        if not isinstance(train_batch_size, int) or train_batch_size < 1 or train_batch_size % (micro * world):
            raise ValueError(
                f"set_train_batch_size({train_batch_size!r}): the batch size must be a positive multiple of "
                f"train_micro_batch_size_per_gpu x world size = {micro} x {world} = {micro * world}"
            )
        self._check_between_steps("set_train_batch_size")
        accumulation = train_batch_size // (micro * world)
        self.config = dataclasses.replace(self.config, train_batch_size=train_batch_size,
                                          gradient_accumulation_steps=accumulation)  # fmt: skip
        self.micro_steps = self.global_steps * accumulation  # a window boundary under the new length
        logger.info("train batch size now %d (gradient_accumulation_steps %d)", train_batch_size, accumulation)

    def _check_between_steps(self, call: str) -> None:
        """A batch size changes between optimizer steps only: the window in progress would be cut otherwise."""
        if self._backward_pending or self.micro_steps % self.config.gradient_accumulation_steps:
            raise ValueError(f"{call} in the middle of gradient accumulation: call it right after the engine.step() "
                             "that ends a window")  # fmt: skip

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's: overrides whether the next backward ends the accumulation window, for a loop that runs
        its passes and then calls step() once. Set it before each forward/backward; True before the last."""
        if not isinstance(is_boundary, bool):
            raise ValueError(f"set_gradient_accumulation_boundary takes True or False, got {is_boundary!r}")
        self._boundary_override = is_boundary

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def _after_boundary_step(self) -> None:
        """With the boundary set by hand, the micro-step count follows the windows it ended (save_checkpoint
        and set_train_batch_size check that the count sits on a boundary)."""
        if self._boundary_override is not None:
            self.micro_steps = self.global_steps * self.config.gradient_accumulation_steps

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: releases every gathered stage-3 unit (as after a pass; the persistent one stays) and
        gives back the memory kept for the next gathers and reductions, and a gradient kept across steps
        ([Note: gradient kept across steps]) between windows."""
        if self.zero_optimizer.gradients_in_memory is not None:
            self.zero_optimizer.gradients_in_memory.release()
        if self.stage3 is None:
            return
        coordinator = self.stage3.coordinator
        if coordinator.in_pass:
            coordinator.end_pass()
        self.stage3.table.pool.clear()
        self.stage3.table.shards.drop_spares()
        self.zero_optimizer.reducer.drop_spares(all_of_them=True)

    # ---- DeepSpeed's offload_states / reload_states ([Note: parking] in memory/parking.py) ----
    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False,
                       nvme_path: str | os.PathLike | None = None) -> None:  # fmt: skip
        """DeepSpeed's: moves training state off the compute device between phases (an RLHF loop's generation),
        until reload_states(). ``include``: DeepSpeed's OffloadStateTypeEnum members or their values
        (optim_states, hp_params, lp_params, lp_grads, contiguous_grad_buffer; default all); a kind away already
        stays where it is. ``device``: "cpu" (pinned host memory where CUDA exists; on a CPU-only machine the
        states are there already) or, here also, "nvme": a file in ``nvme_path`` (default: the config's offload
        nvme_path), host-resident states included, so host memory is freed too. Masters and optimizer states
        offloaded together share their tiles: naming either moves both. As DeepSpeed, the gathered-parameter cache
        is emptied first and CUDA's cached blocks are released after. ``non_blocking`` is accepted; the copies
        complete before this returns."""
        kinds = self._offload_kinds(include)
        target = _kind_name(device)
        if target not in OFFLOAD_DEVICES:
            raise ConfigError(f"offload_states: device must be 'cpu' or 'nvme', got {device!r}")
        self.finish_step()  # the step's last units write the states and pieces this parks
        if self._backward_pending:
            raise ConfigError("offload_states between backward and step: the gradient would be lost; call it "
                              "after engine.step()")  # fmt: skip
        self.empty_partition_cache()  # also the spare gradient buffers (lp_grads, contiguous_grad_buffer)
        path = self._parking_path(nvme_path) if target == "nvme" else None
        away = dict(self._parked or {})
        chosen: dict[str, list[torch.Tensor]] = {}
        seen: set[int] = set()
        for kind in ("optim_states", "hp_params", "lp_params"):
            if kind in kinds and kind not in away:
                chosen[kind] = []
                for tensor in self._state_tensors(kind, nvme=path is not None):
                    storage = tensor.untyped_storage()
                    if (path is None and tensor.device.type == "cpu") or storage.nbytes() == 0:
                        continue  # in host memory already, empty, or away with another kind
                    if storage.data_ptr() not in seen:  # a storage shared by two kinds goes with the first
                        seen.add(storage.data_ptr())
                        chosen[kind].append(tensor)
        placeholders = self._placeholders(chosen.get("lp_params", []))
        parked: dict[str, Parking] = {}
        try:
            for kind, tensors in chosen.items():
                parking = Parking(tensors, path=f"{path}.{kind}" if path else None, aio=self.config.aio,
                                  pin_memory=pin_memory)  # fmt: skip
                parking.park()
                parked[kind] = parking
        except BaseException:
            for parking in parked.values():
                parking.reload()
            raise
        for param, _ in placeholders:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._parked = {**away, **parked}
        self._parked_params = getattr(self, "_parked_params", []) + placeholders
        self._flag_parked()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the freed device memory to other processes, as DeepSpeed does
        moved = sum(p.nbytes for p in parked.values())
        logger.info("offload_states: %s moved to %s (%.1f MiB)", ", ".join(sorted(parked)) or "nothing",
                    target, moved / 2**20)  # fmt: skip

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's: brings back what offload_states() moved, in place (every view stays valid). A kind whose
        reload fails stays away, with its file, and the error is raised: call reload_states() again."""
        for kind in list(self._parked or {}):
            self._parked[kind].reload()
            del self._parked[kind]
            if kind == "lp_params":
                for param, data in self._parked_params:
                    param.data = data
                self._parked_params = []
        self._flag_parked()

    def drop_offloaded_states(self) -> None:
        """destroy(): what offload_states() parked is not needed any more; its files go."""
        parked, self._parked = self._parked or {}, None
        for parking in parked.values():
            parking.discard_file()

    def check_states_here(self, use: str, kinds: tuple[str, ...] = ("optim_states", "hp_params", "lp_params")
                          ) -> None:  # fmt: skip
        """A forward needs the weights, a step the optimizer's states: offloaded ones are a clear error."""
        away = [kind for kind in kinds if self._parked and kind in self._parked]
        if away:
            raise StatesOffloadedError(f"{use} while offload_states() has {', '.join(away)} away: call "
                                       "engine.reload_states() first")  # fmt: skip

    def _placeholders(self, tensors: list[torch.Tensor]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """The model's parameters whose memory is among ``tensors``: they point at empty placeholders while it is
        away (a read of a view of a parked storage would read freed memory)."""
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        return [(p, p.data) for p in self.module.parameters()
                if p.numel() > 0 and p.untyped_storage().data_ptr() in storages]  # fmt: skip

    def _flag_parked(self) -> None:
        """The tier managers and stage 3's shards refuse I/O on parked memory (a clear error, not a crash)."""
        parked = self._parked or {}
        tiled = self.zero_optimizer.tiled
        if tiled is not None:
            tiled.manager.parked = "optim_states" in parked or "hp_params" in parked
        if self.stage3 is not None:
            self.stage3.table.shards.parked = "lp_params" in parked

    def _offload_kinds(self, include) -> set[str]:
        if include is None:
            return set(STATE_KINDS)
        kinds = {_kind_name(item) for item in include}
        unknown = sorted(kinds - set(STATE_KINDS))
        if unknown:
            raise ConfigError(f"offload_states: unknown state {unknown}; use {', '.join(STATE_KINDS)}")
        return kinds

    def _parking_path(self, nvme_path) -> str:
        folder = nvme_path
        if folder is None:
            zero = self.config.zero
            folder = zero.offload_optimizer.nvme_path or zero.offload_param.nvme_path
        if not folder:
            raise ConfigError("offload_states(device='nvme') needs a folder: pass nvme_path=, or set "
                              "zero_optimization.offload_optimizer.nvme_path")  # fmt: skip
        return os.path.join(os.fspath(folder), f"infinity-parked-{os.getpid()}-rank{self.comm.rank}")

    def _state_tensors(self, kind: str, *, nvme: bool) -> list[torch.Tensor]:
        optimizer = self.zero_optimizer
        if kind in ("optim_states", "hp_params"):
            if optimizer.tiled is not None:  # masters and states share each tile's segment
                return optimizer.tiled.manager.home_tensors({Tier.DEVICE, Tier.HOST} if nvme else {Tier.DEVICE})
            if kind == "hp_params":
                return [] if optimizer.masters_are_weights else list(optimizer.masters)
            return [value for state in optimizer.optimizer.state.values() for value in state.values()
                    if torch.is_tensor(value) and value.dim() > 0]  # fmt: skip
        if self.stage3 is not None:  # lp_params: the rank's pieces, and the always-gathered persistent unit
            table = self.stage3.table
            return table.shards.held_tensors() + [unit.full for unit in table.units if unit.persistent]
        return [flat for weights in optimizer.weights for flat in weights]
