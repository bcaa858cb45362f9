"""What a DeepSpeed user sees: csv_monitor / tensorboard events per optimizer step and steps_per_print lines."""

from __future__ import annotations

import csv
import importlib.util
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import paratrain
from tests.cases import import_or_skip
from tests.distributed.test_cli import ROOT

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def check_monitor(out: str, tensorboard: bool) -> dict:
    logger = logging.getLogger("paratrain")
    lines, level = _Lines(), logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        monitor = {"enabled": True, "output_path": out, "job_name": "job"}
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 2,
                  "wall_clock_breakdown": True, "fp16": {"enabled": True, "initial_scale_power": 8},
                  "zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "csv_monitor": monitor, "tensorboard": {**monitor, "enabled": tensorboard}}
        engine, _, _, _ = paratrain.initialize(model=model, config=config)
        losses = []
        for step in range(4):
            for micro in range(2):
                g = torch.Generator().manual_seed(100 * step + 10 * micro + engine.global_rank)
                x = torch.randn(2, 8, generator=g).half()
                loss = engine(x).float().pow(2).mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        engine.monitor.close()
        return {"losses": losses, "lines": lines.lines, "enabled": engine.monitor.enabled,
                "scale": engine.loss_scale(), "samples": engine.global_samples}
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)


def _column(path: Path) -> tuple[list[str], list[int], list[float]]:
    rows = list(csv.reader(path.open()))
    return rows[0], [int(r[0]) for r in rows[1:]], [float(r[1]) for r in rows[1:]]


def test_monitor_events_and_log_lines(world2, tmp_path):
    results = world2.run(check_monitor, str(tmp_path), HAS_TENSORBOARD)
    rank0 = results[0]
    assert rank0["enabled"] and not results[1]["enabled"]  # only global rank 0 writes
    folder = tmp_path / "job"
    names = {p.name for p in folder.glob("*.csv")}
    assert names == {f"Train_Samples_{n}.csv" for n in (
        "train_loss", "lr", "grad_norm", "loss_scale", "elapsed_time_ms_forward", "elapsed_time_ms_backward",
        "elapsed_time_ms_step", "elapsed_time_ms_comm_wait")}
    header, samples, lrs = _column(folder / "Train_Samples_lr.csv")
    assert header == ["step", "lr"] and samples == [8, 16, 24, 32]  # x-axis: samples trained, as DeepSpeed's
    assert lrs == [1e-2] * 4
    _, _, train_loss = _column(folder / "Train_Samples_train_loss.csv")
    means = [sum(rank0["losses"][2 * i:2 * i + 2]) / 2 for i in range(4)]  # rank 0's micro-batches per step
    assert train_loss == pytest.approx(means, rel=1e-6)
    _, _, scales = _column(folder / "Train_Samples_loss_scale.csv")
    assert scales[-1] == rank0["scale"] and all(s > 0 for s in scales)
    _, _, forward_ms = _column(folder / "Train_Samples_elapsed_time_ms_forward.csv")
    assert all(ms > 0 for ms in forward_ms)
    printed = [line for line in rank0["lines"] if line.startswith("step=")]
    assert [line.split(",")[0] for line in printed] == ["step=2", "step=4"]
    assert all(f"skipped=0, lr=[0.01], mom=[(0.9, 0.999)], loss_scale={256.0:g}" in line for line in printed[:1])
    assert all("grad_norm=" in line and "samples/s=" in line for line in printed)
    assert all(f"| {phase}: " in line for line in printed for phase in ("forward", "backward", "step", "comm_wait"))
    assert not results[1]["lines"]  # rank 1 logs nothing at INFO
    if HAS_TENSORBOARD:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(folder)).Reload()
        assert [e.step for e in events.Scalars("Train/Samples/lr")] == [8, 16, 24, 32]
        assert [e.value for e in events.Scalars("Train/Samples/train_loss")] == pytest.approx(means, rel=1e-6)


def test_tensorboard_path_when_installed(tmp_path):
    import_or_skip("tensorboard")
    from paratrain.config import load_config
    from paratrain.engine.monitor import Monitor

    cfg = load_config({"tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"}})
    monitor = Monitor(cfg.tensorboard, cfg.csv_monitor, rank=0)
    monitor.write_events([("Train/Samples/lr", 0.5, 4)])
    monitor.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


@pytest.mark.multiprocess
def test_rank_zero_prints_steps_per_print_lines_by_default(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent("""
        import torch, paratrain as deepspeed
        model = torch.nn.Linear(4, 1)
        engine, *_ = deepspeed.initialize(model=model, config={"train_batch_size": 2, "steps_per_print": 2,
                                          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        for _ in range(4):
            engine.backward(engine(torch.ones(2, 4)).sum()); engine.step()
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    printed = [line for line in run.stdout.splitlines() if line.startswith("[paratrain rank 0] step=")]
    assert [line.split(",")[0] for line in printed] == ["[paratrain rank 0] step=2", "[paratrain rank 0] step=4"]
