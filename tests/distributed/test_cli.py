"""End-to-end: the CLI launches real multi-process jobs through torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from paratrain.launcher import LaunchOptions, torchrun_argv

ROOT = Path(__file__).resolve().parents[2]


def _paratrain(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "paratrain.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_torchrun_argv_static_and_elastic():
    argv = torchrun_argv(LaunchOptions(nproc_per_node=4, master_port=1234), "train.py", ["--x", "1"])
    assert argv == ["--nproc-per-node=4", "--nnodes=1", "--max-restarts=0", "--node-rank=0",
                    "--master-addr=127.0.0.1", "--master-port=1234", "train.py", "--x", "1"]
    argv = torchrun_argv(LaunchOptions(nproc_per_node=2, max_restarts=3, master_port=99), "m", [])
    assert "--rdzv-backend=c10d" in argv and "--rdzv-endpoint=127.0.0.1:99" in argv
    with pytest.raises(ValueError, match="--nproc-per-node must be >= 1"):
        torchrun_argv(LaunchOptions(nproc_per_node=0), "x.py", [])


@pytest.mark.multiprocess
def test_train_command_runs_two_processes_and_writes_a_run_dir(tmp_path):
    config = json.loads((ROOT / "configs" / "demo.json").read_text())
    config["trainer"].update(model="gpt-tiny", steps=12, eval_every=6, eval_batches=2, progress_bar=False)
    config["steps_per_print"] = 4
    (tmp_path / "c.json").write_text(json.dumps(config))
    run = _paratrain("train", "--config", "c.json", "--run-dir", "out", "--nproc-per-node", "2",
                     "--master-port", _free_port(), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["layout"] == "dp2" and summary["steps"] == 12
    assert summary["last_loss"] < summary["first_loss"]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[3]["state_bytes_per_rank"] == [rows[3]["state_bytes"]] * 2
    assert len(rows[3]["peak_rss_per_rank"]) == 2 and min(rows[3]["peak_rss_per_rank"]) > 50 * 2**20
    assert all(r["comm"]["dp"]["all_reduce"]["calls"] >= 1 for r in rows)
    assert (tmp_path / "out" / "metrics.csv").read_text().startswith("step,loss,")
    assert "val_loss" in rows[5] and "val_loss" in rows[11]


@pytest.mark.multiprocess
def test_train_command_reports_a_bad_config_without_a_traceback(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"train_batch_size": 8, "optimiser": {}}))
    run = _paratrain("train", "--config", "bad.json", cwd=tmp_path)
    assert run.returncode == 2
    assert "unknown config key 'optimiser'; did you mean 'optimizer'?" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.multiprocess
def test_run_command_launches_a_user_script(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        import paratrain
        paratrain.init_distributed()
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        open(f"rank{dist.get_rank()}.txt", "w").write(f"{t.item()} {sys.argv[1]}")
    """))
    run = _paratrain("run", "--nproc-per-node", "2", "--master-port", _free_port(), str(script), "hello",
                     cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "rank0.txt").read_text() == "3.0 hello"
    assert (tmp_path / "rank1.txt").read_text() == "3.0 hello"


@pytest.mark.multiprocess
def test_a_master_port_in_use_is_named_without_a_traceback(tmp_path):
    import socket

    (tmp_path / "script.py").write_text("print('never runs')\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        run = _paratrain("run", "--nproc-per-node", "2", "--master-port", port, "script.py", cwd=tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert f"paratrain: --master-port {port} is in use (another job on this machine?); pass another --master-port" \
        in run.stderr


@pytest.mark.multiprocess
def test_run_command_propagates_failure(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys; sys.exit(3)\n")
    run = _paratrain("run", "--nproc-per-node", "2", "--master-port", _free_port(), str(script), cwd=tmp_path)
    assert run.returncode != 0


def test_train_takes_no_script_flags_and_debug_reaches_the_ranks():
    from paratrain.cli import build_parser
    from paratrain.failure import DEBUG_ENV
    from paratrain.launcher.run import options_from_args

    parser = build_parser()
    train_help = parser._subparsers._group_actions[0].choices["train"].format_help()
    assert "--no-python" not in train_help and "--module" not in train_help and "--debug" in train_help
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--config", "c.json", "-m"])
    args = parser.parse_args(["train", "--config", "c.json", "--nproc-per-node", "2", "--debug"])
    assert options_from_args(args).env == {DEBUG_ENV: "1"}  # the workers' environment: their tracebacks too
    run = parser.parse_args(["run", "-m", "--debug", "pkg.main"])
    assert options_from_args(run).module and options_from_args(run).env == {DEBUG_ENV: "1"}
