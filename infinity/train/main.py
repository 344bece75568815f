"""`infinity train`: options, the checks that run before anything is built (bad input is a one-line error and
exit code 2), then the loop: build the model (under zero.Init at stage 3, so no rank ever holds it whole), train
it with the engine, show progress on rank 0, end with the summary. Ctrl-C (or SIGTERM) ends it with one line and
exit code 130; the swap files go with the process."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile

from infinity.config import AutoValues, load_json, parse_config
from infinity.errors import ConfigError, InfinityError
from infinity.train import models
from infinity.train.data import DataError, token_source

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
PROG = "infinity train"


class UsageError(ValueError):
    """Bad input: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Train a transformers model (built from a named shape, nothing downloaded) with the engine, "
        "with progress and a summary. Runs as is, or under torchrun --nproc_per_node N.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="a DeepSpeed-style JSON config, e.g. configs/zero3-nvme.json")
    parser.add_argument("--model", default="gpt2-tiny",
                        help=f"one of {', '.join(models.TRAIN_NAMES)}, or a transformers config .json")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps in all (a resumed run continues to it)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences per rank per micro-step (default: the config's train_micro_batch_size_per_gpu)")
    parser.add_argument("--data", default="synthetic",
                        help="'synthetic' (sequences that count up: learnable, so the loss falls) or a text file, "
                        "read as byte tokens")
    parser.add_argument("--nvme-path", default=None,
                        help="folder for the swap files (made if missing); default: the config's nvme_path")
    parser.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                        help="auto: the config's, except bf16 becomes fp32 on a CPU without bf16 units")
    parser.add_argument("--save", default=None, help="checkpoint folder: saved at the end (and every --save-every)")
    parser.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: only at the end)")
    parser.add_argument("--resume", default=None,
                        help="checkpoint folder to continue from (its `latest` tag), or one of its tag folders")
    parser.add_argument("--seed", type=int, default=0, help="model initialization and data")
    parser.add_argument("--summary-json", default=None, help="also write the summary (every step's loss) as JSON")
    return parser  # fmt: skip


@dataclasses.dataclass(kw_only=True)
class Plan:
    """Everything checked, before the model is built."""

    args: argparse.Namespace
    shape: models.ModelShape
    config: dict  # the raw config with the command line's overrides applied
    world_size: int
    rank: int
    notes: list[str]  # what the command changed, said once at the start
    nvme_paths: list[str]


