"""initialize(), DeepSpeed's entry point: the training Engine (engine.py), or the InferenceEngine (inference.py,
built on Engine) when there is nothing to optimize. Its own module so that neither engine imports the other's
chooser."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from infinity.config import load_json
from infinity.engine import Engine
from infinity.errors import ConfigError
from infinity.inference import InferenceEngine, is_inference


def initialize(
    model: nn.Module | None = None,
    config: str | os.PathLike | Mapping[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | Callable | None = None,
    model_parameters: Iterable | None = None,
    lr_scheduler=None,
    training_data=None,
    collate_fn=None,
    config_params: Mapping[str, Any] | None = None,
    args=None,
    **unsupported,
):
    """DeepSpeed's initialize(): returns (engine, optimizer, training dataloader, lr scheduler). Collective:
    every rank calls it, building the same model, in the same order as its other engines. Without an optimizer
    (no optimizer= and no "optimizer" section) the engine is an InferenceEngine (ZeRO-Inference, inference.py)
    and the optimizer and scheduler returned are None."""
    if unsupported:
        raise ConfigError(f"initialize() does not take {', '.join(sorted(unsupported))}; see its docstring")
    if model is None:
        raise ConfigError("initialize() needs model=")
    if config is None:
        config = config_params if config_params is not None else getattr(args, "deepspeed_config", None)
    if config is None:
        raise ConfigError("initialize() needs config= (a dict or the path of a JSON file)")
    config = load_json(config)
    if is_inference(config, optimizer):
        engine = InferenceEngine(model=model, config=config, lr_scheduler=lr_scheduler, training_data=training_data,
                                 collate_fn=collate_fn)  # fmt: skip
        return engine, None, engine.training_dataloader, None
    engine = Engine(
        model=model,
        config=config,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
    )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
