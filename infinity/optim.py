"""The optimizers a DeepSpeed config can name: DeepSpeed's own names mapped to torch classes (or to Lion, here), any
torch.optim class by its name as DeepSpeed allows, and the ones that cannot run on ZeRO's flat partitions refused
with what to use instead. The step itself is each class's own ([Note: elementwise optimizers] in
zero/elementwise.py)."""

from __future__ import annotations

import torch

from infinity.errors import ConfigError

# DeepSpeed's names that have no equivalent here, with why and what to use.
REFUSED = {
    "lamb": "LAMB scales each parameter's update by a trust ratio over the whole parameter, which ZeRO's flat "
            "partitions cut apart; use AdamW or Lion",
    "onebitadam": "1-bit Adam replaces ZeRO's gradient reduction with compressed communication, which infinity "
                  "does not have; use Adam (1-bit Adam's warm-up phase is Adam)",
    "zerooneadam": "0/1 Adam replaces ZeRO's gradient reduction with compressed communication, which infinity does "
                   "not have; use Adam",
    "onebitlamb": "1-bit LAMB replaces ZeRO's gradient reduction with compressed communication, and LAMB is not "
                  "elementwise; use AdamW or Lion",
    "muadam": "mup's MuAdam needs mup's infinite-width shapes on every parameter; use AdamW with per-group "
              "learning rates, passed as a torch optimizer to initialize()",
    "muadamw": "mup's MuAdamW needs mup's infinite-width shapes on every parameter; use AdamW with per-group "
               "learning rates, passed as a torch optimizer to initialize()",
    "musgd": "mup's MuSGD needs mup's infinite-width shapes on every parameter; use SGD with per-group learning "
             "rates, passed as a torch optimizer to initialize()",
    "muon": "Muon orthogonalizes each 2-D parameter's update as a matrix, which ZeRO's flat partitions cut apart; "
            "use AdamW or Lion",
}  # fmt: skip


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"): the update is the sign of an
    interpolation of momentum and gradient, so every element moves by exactly lr. Defaults are DeepSpeed's
    (lr 1e-3, betas (0.9, 0.999), weight_decay 0), decoupled decay as in the paper. Elementwise: it steps
    offloaded tiles. sign(0) is 0, as in the paper (DeepSpeed's CPU kernel moves a zero by lr)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0) -> None:  # fmt: skip
        if lr < 0:
            raise ValueError(f"Lion: lr must be >= 0, got {lr}")
        if not all(0.0 <= beta < 1.0 for beta in betas) or len(betas) != 2:
            raise ValueError(f"Lion: betas must be two values in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                direction = exp_avg.mul(beta1).add_(param.grad, alpha=1 - beta1).sign_()
                if decay:
                    param.mul_(1 - lr * decay)
                param.add_(direction, alpha=-lr)
                exp_avg.mul_(beta2).add_(param.grad, alpha=1 - beta2)
        return loss


def config_optimizer_class(name: str) -> type[torch.optim.Optimizer] | None:
    """The class a config's optimizer.type names, beyond Adam/AdamW/SGD (which build_optimizer handles with
    DeepSpeed's defaults): Lion, Adagrad, or any torch.optim class by its name (case-insensitive). None: unknown."""
    key = name.lower()
    if key in REFUSED:
        raise ConfigError(f"optimizer.type {name!r} is not supported: {REFUSED[key]}")
    if key == "lion":
        return Lion
    for attribute in dir(torch.optim):
        candidate = getattr(torch.optim, attribute)
        if (attribute.lower() == key and isinstance(candidate, type) and candidate is not torch.optim.Optimizer
                and issubclass(candidate, torch.optim.Optimizer)):  # fmt: skip
            return candidate
    return None
