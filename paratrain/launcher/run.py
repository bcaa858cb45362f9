"""Single- and multi-node launch on top of torchrun: no home-made process management.

`torchrun_argv` is pure (tested without starting anything); `launch` hands the result to
`torch.distributed.run.main`, which owns the worker processes, restarts (`--max-restarts`) and exit codes.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, field

from paratrain.errors import InvalidValueError
from paratrain.failure import DEBUG_ENV, clear_claims, conclude, debugging, interrupted


@dataclass
class LaunchOptions:
    nproc_per_node: int = 1
    nnodes: str = "1"
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    max_restarts: int = 0
    rdzv_backend: str = "static"
    rdzv_id: str = "paratrain"
    module: bool = False
    no_python: bool = False
    log_dir: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def add_launch_arguments(parser: argparse.ArgumentParser, script: bool = True) -> None:
    """The torchrun flags; `script`: also -m / --no-python, which say what the target is (`paratrain run` only)."""
    parser.add_argument("--nproc-per-node", "--nproc_per_node", "--num_gpus", "--num-gpus", dest="nproc_per_node",
                        type=int, default=None,
                        help="processes per node (one per GPU, or CPU workers); with --hostfile: the first N slots")
    parser.add_argument("--nnodes", "--num_nodes", "--num-nodes", dest="nnodes", default=None,
                        help="number of nodes, or MIN:MAX for elastic runs; with --hostfile: the first N hosts")
    parser.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0)
    parser.add_argument("--master-addr", "--master_addr", dest="master_addr", default="127.0.0.1")
    parser.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=29500)
    parser.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0,
                        help="restart the whole job up to K times when a worker fails")
    if script:
        parser.add_argument("-m", "--module", action="store_true", help="run the target as a python module")
        parser.add_argument("--no-python", "--no_python", dest="no_python", action="store_true",
                            help="the target is an executable, not a python script")
    parser.add_argument("--log-dir", dest="log_dir", default=None, help="torchrun's per-worker log directory")
    parser.add_argument("--debug", action="store_true",
                        help=f"show the traceback of a paratrain error too (same as {DEBUG_ENV}=1)")


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    return LaunchOptions(nproc_per_node=args.nproc_per_node or 1, nnodes=str(args.nnodes or 1),
                         node_rank=args.node_rank,
                         master_addr=args.master_addr, master_port=args.master_port,
                         max_restarts=args.max_restarts, module=getattr(args, "module", False),
                         no_python=getattr(args, "no_python", False), log_dir=args.log_dir,
                         env={DEBUG_ENV: "1"} if getattr(args, "debug", False) else {})


def restart_env(opts: LaunchOptions) -> dict[str, str]:
    """Environment torchrun needs so that `--max-restarts` actually restarts.

    [Note: a fresh store per restart]
    By default torchrun's c10d rendezvous shares its TCP store with the workers' process group, and a
    restarted worker can read the previous attempt's addresses from it: the new group then connects to a
    dead port and fails or hangs (pytorch/pytorch#135712; seen here with gloo after a SIGKILL). Disabling
    the sharing makes each attempt's rank 0 host a new store, and restarts work.
    """
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if opts.max_restarts > 0 else {}


def torchrun_argv(opts: LaunchOptions, target: str, target_args: list[str]) -> list[str]:
    """The argument list for torch.distributed.run for one node."""
    if opts.nproc_per_node < 1:
        raise InvalidValueError(f"--nproc-per-node must be >= 1, got {opts.nproc_per_node}")
    argv = [f"--nproc-per-node={opts.nproc_per_node}", f"--nnodes={opts.nnodes}",
            f"--max-restarts={opts.max_restarts}"]
    elastic = opts.max_restarts > 0 or ":" in opts.nnodes or opts.rdzv_backend == "c10d"
    if elastic:
        # c10d rendezvous is what allows restarts: survivors and replacements meet again at the endpoint.
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={opts.master_addr}:{opts.master_port}",
                 f"--rdzv-id={opts.rdzv_id}"]
        if opts.nnodes != "1":
            argv += [f"--rdzv-conf=is_host={'true' if opts.node_rank == 0 else 'false'}"]
    else:
        argv += [f"--node-rank={opts.node_rank}", f"--master-addr={opts.master_addr}",
                 f"--master-port={opts.master_port}"]
    if opts.log_dir:
        argv += [f"--log-dir={opts.log_dir}"]
    if opts.module:
        argv.append("--module")
    if opts.no_python:
        argv.append("--no-python")
    return argv + [target, *target_args]


def _could_not_start(exc: Exception, port: int) -> int:
    """The line for a job torchrun could not start; 2 when the fix is the user's (a port in use)."""
    if "EADDRINUSE" in str(exc) or "address already in use" in str(exc):
        print(f"paratrain: --master-port {port} is in use (another job on this machine?); pass another "
              f"--master-port", file=sys.stderr)
        return 2
    print(f"paratrain: the job could not start: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1


def launch(opts: LaunchOptions, target: str, target_args: list[str]) -> int:
    """Run torchrun in this process; returns its exit code (0 when every worker succeeded).

    A failed job ends with one line of paratrain's, not torchrun's summary block: the rank that reported first
    has printed the error (`paratrain.failure`), and its exit code is the job's."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.update(opts.env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for key, value in restart_env(opts).items():
        os.environ.setdefault(key, value)
    agent = os.getpid()  # every worker's parent: the name of this job's failure claim
    clear_claims(agent)
    # torchrun's per-worker "failed (exitcode: 2) local_rank: 0 ..." and "Sending process ... SIGTERM" lines:
    # the final line says which rank failed and how (restarts are logged by the agent's own logger, kept)
    workers = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = workers.level
    if not debugging():
        workers.setLevel(logging.CRITICAL)
    try:
        run(parse_args(torchrun_argv(opts, target, target_args)))
    except ChildFailedError as exc:
        return conclude(agent, exc.failures)
    except SignalException as exc:  # Ctrl-C (or a scheduler's SIGTERM): torchrun has stopped the workers
        return interrupted(exc.sigval)
    except Exception as exc:  # torchrun itself failed (its rendezvous): no worker has run
        if debugging():
            raise
        return _could_not_start(exc, opts.master_port)
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    finally:
        workers.setLevel(level)
        clear_claims(agent)
    return 0
