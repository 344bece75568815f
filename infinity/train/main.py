"""`infinity train`: options, the checks that run before anything is built (bad input is a one-line error and
exit code 2), then the loop: build the model (under zero.Init at stage 3, so no rank ever holds it whole), train
it with the engine, show progress on rank 0, end with the summary. Ctrl-C ends it with one line and exit code 130
(SIGTERM: 143); the swap files go with the process."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile

from infinity.config import AutoError, AutoValues, load_json, parse_config
from infinity.errors import CheckpointError, ConfigError, InfinityError, TierBudgetError
from infinity.train import interrupt, models, resume
from infinity.train.data import DataError, token_source
from infinity.train.options import PROG, SECTIONS, apply_dtype, apply_micro_batch, quiet_transformers, unfilled_auto
from infinity.train.plan import Plan

EXIT_USAGE = 2


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
                        help=f"one of {models.named_models()} (parameters; built from the shape, nothing is "
                        "downloaded), or the path of a transformers config .json")
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


def _check_folder(path: str, option: str, *, create: bool = True) -> str:
    """Made if missing (when the user named it on the command line), and proven writable by writing a file:
    access() does not see every refusal (ACLs, a full disk, a filesystem mounted read-only under a writable
    parent's permissions)."""
    path = os.path.abspath(path)
    if not create and not os.path.isdir(path):
        raise UsageError(f"{option} {path!r} does not exist; create it or pass --nvme-path DIR")
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
    if nvme_path is not None and not nvme_path.strip():
        raise UsageError("--nvme-path is empty; give a folder on a fast local disk")
    paths = []
    for key, section in sections:
        if nvme_path is not None:
            section["nvme_path"] = nvme_path
        elif not section.get("nvme_path"):
            raise UsageError(f"zero_optimization.{key}.nvme_path is not set; pass --nvme-path DIR")
        elif not isinstance(section["nvme_path"], str):
            raise UsageError(f"zero_optimization.{key}.nvme_path must be a folder path, got {section['nvme_path']!r}")
        option = "--nvme-path" if nvme_path is not None else f"zero_optimization.{key}.nvme_path"
        paths.append(_check_folder(section["nvme_path"], option, create=nvme_path is not None))
    return sorted(set(paths))





def _model(args: argparse.Namespace):
    """The shape, its transformers config and its parameter count (a meta-device build: it proves transformers
    can build it as a causal LM, at no memory cost)."""
    try:
        shape = models.resolve(args.model)
        hf_config = models.hf_config(shape, seq_len=args.seq_len)
        numel = models.count_parameters(shape)
    except models.UnknownModelError as e:
        raise UsageError(str(e)) from None
    except ImportError as e:
        raise UsageError(f"infinity train builds transformers models: pip install -e \".[train]\" ({e})") from None
    except ValueError as e:
        raise UsageError(f"--model {args.model!r}: transformers cannot build it as a causal LM: {e}") from None
    return shape, hf_config, numel


def _check_resume(path: str, steps: int) -> None:
    try:
        step = resume.saved_step(path)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    if step is not None and step >= steps:
        raise UsageError(f"--resume {path!r}: the checkpoint is already at step {step}, and --steps {steps} trains "
                         f"no further: raise --steps above {step}")  # fmt: skip


def _checkpoints(args: argparse.Namespace) -> int:
    """Tags --save writes: one every --save-every steps before the last, and one at the end."""
    return (args.steps - 1) // args.save_every + 1 if args.save_every else 1


def _check_disk_room(args: argparse.Namespace, shape: models.ModelShape, config: dict, world_size: int) -> None:
    """The whole run's disk need against the free space, before anything is built: each rank's swap files and
    zero.Init's copy, which initialize() gives back as those fill (the plan's sizes, as `infinity estimate` counts
    them: infinity/memory/plan.py), and --save's checkpoints (all of them: each tag is kept)."""
    from infinity.estimate import _existing, plan_estimate
    from infinity.memory.nvme_store import can_punch_holes
    from infinity.memory.plan import check_room, this_machine

    estimate, _ = plan_estimate(shape, config, argparse.Namespace(world_size=world_size, seq_len=args.seq_len))
    param_path = estimate.swap.param_path
    punches = param_path is None or can_punch_holes(_existing(param_path))
    per_rank = estimate.swap.by_path(with_init=True, init_given_back=punches)
    shared = {}
    if args.save is not None:
        tags = _checkpoints(args)
        shared[args.save] = (tags * estimate.checkpoint_bytes, f"--save: {tags} checkpoint(s)")
    if not per_rank and not shared:
        return
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # torchrun's: the ranks of this node
    try:
        check_room(this_machine([*per_rank, *shared], ranks=local_ranks), per_rank, shared=shared, what="the run",
                   detail=estimate.swap.describe(with_init=True),
                   advice="free space there, point --nvme-path (or --save) at a larger disk, or offload less to NVMe")
    except TierBudgetError as e:
        raise UsageError(str(e)) from None


def plan(args: argparse.Namespace) -> Plan:
    """Every check that builds nothing real: bad input fails here, in seconds, with the key or value named."""
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: train at least 1 step")
    if args.seq_len < 2:
        raise UsageError(f"--seq-len {args.seq_len}: a sequence needs at least 2 tokens")
    if args.micro_batch is not None and args.micro_batch < 1:
        raise UsageError(f"--micro-batch {args.micro_batch}: at least 1")
    if args.save_every < 0:
        raise UsageError(f"--save-every {args.save_every}: 0 (only at the end) or a positive number of steps")
    if not 0 <= args.seed < 2**31:
        raise UsageError(f"--seed {args.seed}: between 0 and {2**31 - 1}")
    if args.resume is not None and not os.path.isdir(args.resume):
        raise UsageError(f"--resume {args.resume!r} is not a folder; give the folder --save wrote")
    if args.resume is not None:
        _check_resume(args.resume, args.steps)
    shape, hf_config, numel = _model(args)
    try:
        config = load_json(args.config)
    except ConfigError as e:
        raise UsageError(f"--config: {e}") from None
    for key in SECTIONS:
        if key in config and not isinstance(config[key], dict):
            raise UsageError(f"--config {args.config}: {key} must be a JSON object, got {config[key]!r}")
    notes: list[str] = []
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    apply_micro_batch(config, args.micro_batch)
    apply_dtype(config, args.dtype, notes)
    nvme_paths = _apply_nvme_path(config, args.nvme_path, notes)
    hidden = getattr(hf_config, "hidden_size", None) or getattr(hf_config, "n_embd", None)
    try:
        parsed = parse_config(config, world_size=world_size, auto=AutoValues(hidden_size=hidden))
    except AutoError as e:
        raise UsageError(f"--config {args.config}: {unfilled_auto(e)}") from None
    except ConfigError as e:
        raise UsageError(f"--config {args.config}: {e}") from None
    if args.micro_batch is not None:
        notes.append(f"--micro-batch {args.micro_batch}: global batch {parsed.train_batch_size} = {args.micro_batch} "
                     f"x {parsed.gradient_accumulation_steps} accumulation x {world_size} rank(s)")  # fmt: skip
    vocab_size = int(hf_config.vocab_size)
    if args.data != "synthetic":
        try:
            token_source(args.data, vocab_size=vocab_size, seq_len=args.seq_len, seed=args.seed)
        except DataError as e:
            raise UsageError(str(e)) from None
    if args.save is not None:
        _check_folder(args.save, "--save")
    if args.summary_json is not None:
        folder = os.path.dirname(os.path.abspath(args.summary_json))
        if not os.path.isdir(folder) or os.path.isdir(args.summary_json):
            raise UsageError(f"--summary-json {args.summary_json!r}: its folder must exist and it must not be one")
        _check_folder(folder, "--summary-json's folder", create=False)
    _check_disk_room(args, shape, config, world_size)
    return Plan(args=args, shape=shape, config=config, world_size=world_size, rank=int(os.environ.get("RANK", "0")),
                notes=notes, nvme_paths=nvme_paths, vocab_size=vocab_size, numel=numel)  # fmt: skip


def _ignore_further_signals() -> None:
    """torchrun sends a rank the signal again after the terminal did: the clean-up must not be interrupted."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread
            signal.signal(signum, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM (how torchrun and schedulers stop a rank) ends the run like Ctrl-C (train/interrupt.py). Installed
    # before the engine, so the swap store's handler removes the files first and then calls this one.
    previous = interrupt.install()
    run = None
    rank = int(os.environ.get("RANK", "0"))
    try:
        quiet_transformers()
        the_plan = plan(args)
        from infinity.train.loop import Run

        run = Run(the_plan)
        summary = run.train()
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        _ignore_further_signals()
        if run is not None:
            run.close_progress()
        if rank == 0:
            done = f"after {run.steps_done} of {args.steps} steps" if run is not None else "before training started"
            note = run.checkpoint_note() if run is not None else ""
            print(f"\n{PROG}: interrupted {done}; no swap files left behind{note}", file=sys.stderr)
        logging.getLogger("infinity").disabled = True  # the exit-time teardown has nothing to add
        return 128 + int(getattr(e, "signum", signal.SIGINT))
    except ConfigError as e:
        if run is not None:
            run.close_progress()
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except InfinityError as e:
        if run is not None:
            run.close_progress()
        print(f"{PROG}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    # Restored only after a clean end, and only if still ours: after an interrupt signals stay ignored until exit,
    # and after an error the swap store's own handler (installed on top of ours) keeps guarding its files.
    interrupt.restore(previous)
    if the_plan.rank == 0:
        print(summary, flush=True)
        if args.summary_json is not None:
            try:
                with open(args.summary_json, "w") as f:
                    json.dump(summary.as_dict(), f, indent=2)
            except OSError as e:
                print(f"{PROG}: error: --summary-json {args.summary_json!r}: {e.strerror or e}", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
