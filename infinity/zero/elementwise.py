"""Any elementwise torch optimizer on tiles: its own step() run on one tile at a time, and the check that it is
elementwise.

[Note: elementwise optimizers]
ZeRO flattens parameters: the masters are pieces of flat buffers (1-D, cut where the buckets and ranks fall), and
offloaded they are tiles. An update that reads nothing but the element itself (Adam, Adagrad, RMSprop, Lion...)
gives the same numbers on a piece as on the whole parameter; one that reads the whole tensor (Adafactor's factored
moments and RMS scaling, LAMB's trust ratio, Muon's orthogonalization) would silently compute something else.
So an optimizer class other than torch's Adam, AdamW and SGD (whose kernels tiles.py drives directly) is first
tried on a probe: three steps on one 256-element tensor and on the same values cut in four tiles, bit-equal or
refused, naming the class. The check runs the same code path as the real step, so a user's own optimizer needs
no declaration: if its step is elementwise on a probe, it steps tiles.

A tile's step runs the class's own step() (below its hook wrapper: the user's step hooks run once per engine step,
around all the tiles, as for torch's Adam kernels driven in tiles.py) with the optimizer's param groups and state
swapped for one stand-in parameter: the tile's master as data, its gradient as grad, its state entries views of the
tile's segment. Per-element states live in the segment; the scalar entries ("step", NAdam's "mu_product", ASGD's
"eta" and "mu") are the same for every element of a group, so they are kept once per group: every tile starts the
step from the group's values and the group takes the new ones after its last tile. A state built in __init__
(Adagrad's "sum") must start at one constant per group, read from the optimizer before the engine clears its state;
a lazy state is built by the class's own first step on the tile and then copied into the segment. Entries a step
changes in the param group itself (a counter some classes keep there) are applied to the group once, after its last
tile: every tile steps from the group as the step began, and the probe checks that each piece changes it alike.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from infinity.errors import CheckpointError, ConfigError

logger = logging.getLogger("infinity")

PROBE_TILES = 4
PROBE_STEPS = 3

# Classes known not to be elementwise, with why (the probe would refuse them too, with a vaguer message).
NOT_ELEMENTWISE = {
    "Adafactor": "it factors the second moment over a 2-D parameter's rows and columns and scales each update by "
                 "the parameter's RMS",
    "LBFGS": "it needs a closure and searches along the whole model's gradient history",
    "SparseAdam": "it steps sparse gradients only",
    "Muon": "it orthogonalizes each 2-D parameter's update as a matrix",
    "Lamb": "it scales each parameter's update by a trust ratio over the whole parameter",
    "FusedLamb": "it scales each parameter's update by a trust ratio over the whole parameter",
}  # fmt: skip


def run_step_hooks(optimizer: torch.optim.Optimizer, *, post: bool) -> None:
    """The user's step hooks (global and the optimizer's), once per engine step, where the engine steps the
    optimizer's state without calling its step() (tiles); and the flag LR schedulers read to know a step ran."""
    from torch.optim import optimizer as torch_optimizer

    if post:
        optimizer._opt_called = True  # noqa: SLF001 - what torch's LR schedulers check before warning
        hooks = [*optimizer._optimizer_step_post_hooks.values(),
                 *getattr(torch_optimizer, "_global_optimizer_post_hooks", {}).values()]  # fmt: skip
    else:
        hooks = [*getattr(torch_optimizer, "_global_optimizer_pre_hooks", {}).values(),
                 *optimizer._optimizer_step_pre_hooks.values()]  # fmt: skip
    for hook in hooks:
        hook(optimizer, (), {})


