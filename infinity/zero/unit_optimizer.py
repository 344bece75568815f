"""ZeRO stage 3 on the shared partitioned step (optimizer.py): the rank's shard is its pieces of every unit, the
masters and states tiles of those pieces, the new weights written straight into the pieces.

[Note: step behind forward]
With the optimizer on NVMe, a step inside engine.step() reads and writes every tile (12 bytes an element each way
in fp32) while nothing else runs: on GPT-2 small the forward and backward take ~1.6 s, and the step ~0.85 s, of
which ~0.7 s waiting for reads. Yet the step of one unit's tiles is needed by nothing until the next forward first
uses that unit. So engine.step() does what needs the whole gradient (unscaling, the overflow check, the global
norm and clipping) and fixes the rest: the hyperparameters (copied: a scheduler or the user changing the learning
rate afterwards acts on the next step, as it would after an eager step), the gradient factors and the step
counts. Each unit's tiles then step when its piece is first used (``UnitShards.before_use``: a gather in the next
forward, a GatheredParameters block, a save), reading the next units' tiles ahead along the order the last such
step took them in, so the tiles' reads and writes run while the forward computes the units before. The forward
prefetches a unit not yet stepped only when it is the next one (gathering it steps it: compute a prefetch bucket
ahead would run before the forward could). Whatever reads or replaces the whole state first finishes the step:
the next backward (the gradient is still the step's), a checkpoint save or load, the partitioned-state helpers,
offload_states, module_state_dict, a visit of the tiles. The units a forward does not use (an unused branch) are
stepped by the next backward. Each tile runs the same kernel on the same values as in the eager step, so the
results are bitwise the same (tests/distributed/test_step_behind_forward.py); the step's compute moves into the
forward's timing, and the gradient is freed when the last unit has stepped (the reduction's spare buffers, which
the step does not read, go in engine.step(): reducer.py's drop_spares). Split masters and optimizer classes
that keep state of their own between tiles step in engine.step() (``infinity.step_behind_forward``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn

from infinity.comm import Comm
from infinity.errors import ConfigError, InfinityError
from infinity.memory.tiers import Tier, TierManager
from infinity.zero.backward_step import KEY as STEP_IN_BACKWARD
from infinity.zero.backward_step import BackwardStep, can_step_in_backward, hyperparameters, refusal
from infinity.zero.elementwise import has_step_pre_hooks
from infinity.zero.grads import SwappedGradients, piece_squares
from infinity.zero.optimizer import Offload, PartitionedOptimizer, gradient_shards_for
from infinity.zero.partition import overlap
from infinity.zero.reducer import GradientReducer
from infinity.zero.tiles import Tile
from infinity.zero.units import Unit, UnitTable


class UnitOptimizer(PartitionedOptimizer):
    """Stage 3: the rank's shard is the concatenation of its pieces of every unit ([Note: units] in units.py).

    Units follow modules, optimizer param groups follow the user: a unit can hold parameters of several groups
    (a Linear's weight with decay, its bias without). The masters and states are tiles ([Note: tiles] in
    tiles.py): runs of one group's elements inside one unit piece, so a tile's gradient is a view of the reduced
    gradient shard and its new weights go straight into the unit's piece. Without offload the tiles live in
    device memory; offloaded, in host memory or on NVMe: the same tiles step either way."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        comm: Comm,
        table: UnitTable,
        compute_dtype: torch.dtype,
        device: torch.device,
        overlap_comm: bool,
        offload: Offload | None,
        sub_group_size: int,
        on_param_grad: Callable[[int], None],
    ) -> None:
        """``on_param_grad(unit)``: a parameter of the unit has its gradient, or gets none this backward (the
        coordinator releases units on it). Trainable parameters outside the optimizer behave as frozen."""
        self.optimizer = optimizer
        self.comm = comm
        self.stage = 3
        self.device = device
        self.table = table
        self.compute_dtype = compute_dtype
        groups = [list(g["params"]) for g in optimizer.param_groups]
        self.groups: list[list[nn.Parameter]] = groups  # the user's param groups (their lists hold tiles now)
        expected = [0] * len(table.units)
        owner: dict[int, int] = {}
        for g, params in enumerate(groups):
            for param in params:
                found = table.unit_of(param)
                if found is None:
                    raise ConfigError("an optimizer parameter is not a parameter of the model; pass model.parameters()")
                if owner.setdefault(id(param), g) != g:
                    raise ConfigError(f"a parameter appears in optimizer param groups {owner[id(param)]} and {g}")
                expected[found[0].index] += 1
        # Tiles follow the shard itself (no gather of the masters; gradients and weights are views), in device
        # memory without offload: offloaded or not, the same tiles step, so the results are the same.
        masters = None
        if offload is None:
            manager = TierManager(device=device)
            offload = Offload(manager, Tier.DEVICE, sub_group_size, pipeline_read=True, pipeline_write=True)
            if compute_dtype == torch.float32 and table.shards.home is Tier.DEVICE:
                masters = self._tile_weight  # the fp32 shard is the master ([Note: tiles] in tiles.py)
        self.tiled = self._make_tiled(optimizer, _unit_runs(table, owner, comm.rank), offload, masters)
        self._offload_home = offload.home
        self.gradients: SwappedGradients | None = None
        self._grad_factors: list[float] = []
        if offload.gradients is not None:
            offsets = {unit.index: unit.bucket.shard_offset for unit in table.units}
            self.gradients = SwappedGradients(self.tiled.tiles, offload.gradients, unit_offsets=offsets,
                                              dtype=offload.gradient_dtype)  # fmt: skip
            self.tiled.gradients = self.gradients
            self.gradients_in_memory = None  # [Note: swapped gradients]
        else:
            self.gradients_in_memory = gradient_shards_for([table.layout], device, offload)
        self._tiles_of_unit: dict[int, list[Tile]] = {}
        for tile in self.tiled.tiles:
            self._tiles_of_unit.setdefault(tile.piece, []).append(tile)
        # Units whose tiles cover every element of the rank's piece that holds a parameter: the step writes the
        # whole piece, so an offloaded one is not read back first.
        self._tiles_cover = {
            unit for unit, tiles in self._tiles_of_unit.items()
            if sum(t.numel for t in tiles) == table.shards.held_numel(unit)
        }  # fmt: skip
        self._tiles_as_parameters()  # they share the tiles' memory: initialize_piece fills both
        self._last_tile = {t.piece: t.index for t in self.tiled.tiles}
        # [Note: step behind forward]: whether the step runs unit by unit as the next forward gathers them, the
        # units still to step (in the order they are expected), and the order the last such step took them in
        self.steps_behind_forward = False  # set_step_behind_forward() turns it on
        self._pending: dict[int, list[Tile]] = {}
        self._stepping: int | None = None  # the unit whose tiles are stepping now
        self._unit_order: list[int] = list(self._tiles_of_unit)
        self._taken: list[int] = []
        self.masters = []
        self._read_piece: tuple[tuple[int, int], torch.Tensor] | None = None  # _tile_current_weight's copy
        self.reducer = GradientReducer(
            comm=comm, stage=3, layouts=(table.layout,), gradients=self.gradients_in_memory, shard_rank=comm.rank,
            device=device, overlap_comm=overlap_comm, expected=expected, max_in_flight=None,
            deliver=self._deliver,
        )  # fmt: skip
        # [Note: step in backward] in backward_step.py: whether it may, and the step being taken in this backward
        self.steps_in_backward = False  # set_step_in_backward() turns it on
        self._step_in_backward_required = False  # the key was true: a backward that cannot take it is an error
        self.steps_taken_in_backward = 0
        self._backward_step: BackwardStep | None = None
        self._landing: torch.Tensor | None = None  # a device piece's host copy (reused), which the tiles read
        self._hooks = []
        self._no_grad_marks = {}
        self.grad_params_per_unit = [0] * len(table.units)
        for params in groups:
            for param in params:
                unit, position = table.unit_of(param)
                hook = self._make_hook(unit.index, unit.bucket.slots[position].offset, on_param_grad)
                self._hooks.append(param.register_post_accumulate_grad_hook(hook))
                self._no_grad_marks[id(param)] = functools.partial(self._no_grad, unit.index, on_param_grad)
                self.grad_params_per_unit[unit.index] += 1
        for unit in table.units:
            orphans = [p for p in unit.params if p.requires_grad and id(p) not in owner]
            self._track_frozen(orphans, functools.partial(on_param_grad, unit.index))
            self.grad_params_per_unit[unit.index] += len(orphans)

    def initialize_piece(self, unit: Unit, piece: torch.Tensor) -> None:
        """The unit's piece arrived (``fill_units``, fp32): its tiles' masters start from it."""
        for tile in self._tiles_of_unit.get(unit.index, ()):
            first = tile.start - unit.bucket.shard_offset
            self.tiled.initialize(tile, piece[first : first + tile.numel])

    def _make_hook(self, unit_index: int, offset: int, on_param_grad: Callable[[int], None]):
        reducer = self.reducer

        def hook(param: torch.Tensor) -> None:
            if param.grad is None:  # a custom function returned None for it: no gradient this backward
                reducer.on_no_grad(unit_index)
            else:
                reducer.on_grad(unit_index, offset, param.grad)
                param.grad = None
            on_param_grad(unit_index)

        return hook

    def _no_grad(self, unit_index: int, on_param_grad: Callable[[int], None]) -> None:
        self.reducer.on_no_grad(unit_index)
        on_param_grad(unit_index)

    def _tile_grad(self, tile: Tile) -> torch.Tensor:
        if self._backward_step is not None and self._backward_step.gradient is not None:
            unit, piece = self._backward_step.gradient  # [Note: step in backward]
            first = tile.start - self.table.layout.buckets[unit].shard_offset
            return piece[first : first + tile.numel]
        return self.grad_shards[0][tile.start : tile.start + tile.numel]

    def _deliver(self, unit: int, piece: torch.Tensor) -> None:
        """Unit ``unit``'s reduced piece: its tiles step now (in a backward taking the step), or it goes to NVMe
        ([Note: swapped gradients] in grads.py), or into the gradient in memory."""
        if self._backward_step is not None:
            self._step_in_backward(unit, piece)
        elif self.gradients is not None:
            self.gradients.deliver(unit, piece)
        else:  # the window's first piece is copied, later ones added ([Note: gradient shards])
            self.gradients_in_memory.write(0, self.table.layout.buckets[unit].shard_offset, piece)

    def begin_backward(self, loss: torch.Tensor, *, boundary: bool, loss_scale: float = 1.0) -> None:
        if self._backward_step is not None:
            raise InfinityError(
                f"engine.backward() ran again before engine.step(), after a backward that took the optimizer step "
                f"({self._backward_step.describe()}; {STEP_IN_BACKWARD} is on where nothing needs the whole "
                "gradient): call engine.step() after each backward. To add up several backward passes set "
                f'gradient_accumulation_steps, or set "infinity": {{"step_in_backward": false}}. A backward that '
                "stopped part way left the model between two steps: load the last checkpoint"
            )
        self.finish_step()  # the last step's gradient is still read by units not stepped yet
        if self.gradients is not None:
            self.gradients.begin_backward(boundary=boundary, loss_scale=loss_scale)
        if self._steps_in_this_backward(boundary=boundary, loss_scale=loss_scale):
            # the units step as backward reduces them: last unit first
            self.tiled.begin_step(self.optimizer.param_groups, order=self.tiled.tiles[::-1], deferred=True)
            self._backward_step = BackwardStep(units=frozenset(self._tiles_of_unit),
                                               settings=hyperparameters(self.optimizer.param_groups))  # fmt: skip
        super().begin_backward(loss, boundary=boundary, loss_scale=loss_scale)

    # ---- [Note: step in backward] in backward_step.py ----
    def set_step_in_backward(self, wanted: bool | None, *, clip_norm: float, loss_scaling: bool) -> None:
        """infinity.step_in_backward (None: where it can; True: refused where it cannot; False: never)."""
        rule = self.tiled.rule
        why_not = can_step_in_backward(
            offloaded_to_host=self._offload_home is Tier.HOST and self.gradients is None, clip_norm=clip_norm,
            loss_scaling=loss_scaling, driven_by_tiles=rule.update is not None and rule.stepper is None,
            split_masters=self.tiled.splitter is not None,
        )  # fmt: skip
        if wanted and why_not is not None:
            raise ConfigError(refusal(why_not))
        self.steps_in_backward = why_not is None and wanted is not False
        self._step_in_backward_required = bool(wanted)

    def _steps_in_this_backward(self, *, boundary: bool, loss_scale: float) -> bool:
        """This backward takes the step: it ends a window of one backward (with gradients added up over several,
        the earlier ones are held anyway), and no step pre-hook must run before the step (it would run late)."""
        if not (self.steps_in_backward and boundary and loss_scale == 1.0):
            return False
        why_not = None
        if self.gradients_in_memory.has_pieces:
            why_not = "this window's earlier backward passes hold their gradient (gradient_accumulation_steps > 1)"
        elif has_step_pre_hooks(self.optimizer):
            why_not = "an optimizer step pre-hook is registered, which must run before the step"
        if why_not is not None and self._step_in_backward_required:
            raise InfinityError(refusal(why_not))
        return why_not is None

    @property
    def gradient_taken_by_step(self) -> bool:
        """The boundary's backward took the step: the gradient went with it (the gradient helpers refuse)."""
        return self._backward_step is not None

    def _step_in_backward(self, unit: int, piece: torch.Tensor) -> None:
        step = self._backward_step
        tiles = self._tiles_of_unit.get(unit)
        if tiles is None:  # trainable parameters outside the optimizer only: nothing steps
            return
        piece = self._on_host(piece)
        step.squares[unit] = piece_squares(piece)  # as the flat gradient's piece in host memory gives it
        step.gradient = (unit, piece)
        try:
            with _outside_the_forward():
                self.tiled.step_tiles(tiles, self._commit_after_last_tile)
        finally:
            step.gradient = None
        step.stepped.add(unit)

    def _on_host(self, piece: torch.Tensor) -> torch.Tensor:
        """A piece reduced on an accelerator, copied into a reused host buffer (pinned as the gradient would
        be): the tiles step in host memory, and the norm is taken there as the flat gradient's would be."""
        if piece.device.type == "cpu":
            return piece
        if self._landing is None:
            widest = max(bucket.piece_numel for bucket in self.table.layout.buckets)
            self._landing = torch.empty(widest, dtype=torch.float32, pin_memory=self.gradients_in_memory.pinned)
        host = self._landing[: piece.numel()]
        host.copy_(piece)  # waits for it: the tiles read it now
        return host

    def _end_backward_step(self) -> None:
        """The step taken in backward counts: its step counts, the persistent units regathered (every rank calls
        this at the same point: engine.step())."""
        step = self._backward_step
        if not step.complete:
            raise InfinityError(
                f"the backward that was taking the optimizer step ({STEP_IN_BACKWARD}) stopped part way "
                f"({step.describe()}): the model is between two steps. Load the last checkpoint to go on "
                "(engine.load_checkpoint)"
            )
        self._check_settings(step)
        self.tiled.end_step()
        step.ended = True
        self.steps_taken_in_backward += 1
        self._regather_persistent()

    def _check_settings(self, step: BackwardStep) -> None:
        changed = step.changed_setting(self.optimizer.param_groups)
        if changed is not None:
            raise InfinityError(
                f"{changed}: the optimizer step ran in backward ({STEP_IN_BACKWARD}) with the setting then. "
                "Change hyperparameters before engine.backward() (a scheduler after engine.step() is fine), "
                'or set "infinity": {"step_in_backward": false}'
            )

    def abandon_backward_step(self) -> bool:
        if self._backward_step is None:
            return False
        self._backward_step = None
        self.tiled.abandon_step()
        self.table.shards.commit_all()
        self.reducer.abandon_backward()
        return True

    def _scale_grads(self, factor: float) -> None:
        if self.gradients is not None:
            self._grad_factors.append(factor)  # applied per tile as it steps
        else:
            super()._scale_grads(factor)

    def global_grad_norm(self) -> float:
        self.finish_step()  # after engine.step() the gradient is gone, as with the whole step there
        return super().global_grad_norm()

    def _local_squares(self) -> torch.Tensor:
        """Per unit piece holding tiles, summed in unit order, wherever the gradient lives ([Note: swapped
        gradients] in grads.py), or was when its unit stepped in backward."""
        total = 0.0
        for unit in sorted(self._tiles_of_unit):
            if self._backward_step is not None:
                total += self._backward_step.squares.get(unit, 0.0)
            elif self.gradients is not None:
                total += self.gradients.squares.get(unit, 0.0)
            else:
                bucket = self.table.layout.buckets[unit]
                flat = self.grad_shards[0]
                total += piece_squares(flat[bucket.shard_offset : bucket.shard_offset + bucket.piece_numel])
        return torch.tensor([total], dtype=torch.float64, device=self.device)

    def _tile_weight(self, tile: Tile) -> torch.Tensor:
        """The tile's elements of its unit's piece, held writable until the unit's last tile (then committed).
        Split masters join with the piece's values: it is read first even where the step writes all of it."""
        first = tile.start - self.table.layout.buckets[tile.piece].shard_offset
        overwrite = tile.piece in self._tiles_cover and self.tiled.splitter is None
        piece = self.table.shards.edit(tile.piece, overwrite=overwrite)
        return piece[first : first + tile.numel]

    def _tile_current_weight(self, tile: Tile) -> torch.Tensor:
        """The tile's elements of its unit's piece as it is now: a copy of the piece, kept while the tiles of one
        unit are visited in turn (a checkpoint's blocks) and no piece is written, let go when the visit ends."""
        shards = self.table.shards
        key = (tile.piece, shards.version)
        if self._read_piece is None or self._read_piece[0] != key:
            self._read_piece = None  # the old copy goes before the new one is made
            self._read_piece = (key, shards.read(tile.piece))
        first = tile.start - self.table.layout.buckets[tile.piece].shard_offset
        return self._read_piece[1][first : first + tile.numel]

    def _step_tiles(self) -> None:
        if self._backward_step is not None:  # taken in backward, counted by finish_step()
            self._backward_step = None
            return
        if self.steps_behind_forward:
            self._defer_step()
            return
        # Split masters join with the pieces: read the next units' pieces ahead as the step goes, as the forward
        # does. Not from the end of backward: staged pieces hold ring buffers that anything editing a piece before
        # the step (a partitioned-state set, a checkpoint load) would wait for in vain.
        order = list(self._tiles_of_unit) if self.tiled.splitter is not None else []
        self._stage_pieces(order)

        def on_tile(tile: Tile) -> None:
            if self._commit_after_last_tile(tile) and order:
                self._stage_pieces(order[order.index(tile.piece) + 1 :])

        try:
            self.tiled.step(self.optimizer.param_groups, on_tile, self.optimizer, grad_factors=self._grad_factors)
        except BaseException:
            if order:
                self.table.shards.unstage_all()  # the ring's buffers back, for whatever runs next
            raise
        self._regather_persistent()

    # ---- [Note: step behind forward] ----
    def set_step_behind_forward(self, wanted: bool | None) -> None:
        """infinity.step_behind_forward (None: where it can, True: refused where it cannot): it can with torch's
        own kernels driven tile by tile (another class's step keeps state of its own between tiles) and masters
        that are not split (they join with pieces the step reads ahead itself)."""
        rule = self.tiled.rule
        can = rule.update is not None and rule.stepper is None and self.tiled.splitter is None
        if wanted and not can:
            raise ConfigError(
                f"infinity.step_behind_forward true: {type(self.optimizer).__name__}'s step cannot run unit by unit "
                "behind the forward (torch's Adam, AdamW and SGD can); drop the key"
            )
        self.steps_behind_forward = can and wanted is not False

    @property
    def step_pending(self) -> bool:
        return bool(self._pending)

    def _defer_step(self) -> None:
        """The step starts: its hyperparameters and factors are fixed now, its tiles step as their units are
        next used (the shards ask: ``_step_unit``), the persistent units' at once (they are regathered now)."""
        self.tiled.begin_step(self.optimizer.param_groups, self._grad_factors, order=self._expected_tiles(),
                              deferred=True)  # fmt: skip
        self._pending = {unit: self._tiles_of_unit[unit] for unit in self._unit_order}
        self._taken = []
        self.tiled.finish_pending = self.finish_step
        self.table.shards.before_use = self._step_unit
        self.table.shards.is_pending = self._pending.__contains__
        if not self._pending:
            self._end_deferred()
        self._regather_persistent()  # their gathers step them first

    def _step_unit(self, unit: int) -> None:
        """Before unit ``unit``'s piece is used: its tiles step now if they have not (the forward's gather, a
        save, a GatheredParameters block), then its piece is committed; the last unit ends the step. The unit
        stays pending until all its tiles have stepped: after a failure part way (a disk error, an interrupt in
        the forward), the next use steps the tiles left, and nothing counts the step as taken before."""
        tiles = self._pending.get(unit)
        if tiles is None or unit == self._stepping:  # not pending, or its own tiles' edits of its piece
            return
        self._stepping = unit
        try:
            with _outside_the_forward():
                self.tiled.step_tiles(tiles, self._commit_after_last_tile)
        finally:
            self._stepping = None
        del self._pending[unit]
        self._taken.append(unit)
        if not self._pending:
            self._end_deferred()

    def finish_step(self) -> None:
        """Steps every unit the step has not reached yet (before anything else reads the tiles or the gradient);
        a step taken in backward counts from here (engine.step(); the engine refuses the rest in between)."""
        if self._backward_step is not None and not self._backward_step.ended:
            self._end_backward_step()
        if self._stepping is not None and self._pending:
            raise InfinityError(
                f"the step behind the forward was asked to finish while unit {self._stepping}'s tiles were stepping "
                "(a bug: nothing that runs inside a tile's step may read the tiles)"
            )
        while self._pending:
            self._step_unit(next(iter(self._pending)))

    def _end_deferred(self) -> None:
        taken = set(self._taken)
        self._unit_order = self._taken + [unit for unit in self._unit_order if unit not in taken]
        self._unhook()
        self.tiled.end_step()
        self.zero_grad()

    def _unhook(self) -> None:
        self.table.shards.before_use = self.table.shards.is_pending = None
        self.tiled.finish_pending = None

    def _expected_tiles(self) -> list[Tile]:
        """The tiles in the order the next step is expected to take them: the units' order of the last one."""
        return [tile for unit in self._unit_order for tile in self._tiles_of_unit[unit]]

    def _commit_after_last_tile(self, tile: Tile) -> bool:
        """After a tile's weights are written: its unit's piece goes back once its last tile has stepped (an
        offloaded one behind the next tiles). Whether it did."""
        if tile.index != self._last_tile[tile.piece]:
            return False
        self.table.shards.commit(tile.piece)
        return True

    def prefetch_states(self, *, gradients: bool = True) -> None:
        """The first tiles' reads, in the order the step will take them: from the start of the boundary's
        backward when the step runs behind the forward (whose first unit waits for its tiles, with no compute to
        hide them), without their gradients (backward writes them); those at its end."""
        if self._backward_step is not None:
            return  # this backward took the step: the next one's tiles wait for the next backward
        if gradients or self.steps_behind_forward:
            self.tiled.prefetch(self._expected_tiles(), gradients=gradients)

    def close(self) -> None:
        self._pending.clear()  # a step not finished by now changes nothing anyone reads
        self._backward_step = None
        self._unhook()
        super().close()

    def _forget_current_weights(self) -> None:
        self._read_piece = None

    def _stage_pieces(self, units: list[int]) -> None:
        """Starts reading the pieces of ``units`` in order, as far as free staging buffers go (never blocking:
        the ones not staged are read when the step edits them)."""
        shards = self.table.shards
        if shards.flat is not None:
            return
        for unit in units:
            if not shards.stage(unit, for_edit=True):
                return

    def _regather_persistent(self) -> None:
        for unit in self.table.units:
            if unit.persistent:
                unit.gather(self.comm, self.table.shards, async_op=False)

    def load_unit_piece(self, unit: Unit, before: torch.Tensor) -> None:
        """The unit's shard was edited (GatheredParameters with modifier_rank; ``before``: the piece as it was):
        the masters of the elements whose value changed follow; the others keep their fp32 bits (a bf16 piece
        rounded them: rebuilding every master from it would lose them)."""
        if self.tiled.masters is not None:
            return  # the masters are the fp32 piece itself, edited already
        piece = self.table.shards.read(unit.index)
        start = unit.bucket.shard_offset

        def edit(tile: Tile, master: torch.Tensor) -> None:
            first = tile.start - start
            new, old = piece[first : first + tile.numel], before[first : first + tile.numel]
            changed = new != old
            master[changed] = new[changed].float()

        def weights(tile: Tile) -> torch.Tensor:
            first = tile.start - start
            return piece[first : first + tile.numel]

        self.tiled.edit_masters([t for t in self.tiled.tiles if t.piece == unit.index], edit, weights)

    def zero_grad(self) -> None:
        if self._backward_step is not None:  # engine.step() clears it before it gets here
            raise InfinityError(
                "optimizer.zero_grad() between engine.backward() and engine.step(): that backward took the optimizer "
                f"step ({STEP_IN_BACKWARD}, on where nothing needs the whole gradient), so there is no gradient "
                'left to clear; call engine.step() first, or set "infinity": {"step_in_backward": false}'
            )
        self.finish_step()  # optimizer.zero_grad() after engine.step(): the pending units step with the gradient
        self._grad_factors.clear()
        if self.gradients is not None:
            self.tiled.drop_gradients_ahead()
            self.gradients.zero()
        super().zero_grad()