def _bf16_units() -> bool:
    """Whether this CPU computes bf16 natively; without, its bf16 matmuls are several times slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16", " bf16"))


def _apply_dtype(config: dict, dtype: str, notes: list[str]) -> None:
    def enabled(section: str) -> bool:
        return bool(isinstance(config.get(section), dict) and config[section].get("enabled") is True)

    if dtype == "auto":
        import torch

        if enabled("bf16") and not torch.cuda.is_available() and not _bf16_units():
            dtype = "fp32"
            notes.append(
                "bf16 -> fp32: this CPU has no bf16 units (its bf16 matmuls are slower); --dtype bf16 keeps it"
            )
        else:
            return
    for section in ("fp16", "bf16"):
        config[section] = {**(config.get(section) or {}), "enabled": section == dtype}


def _check_folder(path: str, option: str) -> str:
    """Made if missing, and proven writable by writing a file (root passes os.access on a read-only mount)."""
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UsageError(f"{option} {path!r} is not a writable folder: {e.strerror}; choose another") from None
    return path


def _apply_nvme_path(config: dict, nvme_path: str | None, notes: list[str]) -> list[str]:
    zero = config.get("zero_optimization") or {}
    sections = [(key, zero[key]) for key in ("offload_param", "offload_optimizer")
                if isinstance(zero.get(key), dict) and zero[key].get("device") == "nvme"]  # fmt: skip
    if nvme_path is not None and not sections:
        notes.append(f"--nvme-path {nvme_path} unused: the config offloads nothing to NVMe")
    paths = []
    for key, section in sections:
        if nvme_path is not None:
            section["nvme_path"] = nvme_path
        elif not section.get("nvme_path"):
            raise UsageError(f"zero_optimization.{key}.nvme_path is not set; pass --nvme-path DIR")
        option = "--nvme-path" if nvme_path is not None else f"zero_optimization.{key}.nvme_path"
        paths.append(_check_folder(section["nvme_path"], option))
    return sorted(set(paths))


def plan(args: argparse.Namespace) -> Plan:
    """Every check that needs no model: bad input fails here, in a second, with the key or value named."""
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: train at least 1 step")
    if args.seq_len < 2:
        raise UsageError(f"--seq-len {args.seq_len}: a sequence needs at least 2 tokens")
    if args.micro_batch is not None and args.micro_batch < 1:
        raise UsageError(f"--micro-batch {args.micro_batch}: at least 1")
    if args.save_every < 0:
        raise UsageError(f"--save-every {args.save_every}: 0 (only at the end) or a positive number of steps")
    if args.resume is not None and not os.path.isdir(args.resume):
        raise UsageError(f"--resume {args.resume!r} is not a folder; give the folder --save wrote")
    try:
        shape = models.resolve(args.model)
        hf_config = models.hf_config(shape, seq_len=args.seq_len)
    except models.UnknownModelError as e:
        raise UsageError(str(e)) from None
    try:
        config = load_json(args.config)
    except ConfigError as e:
        raise UsageError(f"--config: {e}") from None
    notes: list[str] = []
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.micro_batch is not None:
        config["train_micro_batch_size_per_gpu"] = args.micro_batch
        if "train_batch_size" in config:  # the engine computes it from the micro-batch and the accumulation
            del config["train_batch_size"]
            config.setdefault("gradient_accumulation_steps", 1)
    _apply_dtype(config, args.dtype, notes)
    nvme_paths = _apply_nvme_path(config, args.nvme_path, notes)
    hidden = getattr(hf_config, "hidden_size", None) or getattr(hf_config, "n_embd", None)
    try:
        parse_config(config, world_size=world_size, auto=AutoValues(hidden_size=hidden))
    except ConfigError as e:
        raise UsageError(f"--config {args.config}: {e}") from None
    if args.data != "synthetic":
        try:
            token_source(args.data, vocab_size=models.vocab_size(shape), seq_len=args.seq_len, seed=args.seed)
        except DataError as e:
            raise UsageError(str(e)) from None
    if args.save is not None:
        _check_folder(args.save, "--save")
    if args.summary_json is not None:
        folder = os.path.dirname(os.path.abspath(args.summary_json))
        if not os.path.isdir(folder) or os.path.isdir(args.summary_json):
            raise UsageError(f"--summary-json {args.summary_json!r}: its folder must exist and it must not be one")
    return Plan(args=args, shape=shape, config=config, world_size=world_size,
                rank=int(os.environ.get("RANK", "0")), notes=notes, nvme_paths=nvme_paths)  # fmt: skip


def _quiet_transformers() -> None:
    """transformers' warnings about configs built here (unused keys, defaults) say nothing a user can act on."""
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM (torchrun's way of stopping a rank) ends the run like Ctrl-C. Installed before the engine, so the
    # swap store's handler removes the files first and then calls this one.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    run = None
    try:
        _quiet_transformers()
        the_plan = plan(args)
        from infinity.train.loop import Run

        run = Run(the_plan)
        summary = run.train()
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        done = f" after {run.steps_done} of {args.steps} steps" if run is not None else " before training started"
        if run is not None:
            run.close_progress()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"\n{PROG}: interrupted{done}; swap files removed{run.checkpoint_note() if run else ''}",
                  file=sys.stderr)  # fmt: skip
        logging.getLogger("infinity").disabled = True  # the exit-time teardown has nothing to add
        return EXIT_INTERRUPTED
    except ConfigError as e:
        run.close_progress()
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except InfinityError as e:
        run.close_progress()
        print(f"{PROG}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, previous)
    if the_plan.rank == 0:
        print(summary, flush=True)
        if args.summary_json is not None:
            with open(args.summary_json, "w") as f:
                json.dump(summary.as_dict(), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
