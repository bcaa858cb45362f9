"""Experiment trackers: a Weights & Biases run (the config's `wandb` section) and an MLflow run (`mlflow`).

They get the metrics of every optimizer step under the names transformers' Trainer uses (`train/loss`,
`train/learning_rate`, `train/grad_norm`, ...; `paratrain/engine/monitor.py` names them) over the optimizer
step, whatever `engine.log_metrics` adds (`eval/loss`, ...), and the resolved config once: as the W&B run's
config, as MLflow params (flattened to dotted keys). Both packages are optional and imported here only, when a
section is enabled. `paratrain/engine/monitor.py` starts them on rank 0 and drops one that fails.
"""

from __future__ import annotations

import json
import os
import re
import time
from itertools import groupby
from pathlib import Path
from urllib.parse import urlparse

from paratrain.config.outputs import MlflowConfig, WandbConfig

Events = list[tuple[str, float, int]]

# W&B's x-axis for every metric (what transformers' WandbCallback logs): logging it with each row, instead of
# wandb's own step counter, lets later calls at the same step (evaluation) and DeepSpeed events whose step
# is another count never collide with wandb's rule that its step only grows.
WANDB_STEP = "train/global_step"

# MLflow's limits (mlflow.utils.validation): longer param values and larger batches are refused.
MLFLOW_MAX_PARAM_LENGTH = 6000
MLFLOW_PARAMS_PER_BATCH = 100
MLFLOW_METRICS_PER_BATCH = 1000
_MLFLOW_UNSAFE = re.compile(r"[^\w\-. /:]")  # mlflow refuses other characters in metric and param names


def events_by_step(events: Events) -> list[tuple[int, dict[str, float]]]:
    """DeepSpeed's (name, value, step) events as one {name: value} per step, in their order."""
    return [(step, {name: value for name, value, _ in group})
            for step, group in groupby(events, key=lambda event: event[2])]


class WandbTracker:
    name = "wandb"
    tracker = True

    def __init__(self, section: WandbConfig, run_config: dict):
        import wandb

        if section.dir:  # wandb falls back to a temporary directory when the one it is given is missing
            Path(section.dir).mkdir(parents=True, exist_ok=True)
        # A run the script started itself (wandb.init before initialize) is joined, as transformers does, and
        # left for the script to finish; otherwise this tracker owns its run.
        self.owned = wandb.run is None
        if self.owned:
            self.run = wandb.init(project=section.project, entity=section.team, group=section.group,
                                  mode=section.mode, dir=section.dir, config=run_config)
        else:
            self.run = wandb.run
            self.run.config.update(run_config, allow_val_change=True)
        self.run.define_metric(WANDB_STEP)
        self.run.define_metric("*", step_metric=WANDB_STEP, step_sync=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, WANDB_STEP: step})

    def write(self, events: Events) -> None:
        for step, metrics in events_by_step(events):
            self.log_metrics(metrics, step)

    def close(self) -> None:
        if self.owned:
            self.run.finish()


class MlflowTracker:
    name = "mlflow"
    tracker = True

    def __init__(self, section: MlflowConfig, run_config: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = section.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri and urlparse(uri).scheme in ("", "file"):
            # mlflow 3 refuses a file store unless this is set; the config (or MLFLOW_TRACKING_URI) asked for
            # one by name, so it is allowed here, unless the environment says false.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # The client, not mlflow's fluent API: the run is this engine's, whatever run the script has active.
        self.client = MlflowClient(tracking_uri=uri)
        name = section.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=section.run_name).info.run_id
        params = [Param(key, value) for key, value in flat_params(run_config).items()]
        for start in range(0, len(params), MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + MLFLOW_PARAMS_PER_BATCH])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        rows = [Metric(mlflow_name(name), float(value), now_ms, step) for name, value in metrics.items()]
        for start in range(0, len(rows), MLFLOW_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=rows[start:start + MLFLOW_METRICS_PER_BATCH])

    def write(self, events: Events) -> None:
        for step, metrics in events_by_step(events):
            self.log_metrics(metrics, step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_name(name: str) -> str:
    """`name` with the characters mlflow refuses in a metric or param name replaced by '_'."""
    return _MLFLOW_UNSAFE.sub("_", name)


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys ("optimizer.params.lr"), values as JSON text (strings as
    they are), cut to MLflow's length limit. An empty section stays as "{}" so its key is still there."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat |= flat_params(value, f"{name}.")
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            flat[mlflow_name(name)] = text[:MLFLOW_MAX_PARAM_LENGTH]
    return flat
