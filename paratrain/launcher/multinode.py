"""Multi-node launch: one torchrun per node, started over ssh (or pdsh), meeting at a c10d rendezvous.

[Note: why c10d rendezvous]
With c10d every node runs the *same* torchrun command; torchrun assigns node and global ranks when the
nodes meet at `MASTER:PORT`. That is what lets pdsh start all nodes with one command line, lets nodes
have different slot counts, and lets `--max-restarts` restart the whole job after a failure. The
launcher itself only starts and watches one remote shell per node.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from paratrain.errors import InvalidValueError
from paratrain.launcher.run import LaunchOptions, restart_env

# Environment variables forwarded to every node (prefixes), as DeepSpeed forwards NCCL_*/PYTHON*.
FORWARD_PREFIXES = ("NCCL_", "PYTHON", "OMP_", "GLOO_", "TORCH_", "PARATRAIN_", "UCX_", "FI_", "DS_")
ENV_FILE = ".paratrain_env"


@dataclass
class NodePlan:
    host: str
    slots: list[int]
    command: str  # the shell command to run on that host


@dataclass
class MultiNodeOptions:
    launch: LaunchOptions
    hosts: OrderedDict[str, list[int]]
    launcher: str = "ssh"  # ssh | pdsh
    ssh_command: str = "ssh -o StrictHostKeyChecking=no -o BatchMode=yes"
    python: str = sys.executable
    workdir: str = field(default_factory=os.getcwd)
    extra_env: dict[str, str] = field(default_factory=dict)
    set_visible_devices: bool = False


def forwarded_env(extra: dict[str, str], environ: dict[str, str] | None = None,
                  env_files: list[Path] | None = None) -> dict[str, str]:
    """The variables every node gets: matching prefixes, then `.paratrain_env` lines, then --env."""
    environ = os.environ if environ is None else environ
    out = {k: v for k, v in sorted(environ.items()) if k.startswith(FORWARD_PREFIXES)}
    for path in env_files if env_files is not None else [Path.home() / ENV_FILE, Path.cwd() / ENV_FILE]:
        if path.is_file():
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                key, sep, value = line.partition("=")
                if not sep or not key.strip():
                    raise InvalidValueError(f"{path} line {number}: {line!r} is not NAME=VALUE")
                out[key.strip()] = value.strip()
    out.update(extra)
    return out


def node_command(opts: MultiNodeOptions, slots: list[int], target: str, target_args: list[str]) -> str:
    launch = opts.launch
    nnodes = len(opts.hosts)
    env = forwarded_env(opts.extra_env)
    for key, value in restart_env(launch).items():
        env.setdefault(key, value)
    if opts.set_visible_devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    torchrun = [opts.python, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                f"--nproc-per-node={len(slots)}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={launch.master_addr}:{launch.master_port}", f"--rdzv-id={launch.rdzv_id}",
                f"--max-restarts={launch.max_restarts}"]
    if launch.module:
        torchrun.append("--module")
    if launch.no_python:
        torchrun.append("--no-python")
    torchrun += [target, *target_args]
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    prefix = f"export {exports}; " if exports else ""
    return f"cd {shlex.quote(opts.workdir)} && {prefix}exec {shlex.join(torchrun)}"


def plan_nodes(opts: MultiNodeOptions, target: str, target_args: list[str]) -> list[NodePlan]:
    return [NodePlan(host, slots, node_command(opts, slots, target, target_args))
            for host, slots in opts.hosts.items()]


def remote_argv(opts: MultiNodeOptions, plans: list[NodePlan]) -> list[list[str]]:
    """The local processes to start: one ssh per node, or a single pdsh for all of them."""
    if opts.launcher == "pdsh":
        commands = {p.command for p in plans}
        if len(commands) != 1:
            raise InvalidValueError("pdsh runs one command on every host, but the hosts need different commands "
                                    "(different slot counts or devices); use --launcher ssh")
        return [["pdsh", "-S", "-f", "1024", "-w", ",".join(p.host for p in plans), plans[0].command]]
    if opts.launcher != "ssh":
        raise InvalidValueError(f"--launcher {opts.launcher!r}: use ssh or pdsh")
    ssh = shlex.split(opts.ssh_command)
    return [[*ssh, p.host, p.command] for p in plans]


def run_nodes(argvs: list[list[str]], poll_s: float = 0.2) -> int:
    """Start every node's process; if one fails, stop the others. Returns the first non-zero exit code."""
    procs = [subprocess.Popen(argv) for argv in argvs]
    code = 0
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove(p)
                if rc != 0 and code == 0:
                    code = rc
                    for other in procs:
                        other.terminate()
            time.sleep(poll_s)
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        code = code or 130
    for p in procs:
        p.wait()
    return code


# ---- Slurm ------------------------------------------------------------------------------------------
def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host lists: 'gpu[01-03,07],cpu1' -> gpu01 gpu02 gpu03 gpu07 cpu1."""
    hosts, depth, token = [], 0, ""
    parts = []
    for ch in nodelist:  # split on commas that are outside brackets
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(token)
            token = ""
        else:
            token += ch
    parts.append(token)
    for part in filter(None, parts):
        if "[" not in part:
            hosts.append(part)
            continue
        prefix, rest = part.split("[", 1)
        ranges, suffix = rest.split("]", 1)
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{width}d}{suffix}")
    return hosts


def slurm_launch_options(base: LaunchOptions, environ: dict[str, str] | None = None) -> LaunchOptions | None:
    """Under `srun` (one task per node), derive nodes, node rank and master from Slurm's variables."""
    env = os.environ if environ is None else environ
    if "SLURM_JOB_ID" not in env or "SLURM_NODEID" not in env or "SLURM_JOB_NODELIST" not in env:
        return None
    hosts = expand_nodelist(env["SLURM_JOB_NODELIST"])
    nnodes = int(env.get("SLURM_NNODES", len(hosts)))
    nproc = base.nproc_per_node
    if nproc == 1 and env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        nproc = int(env["SLURM_GPUS_ON_NODE"])
    return LaunchOptions(nproc_per_node=nproc, nnodes=str(nnodes), node_rank=int(env["SLURM_NODEID"]),
                         master_addr=hosts[0], master_port=base.master_port, max_restarts=base.max_restarts,
                         rdzv_backend=base.rdzv_backend, rdzv_id=env["SLURM_JOB_ID"], module=base.module,
                         no_python=base.no_python, log_dir=base.log_dir)
