"""The `infinity` command: one entry point whose subcommands delegate to their modules."""

from __future__ import annotations

import sys

USAGE = """usage: infinity <command> [options]

commands:
  train       train a model it builds from a named shape (no download), with NVMe offload, progress and a summary
  estimate    bytes per rank on each tier for a model and a config, and the largest model this machine holds
  aio-bench   measure (and tune) read/write throughput of a disk through the async I/O engine
  ckpt        look into a checkpoint (info) or write it as a plain fp32 state dict (to-fp32)
  report      check the environment: versions, CUDA, the I/O core, the NVMe folder, memlock, huge pages

Run `infinity <command> --help` for a command's options; `infinity --version` prints the version."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from infinity import __version__

        print(f"infinity {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        from infinity.train.main import main as train_main

        return train_main(rest)
    if command == "estimate":
        from infinity.estimate import main as estimate_main

        return estimate_main(rest)
    if command == "aio-bench":
        from infinity.aio.bench import main as bench_main

        return bench_main(rest)
    if command == "ckpt":
        from infinity.checkpoint.cli import main as ckpt_main

        return ckpt_main(rest)
    if command == "report":
        from infinity.report import main as report_main

        return report_main(rest)
    print(f"infinity: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
