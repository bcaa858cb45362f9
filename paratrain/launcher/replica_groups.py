"""`paratrain train --replica-groups R --nproc-per-node N`: a torchft Lighthouse and R replica groups, each its own
`paratrain run` world of N processes that restarts when one of them dies (docs/fault-tolerance.md).

The Lighthouse runs in this process (torchft's LighthouseServer: the quorum and the heartbeats), unless the config
names one (fault_tolerance.lighthouse: groups on several machines each start their own `paratrain train
--replica-groups` share of groups against it; see the docs). Each group gets its own master port, its run directory
(group 0: --run-dir, group g: <run-dir>/replica<g>) and, in its environment, its index, the group count and the
Lighthouse's address. The command's exit code is the worst group's.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from paratrain.config import ConfigError, load_config
from paratrain.config.fault_tolerance import GROUP_ENV, GROUPS_ENV, LIGHTHOUSE_ENV, START_STORE_ENV, check_failure_rank

RESTARTS = 3  # per group: a group that keeps failing ends the job rather than looping


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lighthouse(settings):
    """torchft's Lighthouse on this machine, with the config's quorum settings (kept alive by the caller)."""
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        raise ConfigError("fault tolerance needs torchft: pip install 'paratrain[ft]' (torchft)") from None
    return LighthouseServer(bind="[::]:0", min_replicas=settings.min_replicas,
                            join_timeout_ms=int(settings.join_timeout_s * 1000),
                            heartbeat_timeout_ms=int(settings.heartbeat_timeout_s * 1000))


def group_argv(args, run_dir: str, group: int, port: int) -> list[str]:
    train = ["train", "--config", args.config, "--run-dir", run_dir if group == 0 else f"{run_dir}/replica{group}"]
    if args.steps:
        train += ["--steps", str(args.steps)]
    return [sys.executable, "-m", "paratrain.cli", "run", "--nproc-per-node", str(args.nproc_per_node or 1),
            "--max-restarts", str(RESTARTS), "--master-port", str(port), "-m", "paratrain.cli", *train]


def launch_groups(args) -> int:
    """Start the Lighthouse and the groups; wait for every group; the worst exit code."""
    cfg = load_config(args.config)
    groups = args.replica_groups
    if cfg.fault_tolerance.min_replicas > groups:
        raise ConfigError(f"fault_tolerance.min_replicas = {cfg.fault_tolerance.min_replicas} is more than the "
                          f"{groups} groups of --replica-groups: no step could commit; lower it")
    # refused here once, not by every group at every restart
    check_failure_rank(cfg.fault_tolerance.inject_failure, args.nproc_per_node or 1, "--nproc-per-node")
    lighthouse = None if cfg.fault_tolerance.lighthouse else start_lighthouse(cfg.fault_tolerance)
    address = cfg.fault_tolerance.lighthouse or lighthouse.address()
    from torch.distributed import TCPStore

    port = _free_port()  # where the groups' first start meets, so that the first quorum holds every group
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 - kept alive
    procs = []
    for group in range(groups):
        env = {**os.environ, GROUP_ENV: str(group), GROUPS_ENV: str(groups), LIGHTHOUSE_ENV: address,
               START_STORE_ENV: f"127.0.0.1:{port}"}
        procs.append(subprocess.Popen(group_argv(args, args.run_dir or cfg.trainer.run_dir, group, _free_port()),
                                      env=env))
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        codes = [p.wait() for p in procs]
    finally:
        if lighthouse is not None:
            time.sleep(0.1)
            lighthouse.shutdown()
    return max(codes, key=abs)
