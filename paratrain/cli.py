"""The `paratrain` command: run | train | report."""

from __future__ import annotations

import argparse
import os
import sys


def _in_launched_world() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def cmd_run(args: argparse.Namespace) -> int:
    from paratrain.launcher.run import launch, options_from_args

    if not args.target:
        print("paratrain run: give a script (or -m module) to launch", file=sys.stderr)
        return 2
    return launch(options_from_args(args), args.target[0], args.target[1:])


def cmd_train(args: argparse.Namespace) -> int:
    if args.nproc_per_node > 1 and not _in_launched_world():
        # Re-launch this very command under torchrun with N processes.
        from paratrain.launcher.run import launch, options_from_args

        forwarded = ["train", "--config", args.config]
        if args.run_dir:
            forwarded += ["--run-dir", args.run_dir]
        if args.steps:
            forwarded += ["--steps", str(args.steps)]
        return launch(options_from_args(args), "paratrain.cli", forwarded) if args.module else \
            launch(_with_module(options_from_args(args)), "paratrain.cli", forwarded)
    from paratrain.config import ConfigError
    from paratrain.trainer import train

    try:
        train(args.config, run_dir=args.run_dir, steps=args.steps)
    except ConfigError as exc:
        print(f"paratrain train: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from paratrain.report import ReportError, build_report

    try:
        parts = build_report(args.run_dir)
    except ReportError as exc:
        print(f"paratrain report: {exc}", file=sys.stderr)
        return 2
    if not parts:
        print(f"paratrain report: nothing to report in {args.run_dir} (a pipeline run writes timeline.json)",
              file=sys.stderr)
        return 1
    print("\n\n".join(parts))
    return 0


def _with_module(opts):
    opts.module = True
    return opts


def build_parser() -> argparse.ArgumentParser:
    from paratrain.launcher.run import add_launch_arguments

    parser = argparse.ArgumentParser(prog="paratrain", description="Parallel training for PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="launch a script on N processes (torchrun underneath)")
    add_launch_arguments(run)
    run.add_argument("target", nargs=argparse.REMAINDER, help="script.py [args...] (or a module with -m)")
    run.set_defaults(func=cmd_run)

    train = sub.add_parser("train", help="train the built-in GPT on the embedded corpus")
    train.add_argument("--config", required=True, help="JSON config (DeepSpeed keys + parallel sections)")
    train.add_argument("--run-dir", default=None, help="output directory (default: trainer.run_dir)")
    train.add_argument("--steps", type=int, default=None, help="override trainer.steps")
    add_launch_arguments(train)
    train.set_defaults(func=cmd_train)

    report = sub.add_parser("report", help="render a run directory: pipeline timeline (Gantt PNG) and bubbles")
    report.add_argument("run_dir", help="the run directory of a `paratrain train` run")
    report.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
