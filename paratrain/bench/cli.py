"""`paratrain bench`: every strategy side by side on the same small GPT, measured (see docs/strategies.md)."""

from __future__ import annotations

import argparse
import json
import sys

from paratrain.bench.cases import MODELS, select


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=4, choices=[2, 4], help="ranks per case (the hybrid needs 4)")
    parser.add_argument("--model", default="bench", choices=sorted(MODELS), help="bench (3.3M parameters) or tiny")
    parser.add_argument("--steps", type=int, default=5, help="measured optimizer steps per case")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps before measuring")
    parser.add_argument("--only", default=None, help="comma-separated case names, e.g. ddp,zero3,tp")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--doc", default=None,
                        help="write the table between the paratrain bench markers of this file (docs/strategies.md)")


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces the run (output options left out)."""
    only = f" --only {args.only}" if args.only else ""
    return (f"paratrain bench --nproc {args.nproc} --model {args.model} --steps {args.steps} "
            f"--warmup {args.warmup}{only}")


def run_bench(args: argparse.Namespace) -> int:
    from paratrain.bench.run import run_case
    from paratrain.bench.table import markdown, write_between_markers

    if args.steps < 1 or args.warmup < 0:
        print("paratrain bench: --steps must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    try:
        chosen = select(args.nproc, args.only)
    except ValueError as exc:
        print(f"paratrain bench: {exc}", file=sys.stderr)
        return 2
    rows = []
    for case in chosen:
        print(f"[bench] {case.name}: {case.strategy} on {case.layout(args.nproc)} ...", file=sys.stderr, flush=True)
        rows.append(run_case(case, args.nproc, args.model, args.steps, args.warmup))
    table = markdown(rows, command_line(args), args.nproc, args.model, args.steps)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.doc:
        try:
            write_between_markers(args.doc, table)
        except (OSError, ValueError) as exc:
            print(f"paratrain bench: {exc}", file=sys.stderr)
            return 2
    return 0