def _outside_the_forward():
    """A step run from inside the user's forward computes as the step does anywhere: no autograd, no autocast,
    and its buffers are not inference tensors (a forward under torch.inference_mode)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    stack.enter_context(torch.autocast("cpu", enabled=False))
    if torch.cuda.is_available():
        stack.enter_context(torch.autocast("cuda", enabled=False))
    return stack


def _unit_runs(table: UnitTable, group_of: dict[int, int], rank: int) -> list[tuple[int, int, int, int]]:
    """(group, unit, start, numel) runs of the rank's flat shard: consecutive elements of optimized parameters
    of one group inside one unit piece (padding and parameters outside the optimizer are in none)."""
    runs: list[list[int]] = []
    for unit in table.units:
        start, end = unit.bucket.piece_range(rank)
        for slot, param in zip(unit.bucket.slots, unit.params, strict=True):
            group = group_of.get(id(param))
            part = overlap(slot, start, end)
            if group is None or part is None:
                continue
            first = unit.bucket.shard_offset + part[0] - start
            numel = part[1] - part[0]
            last = runs[-1] if runs else None
            if last is not None and last[0] == group and last[1] == unit.index and last[2] + last[3] == first:
                last[3] += numel
            else:
                runs.append([group, unit.index, first, numel])
    return [tuple(run) for run in runs]
