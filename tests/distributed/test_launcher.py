"""Hostfiles, include/exclude filters, per-node commands, Slurm, and two loopback 'nodes' training together."""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

from paratrain.launcher.hostfile import HostfileError, filter_hosts, limit, parse_hostfile
from paratrain.launcher.multinode import expand_nodelist, forwarded_env, slurm_launch_options
from paratrain.launcher.run import LaunchOptions
from tests.distributed.test_cli import ROOT, _free_port, _paratrain


def test_hostfile_parses_and_names_bad_lines():
    hosts = parse_hostfile("# cluster\nworker-0 slots=4\n\nworker-1 slots=2  # smaller\n")
    assert hosts == OrderedDict([("worker-0", 4), ("worker-1", 2)])
    with pytest.raises(HostfileError, match=r"line 2: 'worker-1 slot=4' is not 'HOST slots=N'"):
        parse_hostfile("worker-0 slots=4\nworker-1 slot=4\n")
    with pytest.raises(HostfileError, match="line 2: host 'a' is listed twice"):
        parse_hostfile("a slots=1\na slots=2\n")
    with pytest.raises(HostfileError, match="has slots=0"):
        parse_hostfile("a slots=0\n")
    with pytest.raises(HostfileError, match="lists no hosts"):
        parse_hostfile("# nothing\n")


def test_include_exclude_and_limits():
    hosts = parse_hostfile("w0 slots=4\nw1 slots=4\nw2 slots=2\n")
    assert filter_hosts(hosts, include="w0:0,1@w2") == OrderedDict([("w0", [0, 1]), ("w2", [0, 1])])
    assert filter_hosts(hosts, exclude="w1@w0:3") == OrderedDict([("w0", [0, 1, 2]), ("w2", [0, 1])])
    assert limit(filter_hosts(hosts), 2, 2) == OrderedDict([("w0", [0, 1]), ("w1", [0, 1])])
    with pytest.raises(HostfileError, match="mutually exclusive"):
        filter_hosts(hosts, include="w0", exclude="w1")
    with pytest.raises(HostfileError, match="host 'w9' is not in the hostfile"):
        filter_hosts(hosts, include="w9")
    with pytest.raises(HostfileError, match="has slots 0..1, not \\[5\\]"):
        filter_hosts(hosts, include="w2:5")
    with pytest.raises(HostfileError, match="--num_gpus 3 but host\\(s\\) w2 have fewer slots"):
        limit(filter_hosts(hosts), None, 3)


def test_slurm_nodelist_and_options():
    assert expand_nodelist("gpu[01-03,07],cpu1") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]
    env = {"SLURM_JOB_ID": "42", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[3-4]", "SLURM_NNODES": "2",
           "SLURM_GPUS_ON_NODE": "8"}
    opts = slurm_launch_options(LaunchOptions(master_port=1234), env)
    assert (opts.nnodes, opts.node_rank, opts.master_addr, opts.nproc_per_node) == ("2", 1, "n3", 8)
    assert slurm_launch_options(LaunchOptions(), {}) is None


def test_env_forwarding(tmp_path):
    env_file = tmp_path / ".paratrain_env"
    env_file.write_text("# comment\nFOO=bar baz\n")
    out = forwarded_env({"X": "1"}, {"NCCL_DEBUG": "INFO", "HOME": "/root"}, [env_file])
    assert out == {"NCCL_DEBUG": "INFO", "FOO": "bar baz", "X": "1"}


@pytest.mark.multiprocess
def test_dry_run_prints_one_command_per_node(tmp_path):
    (tmp_path / "hosts").write_text("alpha slots=2\nbeta slots=2\n")
    run = _paratrain("run", "--hostfile", "hosts", "--include", "alpha:1@beta", "--master-addr", "alpha",
                     "--master-port", "6000", "--dry-run", "train.py", "--lr", "1", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 2
    alpha, beta = (shlex.split(line) for line in lines)
    assert alpha[:5] == ["ssh", "-o", "StrictHostKeyChecking=no", "-o", "BatchMode=yes"] and alpha[5] == "alpha"
    assert "--nproc-per-node=1" in alpha[6] and "CUDA_VISIBLE_DEVICES=1" in alpha[6]
    assert "--nproc-per-node=2" in beta[6] and "CUDA_VISIBLE_DEVICES=0,1" in beta[6]
    assert "--rdzv-endpoint=alpha:6000" in beta[6] and beta[6].endswith("train.py --lr 1")


@pytest.mark.multiprocess
def test_bad_hostfile_exits_2_with_the_line(tmp_path):
    (tmp_path / "hosts").write_text("alpha slots=two\n")
    run = _paratrain("run", "--hostfile", "hosts", "train.py", cwd=tmp_path)
    assert run.returncode == 2 and "hostfile 'hosts' line 1" in run.stderr


def _summary(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.multiprocess
def test_two_loopback_nodes_train_together_like_one_node(tmp_path):
    config = json.loads((ROOT / "configs" / "demo.json").read_text())
    config["trainer"].update(model="gpt-tiny", steps=6, eval_every=0, progress_bar=False)
    (tmp_path / "c.json").write_text(json.dumps(config))
    # A stand-in for ssh: ignore the host, run the command here (two "nodes" on loopback).
    fake_ssh = tmp_path / "fake_ssh"
    fake_ssh.write_text("#!/bin/sh\nshift\nexec sh -c \"$1\"\n")
    fake_ssh.chmod(0o755)
    (tmp_path / "hosts").write_text("node-a slots=1\nnode-b slots=1\n")
    multi = _paratrain("run", "--hostfile", "hosts", "--ssh-command", str(fake_ssh), "--master-port", _free_port(),
                       "--env", f"PYTHONPATH={ROOT}", "-m", "paratrain.cli", "train", "--config", "c.json",
                       "--run-dir", "multi", cwd=tmp_path)
    assert multi.returncode == 0, multi.stderr[-3000:]
    single = _paratrain("train", "--config", "c.json", "--run-dir", "single", "--nproc-per-node", "2",
                        "--master-port", _free_port(), cwd=tmp_path)
    assert single.returncode == 0, single.stderr[-3000:]
    a, b = _summary(tmp_path / "multi" / "summary.json"), _summary(tmp_path / "single" / "summary.json")
    assert a["world_size"] == b["world_size"] == 2
    ra = [json.loads(x)["loss"] for x in (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(x)["loss"] for x in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert ra == rb  # the same computation, bit for bit


@pytest.mark.multiprocess
def test_run_dry_run_single_node_shows_torchrun(tmp_path):
    run = _paratrain("run", "--nproc-per-node", "3", "--dry-run", "x.py", cwd=tmp_path)
    assert run.returncode == 0 and "torch.distributed.run --nproc-per-node=3" in run.stdout
    assert os.path.basename(sys.executable) in run.stdout