def has_step_pre_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step pre-hook (global or the optimizer's) would run before the step."""
    from torch.optim import optimizer as torch_optimizer

    return bool(optimizer._optimizer_step_pre_hooks or getattr(torch_optimizer, "_global_optimizer_pre_hooks", None))


def raw_step(optimizer: torch.optim.Optimizer) -> Callable:
    """The class's step without torch's hook wrapper (which runs step hooks and counts calls)."""
    step = type(optimizer).step
    return step.__wrapped__ if getattr(step, "hooked", False) else step


@dataclass(slots=True)
class GroupStart:
    """How a param group's state starts: built in __init__ (constant per-element values and scalar entries) or by
    the first step (lazy)."""

    eager: bool = False
    fills: dict[str, float] = field(default_factory=dict)
    scalars: dict[str, object] = field(default_factory=dict)


def _clone(value):
    return value.clone() if torch.is_tensor(value) else value


def group_starts(optimizer: torch.optim.Optimizer) -> list[GroupStart]:
    """Each group's starting state, read from the optimizer as its __init__ left it (empty: lazy). A state that
    varies by element (the optimizer has stepped, or loaded a state dict) is not a start: ZeRO begins that group's
    state afresh, as DeepSpeed does (say so once; a checkpoint carries states over)."""
    starts = []
    for g, group in enumerate(optimizer.param_groups):
        start, stepped = GroupStart(), False
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            start.eager = True
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0:
                    first = value.reshape(-1)[0].item()
                    if not bool((value == first).all()) or start.fills.setdefault(key, first) != first:
                        stepped = True
                else:
                    start.scalars.setdefault(key, _clone(value))
                    stepped = stepped or (key == "step" and float(value) > 0)
        if stepped:
            logger.warning("%s already holds state for param group %d (has it stepped, or loaded a state dict?): "
                           "ZeRO starts its state afresh, as DeepSpeed does; load_checkpoint carries states over",
                           type(optimizer).__name__, g)  # fmt: skip
            start = GroupStart()
        starts.append(start)
    return starts


def seed_states(optimizer: torch.optim.Optimizer, starts: list[GroupStart]) -> None:
    """The optimizer's parameters are ZeRO's pieces now, its state cleared: a class that builds its state in
    __init__ gets it again, for the pieces, from each group's start (a lazy class builds it at its first step)."""
    for group, start in zip(optimizer.param_groups, starts, strict=True):
        if not start.eager:
            continue
        for param in group["params"]:
            state = {key: _clone(value) for key, value in start.scalars.items()}
            state.update({key: torch.full_like(param, fill) for key, fill in start.fills.items()})
            optimizer.state[param] = state


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared count as changed
        return False


def _changes(before: dict, after: dict) -> dict:
    """The param group's entries a step changed or added (a counter kept in the group, as some classes do)."""
    return {k: v for k, v in after.items() if k != "params" and (k not in before or not _same(before[k], v))}


class ElementwiseStep:
    """Steps one tile at a time with the optimizer's own step ([Note: elementwise optimizers])."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.starts = group_starts(optimizer)
        self.states, self.scalar_keys = _probe(self)
        self.scalars: list[dict[str, object]] = [{} for _ in optimizer.param_groups]  # after the last step
        self._next: list[dict[str, object] | None] = [None] * len(optimizer.param_groups)
        self._before: dict[int, dict] = {}  # per group: its entries as the step began (every tile starts there)
        self._group_changes: dict[int, dict] = {}  # per group: what the step changed in it, applied once
        self._step = raw_step(optimizer)

    # ---- one tile ----
    def _group_index(self, group: dict) -> int:
        for index, candidate in enumerate(self.optimizer.param_groups):
            if candidate is group:
                return index
        raise ValueError("the param group is not the optimizer's")

    def update(self, group: dict, master: torch.Tensor, grad: torch.Tensor, states: list[torch.Tensor],
               step: int) -> None:  # fmt: skip
        """The tile's step: ``states`` are its segment's views, in ``self.states`` order; ``step``: steps taken."""
        index = self._group_index(group)
        views = dict(zip(self.states, states, strict=True))
        state = self._state_before(index, views, step)
        before = self._before.setdefault(index, {k: _clone(v) for k, v in group.items() if k != "params"})
        after = self._run(before, master, grad, state)
        self._group_changes[index] = _changes(before, after)
        for name, view in views.items():
            value = state.get(name)
            if torch.is_tensor(value) and value.data_ptr() != view.data_ptr():
                view.copy_(value)  # built by the class (a lazy first step) or replaced, not updated in place
        self._next[index] = {k: v for k, v in state.items() if k not in views}

    def _state_before(self, index: int, views: dict[str, torch.Tensor], step: int) -> dict:
        start = self.starts[index]
        if step == 0 and not start.eager:
            return {}  # the class builds its state on its first step
        if step == 0:
            for name, view in views.items():
                view.fill_(start.fills.get(name, 0.0))
            scalars = start.scalars
        else:
            scalars = self.scalars[index]
        state = {k: _clone(v) for k, v in scalars.items()}
        state.update(views)
        return state

    def _run(self, group: dict, master: torch.Tensor, grad: torch.Tensor, state: dict) -> dict:
        """The class's step on one stand-in parameter, with a copy of ``group``'s entries; returns that copy as
        the step left it."""
        param = torch.nn.Parameter(master, requires_grad=True)  # shares the master's memory
        param.grad = grad
        optimizer = self.optimizer
        saved = optimizer.param_groups, optimizer.state
        alone = {**{k: _clone(v) for k, v in group.items() if k != "params"}, "params": [param]}
        optimizer.param_groups = [alone]
        optimizer.state = defaultdict(dict, {param: state})
        try:
            self._step(optimizer)
        finally:
            optimizer.param_groups, optimizer.state = saved
        return alone

    def begin(self) -> None:
        """Before a step's first tile."""
        self._next = [None] * len(self._next)
        self._before.clear()
        self._group_changes.clear()

    def finish(self) -> None:
        """After every tile of a step: each group takes its new scalar entries, and the step's changes to the
        param group's own entries (once, as one step on the whole would make them)."""
        for index, values in enumerate(self._next):
            if values is not None:
                self.scalars[index] = values
        for index, changes in self._group_changes.items():
            self.optimizer.param_groups[index].update(changes)
        self.begin()

    # ---- checkpoints ----
    def saved_scalars(self, group: int) -> dict:
        return {key: encode_scalar(value) for key, value in self.scalars[group].items()}

    def load_scalars(self, group: int, saved: dict, steps: int) -> None:
        """A checkpoint's scalar entries for the group (``steps`` taken); a group that has not stepped has none."""
        if steps == 0:
            self.scalars[group] = {}
            return
        missing = [k for k in self.scalar_keys if k not in saved and k != "step"]
        if missing:
            raise CheckpointError(f"the checkpoint keeps no {missing} for param group {group} of "
                                  f"{type(self.optimizer).__name__}; pass load_optimizer_states=False")  # fmt: skip
        values = {key: decode_scalar(entry) for key, entry in saved.items()}
        if "step" in self.scalar_keys and "step" not in values:
            values["step"] = torch.tensor(float(steps), dtype=torch.float32)
        self.scalars[group] = values


def _probe(stepper: ElementwiseStep) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Runs the optimizer on a probe whole and in tiles, per param group; returns the per-element state names and
    the scalar entries' names (unions over the groups, in the order met), or refuses it."""
    optimizer = stepper.optimizer
    name = type(optimizer).__name__
    if name in NOT_ELEMENTWISE:
        raise ConfigError(f"{name} cannot step ZeRO's flat partitions: {NOT_ELEMENTWISE[name]}. Use an elementwise "
                          "optimizer (Adam, AdamW, SGD, Adagrad, RMSprop, Lion, ...)")  # fmt: skip
    states: dict[str, None] = {}
    scalars: dict[str, None] = {}
    numel = PROBE_TILES * 64
    stepper._step = raw_step(optimizer)
    for index, group in enumerate(optimizer.param_groups):
        generator = torch.Generator().manual_seed(1234 + index)
        whole = torch.randn(numel, generator=generator)
        tiles = whole.clone()
        whole_state: dict = _probe_state(stepper.starts[index], numel)
        tile_states = [_probe_state(stepper.starts[index], numel // PROBE_TILES) for _ in range(PROBE_TILES)]
        entries = {k: _clone(v) for k, v in group.items() if k != "params"}  # the group as steps change it
        same = True
        try:
            for _ in range(PROBE_STEPS):
                grad = torch.randn(numel, generator=generator)
                changed = _changes(entries, stepper._run(entries, whole, grad, whole_state))
                for k, part in enumerate(tiles.chunk(PROBE_TILES)):
                    mine = _changes(entries, stepper._run(entries, part, grad.chunk(PROBE_TILES)[k].clone(),
                                                          tile_states[k]))  # fmt: skip
                    same = same and mine.keys() == changed.keys() and all(_same(mine[k], changed[k]) for k in mine)
                entries.update(changed)
        except Exception as e:  # noqa: BLE001 - whatever the class raises, it cannot step tiles
            raise ConfigError(f"{name} cannot step ZeRO's flat partitions: on a probe tensor its step raised "
                              f"{type(e).__name__}: {e}") from None  # fmt: skip
        same = same and torch.equal(whole, tiles)
        for key, value in whole_state.items():
            if torch.is_tensor(value) and value.shape == whole.shape:
                states.setdefault(key)
                parts = [s.get(key) for s in tile_states]
                same = same and all(torch.is_tensor(p) for p in parts) and torch.equal(value, torch.cat(parts))
            else:
                scalars.setdefault(key)
        if not same:
            raise ConfigError(
                f"{name} is not elementwise: stepped on a 256-element probe whole and in {PROBE_TILES} pieces "
                f"(param group {index}), the results differ. ZeRO steps flat pieces of parameters, so it would "
                "change the math; use an elementwise optimizer (Adam, AdamW, SGD, Adagrad, RMSprop, Lion, ...)"
            )
    return tuple(states), tuple(scalars)


def _probe_state(start: GroupStart, numel: int) -> dict:
    if not start.eager:
        return {}
    state = {k: _clone(v) for k, v in start.scalars.items()}
    state.update({k: torch.full((numel,), v, dtype=torch.float32) for k, v in start.fills.items()})
    return state


def encode_scalar(value) -> dict:
    """A scalar state entry as JSON (a 0-dim tensor keeps its dtype)."""
    if torch.is_tensor(value):
        return {"value": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    return {"value": value}


def decode_scalar(entry: dict):
    if "dtype" in entry:
        return torch.tensor(entry["value"], dtype=getattr(torch, entry["dtype"]))
    return entry["value"]
