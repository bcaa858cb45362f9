"""The `paratrain` command: run | train | verify | plan | bench | report | checkpoint."""

from __future__ import annotations

import argparse
import os
import sys


def _in_launched_world() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def cmd_run(args: argparse.Namespace) -> int:
    from paratrain.launcher.hostfile import HostfileError
    from paratrain.launcher.multinode import slurm_launch_options
    from paratrain.launcher.run import launch, options_from_args

    if not args.target:
        print("paratrain run: give a script (or -m module) to launch", file=sys.stderr)
        return 2
    target, target_args = args.target[0], args.target[1:]
    try:
        if args.hostfile:
            return _run_multinode(args, target, target_args)
        opts = options_from_args(args)
        slurm = slurm_launch_options(opts)
        if slurm is not None:
            opts = slurm
    except (HostfileError, ValueError) as exc:
        print(f"paratrain run: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        from paratrain.launcher.run import torchrun_argv

        print(" ".join([sys.executable, "-m", "torch.distributed.run", *torchrun_argv(opts, target, target_args)]))
        return 0
    return launch(opts, target, target_args)


def _run_multinode(args: argparse.Namespace, target: str, target_args: list[str]) -> int:
    import shlex

    from paratrain.launcher.hostfile import filter_hosts, limit, read_hostfile
    from paratrain.launcher.multinode import MultiNodeOptions, plan_nodes, remote_argv, run_nodes
    from paratrain.launcher.run import options_from_args

    hosts = limit(filter_hosts(read_hostfile(args.hostfile), args.include, args.exclude),
                  int(args.nnodes) if args.nnodes else None, args.nproc_per_node)
    extra = dict(item.split("=", 1) if "=" in item else (item, os.environ.get(item, "")) for item in args.env)
    opts = MultiNodeOptions(options_from_args(args), hosts, launcher=args.launcher, ssh_command=args.ssh_command,
                            extra_env=extra, set_visible_devices=bool(args.include or args.exclude))
    argvs = remote_argv(opts, plan_nodes(opts, target, target_args))
    if args.dry_run:
        for argv in argvs:
            print(shlex.join(argv))
        return 0
    return run_nodes(argvs)


def cmd_train(args: argparse.Namespace) -> int:
    if args.replica_groups and not _in_launched_world():  # a Lighthouse and R groups of N processes each
        from paratrain.failure import report
        from paratrain.launcher.replica_groups import launch_groups

        try:
            return launch_groups(args)
        except Exception as exc:  # bad input (the config, torchft missing): said once, as train says it
            return report(exc)
    if (args.nproc_per_node or 1) > 1 and not _in_launched_world():
        # Re-launch this very command under torchrun with N processes.
        from paratrain.launcher.run import launch, options_from_args

        forwarded = ["train", "--config", args.config]
        if args.run_dir:
            forwarded += ["--run-dir", args.run_dir]
        if args.steps:
            forwarded += ["--steps", str(args.steps)]
        opts = options_from_args(args)
        opts.module = True  # torchrun runs `python -m paratrain.cli train ...` on every rank
        return launch(opts, "paratrain.cli", forwarded)
    from paratrain.failure import DEBUG_ENV, INTERRUPTED, install_excepthook, report
    from paratrain.trainer import train

    if args.debug:
        os.environ[DEBUG_ENV] = "1"
    install_excepthook()  # an error outside train() (an import) is reported the same way
    try:
        train(args.config, run_dir=args.run_dir, steps=args.steps)
    except Exception as exc:  # reported once for the whole job, without a traceback unless a bug or --debug
        return report(exc)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: the launcher says it once, a single process here
        if not _in_launched_world():
            print("paratrain train: interrupted", file=sys.stderr)
        return INTERRUPTED
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from paratrain.testing.verify import run_verify

    return run_verify(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from paratrain.planner.search import without_cycle_collection

    # the whole command, not the search alone: the collection the search's end would set off over its live tuples
    # is never needed by a process that prints and exits
    with without_cycle_collection():
        from paratrain.planner.cli import run_plan

        return run_plan(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from paratrain.bench.cli import run_bench

    return run_bench(args)


def cmd_report(args: argparse.Namespace) -> int:
    from paratrain.report import ReportError, build_report

    try:
        parts = build_report(args.run_dir)
    except ReportError as exc:
        print(f"paratrain report: {exc}", file=sys.stderr)
        return 2
    if not parts:
        print(f"paratrain report: nothing to report in {args.run_dir} (a `paratrain train` run writes "
              f"metrics.jsonl, a pipeline run also timeline.json)", file=sys.stderr)
        return 1
    print("\n\n".join(parts))
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from paratrain.checkpoint.cli import run_checkpoint

    return run_checkpoint(args)


def build_parser() -> argparse.ArgumentParser:
    from paratrain.launcher.run import add_launch_arguments

    parser = argparse.ArgumentParser(prog="paratrain", description="Parallel training for PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="launch a script on N processes (torchrun underneath)")
    add_launch_arguments(run)
    run.add_argument("--hostfile", default=None, help="DeepSpeed hostfile: one 'HOST slots=N' per line")
    run.add_argument("--include", default="", help="hosts/slots to use, e.g. 'worker-0:0,1@worker-1'")
    run.add_argument("--exclude", default="", help="hosts/slots to leave out, same syntax as --include")
    run.add_argument("--launcher", default="ssh", choices=["ssh", "pdsh"], help="how to start remote nodes")
    run.add_argument("--ssh-command", default="ssh -o StrictHostKeyChecking=no -o BatchMode=yes",
                     help="remote shell used by --launcher ssh (the host and command are appended)")
    run.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                     help="forward an environment variable to every node (repeatable)")
    run.add_argument("--dry-run", action="store_true", help="print the exact per-node commands and exit")
    run.add_argument("target", nargs=argparse.REMAINDER, help="script.py [args...] (or a module with -m)")
    run.set_defaults(func=cmd_run)

    train = sub.add_parser("train", help="train a preset or a Hugging Face model directory on the embedded corpus "
                                         "or on the config's data section (docs/data.md)")
    train.add_argument("--config", required=True, help="JSON config (DeepSpeed keys + parallel sections)")
    train.add_argument("--run-dir", default=None, help="output directory (default: trainer.run_dir)")
    train.add_argument("--steps", type=int, default=None, help="override trainer.steps")
    train.add_argument("--replica-groups", dest="replica_groups", type=int, default=None,
                       help="fault tolerance: R replica groups of --nproc-per-node processes on torchft, a failed "
                            "group restarted and healed from a live one (docs/fault-tolerance.md)")
    add_launch_arguments(train, script=False)
    train.set_defaults(func=cmd_train)

    from paratrain.testing.verify import add_verify_arguments

    verify = sub.add_parser("verify", help="check a config's layout against one process on this machine's CPUs")
    add_verify_arguments(verify)
    verify.set_defaults(func=cmd_verify)

    from paratrain.planner.cli import add_plan_arguments

    plan = sub.add_parser("plan", help="rank parallel layouts for a model on N GPUs: memory, time, a config")
    add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)

    from paratrain.bench.cli import add_bench_arguments

    bench = sub.add_parser("bench", help="every strategy on the same small GPT: memory, communication, time")
    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    report = sub.add_parser("report", help="render a run directory: loss, throughput, memory and communication "
                                           "plots, a summary, the pipeline timeline")
    report.add_argument("run_dir", help="the run directory of a `paratrain train` run")
    report.set_defaults(func=cmd_report)

    from paratrain.checkpoint.cli import add_checkpoint_arguments

    checkpoint = sub.add_parser("checkpoint", help="inspect, export or convert a sharded checkpoint")
    add_checkpoint_arguments(checkpoint)
    checkpoint.set_defaults(func=cmd_checkpoint)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
