"""Experiment tracking (docs/evaluation.md) without a run: a missing package is named with its pip command,
engine.log_metrics refuses a value that is not a number, and the config flattens into MLflow's params. The
runs themselves (W&B offline, an MLflow file store, a backend that fails) are in tests/distributed/
test_trackers.py: wandb starts a service process and importing mlflow runs `uname`."""

from __future__ import annotations

import logging
import sys

import pytest

from paratrain.config import load_config
from paratrain.engine.monitor import Monitor
from paratrain.engine.trackers import MLFLOW_MAX_PARAM_LENGTH, events_by_step, flat_params
from paratrain.errors import InvalidValueError
from tests.cases import WarningLines


@pytest.fixture
def warnings_logged():
    handler, logger = WarningLines(), logging.getLogger("paratrain")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def test_a_missing_package_is_named_with_its_pip_command(monkeypatch, warnings_logged):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    cfg = load_config({"wandb": {"enabled": True}})
    assert not Monitor(cfg.tensorboard, cfg.csv_monitor, 1, cfg.wandb).enabled and warnings_logged == []  # rank 1
    monitor = Monitor(cfg.tensorboard, cfg.csv_monitor, 0, cfg.wandb)
    assert not monitor.enabled and monitor.backends == []
    assert len(warnings_logged) == 1 and "wandb.enabled is true" in warnings_logged[0]
    assert "pip install wandb" in warnings_logged[0]
    monitor.log_metrics({"eval/loss": 1.0}, 3)  # nothing to write to: no error
    with pytest.raises(InvalidValueError, match="log_metrics: 'eval/loss' is 'high', not a number"):
        monitor.log_metrics({"eval/loss": "high"}, 3)


def test_the_config_flattens_to_mlflow_params():
    params = flat_params({"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "betas": [0.9, 0.95]}},
                          "peft": None, "trainer": {"model_overrides": {}, "text": "x" * 7000},
                          "checkpoint": {"load_weights_map": {"a(b)": "c"}}})
    assert params == {"optimizer.type": "AdamW", "optimizer.params.lr": "0.1", "optimizer.params.betas": "[0.9, 0.95]",
                      "peft": "null", "trainer.model_overrides": "{}", "trainer.text": "x" * MLFLOW_MAX_PARAM_LENGTH,
                      "checkpoint.load_weights_map.a_b_": "c"}


class _Tracker:
    name, tracker = "fake", True

    def __init__(self):
        self.logged: list[tuple[dict, int]] = []

    def log_metrics(self, metrics, step):
        self.logged.append((metrics, step))

    def write(self, events):
        for step, metrics in events_by_step(events):
            self.log_metrics(metrics, step)

    def close(self):
        self.logged.append(("closed", None))


def test_file_monitors_keep_deepspeeds_names_and_trackers_get_the_trainers(tmp_path):
    cfg = load_config({"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}})
    monitor, tracker = Monitor(cfg.tensorboard, cfg.csv_monitor, 0), _Tracker()
    monitor.backends.append(tracker)
    monitor.write_step({"train_loss": 1.5, "lr": 0.1, "grad_norm": 2.0, "moe_aux_loss": 0.25}, samples=8, step=2)
    monitor.write_events([("Train/Samples/custom", 1.0, 16), ("Train/Samples/other", 2.0, 16)])  # DeepSpeed's API
    monitor.log_metrics({"eval/loss": 3.0}, 2)
    monitor.close()
    monitor.close()  # twice is fine
    assert tracker.logged == [
        ({"train/loss": 1.5, "train/learning_rate": 0.1, "train/grad_norm": 2.0, "train/moe_aux_loss": 0.25,
          "train/samples": 8}, 2),
        ({"Train/Samples/custom": 1.0, "Train/Samples/other": 2.0}, 16), ({"eval/loss": 3.0}, 2), ("closed", None)]
    job = tmp_path / "job"
    assert (job / "Train_Samples_train_loss.csv").read_text().splitlines() == ["step,train_loss", "8,1.5"]
    assert (job / "Train_Samples_moe_aux_loss.csv").read_text().splitlines() == ["step,moe_aux_loss", "8,0.25"]
    assert (job / "eval_loss.csv").read_text().splitlines() == ["step,loss", "2,3.0"]
    assert not list(job.glob("train_*.csv"))  # the trainer's names are the trackers'


def test_a_backend_failing_as_the_job_ends_is_not_said_to_be_dropped(tmp_path, warnings_logged):
    """At exit (Ctrl-C stops W&B's service too, then the finalizer closes its run): quiet; on close(): named, and
    never "training continues without it"."""

    def stopped():
        raise BrokenPipeError("the service is gone")

    cfg = load_config({"csv_monitor": {"enabled": True, "output_path": str(tmp_path)}})
    for how in ("at exit", "close"):
        monitor = Monitor(cfg.tensorboard, cfg.csv_monitor, 0)
        monitor.backends[0].close = stopped
        monitor._closer() if how == "at exit" else monitor.close()  # the finalizer is what runs at exit
        monitor.close()  # twice: nothing more
    assert warnings_logged == ["csv_monitor failed while closing (BrokenPipeError: the service is gone)"]
