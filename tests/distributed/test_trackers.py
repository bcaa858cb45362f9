"""Experiment tracking (docs/evaluation.md), on one spawned rank: a W&B offline run (no network) and an MLflow
run on a local file store get every optimizer step's metrics under transformers' Trainer names at the optimizer
step, evaluation through engine.log_metrics, and the resolved config; a backend that raises while writing is
warned about once and dropped while training goes on. (wandb starts its service process, and importing mlflow
runs `uname`, so these live here rather than in tests/unit.)"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
from pathlib import Path

import pytest
import torch

from tests.cases import WarningLines, adamw_config, corpus_windows, import_or_skip, tiny_gpt

# No network, no prompts, nothing printed: what a CI machine (or an air-gapped cluster) gets.
QUIET = {"WANDB_SILENT": "true", "WANDB_MODE": "offline", "MLFLOW_DISABLE_TELEMETRY": "true"}
WARMUP = {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_type": "linear"}}  # lr differs per step


@contextlib.contextmanager
def _environment(**values: str):
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)


def _train(config: dict, steps: int = 3, evaluation: float | None = None) -> dict:
    """Train `steps` optimizer steps of the tiny GPT in this process; the losses and learning rates seen."""
    import paratrain

    engine, _, loader, _ = paratrain.initialize(model=tiny_gpt(), config=config, training_data=corpus_windows())
    batches, losses, rates = iter(loader), [], []
    for _ in range(steps):
        losses.append(float(engine.train_batch(batches)))
        rates.append(engine.get_lr()[0])
    if evaluation is not None:
        engine.log_metrics({"eval/loss": torch.tensor(evaluation)})  # at the current step (3)
    engine.destroy()  # closes the monitors: the runs finish
    return {"losses": losses, "rates": rates, "steps": engine.global_steps}


def train_with_wandb(directory: str) -> dict:
    with _environment(**QUIET, WANDB_DIR=directory):
        return _train(adamw_config(train_micro_batch_size_per_gpu=2, scheduler=WARMUP, wandb={
            "enabled": True, "project": "paratrain-test", "group": "g", "mode": "offline", "dir": directory}),
            evaluation=2.5)


def read_wandb_run(run_file: Path) -> tuple[dict, list[dict]]:
    """The config and the history rows of an offline run's .wandb file: a leveldb-style log (a 7-byte header,
    then 32 KiB blocks of records, each a 7-byte header and a piece of one protobuf `Record`)."""
    from wandb.proto import wandb_internal_pb2

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B"
    position, pending, records = 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:  # zero-filled rest of the block
            position += block - position % block
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    config = {item.key: json.loads(item.value_json) for r in records if r.HasField("run")
              for item in r.run.config.update}
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.HasField("history")]
    return config, history


def test_a_wandb_offline_run_holds_the_steps_evaluation_and_config(world1, tmp_path):
    import_or_skip("wandb")
    trained = world1.run(train_with_wandb, str(tmp_path))[0]
    [run_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    config, history = read_wandb_run(run_file)
    steps = [row for row in history if "train/loss" in row]
    assert [row["train/global_step"] for row in steps] == [1, 2, 3]  # the x-axis: the optimizer step
    assert [row["train/loss"] for row in steps] == pytest.approx(trained["losses"], rel=1e-6)
    assert [row["train/learning_rate"] for row in steps] == pytest.approx(trained["rates"])
    assert len(set(trained["rates"])) == 3 and all(row["train/grad_norm"] > 0 for row in steps)
    assert [row["train/samples"] for row in steps] == [2, 4, 6]
    assert [(row["train/global_step"], row["eval/loss"]) for row in history if "eval/loss" in row] == [(3, 2.5)]
    assert config["optimizer"]["params"]["lr"] == 3e-3 and config["train_micro_batch_size_per_gpu"] == 2
    assert config["wandb"]["mode"] == "offline" and config["scheduler"]["type"] == "WarmupLR"


def train_with_a_broken_csv_monitor(directory: str) -> dict:
    """csv_monitor raises on every write; MLflow beside it must still get every step."""
    from paratrain.engine.monitor_files import CsvMonitor

    warnings, logger, writes = WarningLines(), logging.getLogger("paratrain"), []

    def broken(self, events):
        writes.append(events)
        raise OSError("disk full")

    healthy, CsvMonitor.write = CsvMonitor.write, broken
    logger.addHandler(warnings)
    try:
        with _environment(**QUIET):
            trained = _train(adamw_config(
                train_micro_batch_size_per_gpu=2,
                csv_monitor={"enabled": True, "output_path": directory, "job_name": "csv"},
                mlflow={"enabled": True, "tracking_uri": str(Path(directory) / "mlruns"),  # a plain path
                        "experiment_name": "broken"}), evaluation=2.5)
    finally:
        CsvMonitor.write = healthy
        logger.removeHandler(warnings)
    return {**trained, "writes": len(writes), "warnings": warnings.lines}


def test_a_backend_that_raises_is_dropped_once_and_training_goes_on(world1, tmp_path):
    import_or_skip("mlflow")
    trained = world1.run(train_with_a_broken_csv_monitor, str(tmp_path))[0]
    assert trained["steps"] == 3 and all(torch.isfinite(torch.tensor(trained["losses"])))
    assert trained["writes"] == 1  # dropped at its first failure: never called again
    assert [line for line in trained["warnings"] if "failed" in line] == [
        "csv_monitor failed (OSError: disk full) and is dropped; training continues without it"]
    with _environment(**QUIET, MLFLOW_ALLOW_FILE_STORE="true"):
        client, run = _only_mlflow_run(f"file:{tmp_path / 'mlruns'}", "broken")
        assert _history(client, run.info.run_id, "train/loss") == [
            (step, pytest.approx(loss, rel=1e-6)) for step, loss in enumerate(trained["losses"], 1)]
        assert _history(client, run.info.run_id, "eval/loss") == [(3, 2.5)]


def train_the_job_with_mlflow(directory: str) -> list[dict]:
    from paratrain.trainer import train

    with _environment(**QUIET):
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        train(adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, scheduler=WARMUP,
                           mlflow={"enabled": True, "tracking_uri": f"file:{directory}/mlruns",
                                   "experiment_name": "tiny", "run_name": "r1"},
                           trainer={"model": "gpt-tiny", "steps": 3, "eval_every": 3, "eval_batches": 1,
                                    "run_dir": f"{directory}/run", "progress_bar": False}))
    return [json.loads(line) for line in Path(directory, "run", "metrics.jsonl").read_text().splitlines()]


def test_the_trainer_logs_steps_evaluation_and_config_to_an_mlflow_file_store(world1, tmp_path):
    import_or_skip("mlflow")
    rows = world1.run(train_the_job_with_mlflow, str(tmp_path))[0]
    with _environment(**QUIET, MLFLOW_ALLOW_FILE_STORE="true"):
        client, run = _only_mlflow_run(f"file:{tmp_path / 'mlruns'}", "tiny")
        assert (run.info.run_name, run.info.status) == ("r1", "FINISHED")  # closed at the end (the trainer closes it)
        history = {name: _history(client, run.info.run_id, name) for name in (
            "train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_s", "eval/loss")}
    assert history["train/loss"] == [(row["step"], pytest.approx(row["loss"], rel=1e-6)) for row in rows]
    assert history["train/learning_rate"] == [(row["step"], pytest.approx(row["lr"])) for row in rows]
    assert len({rate for _, rate in history["train/learning_rate"]}) == 3  # warmup: one value per step
    assert [step for step, _ in history["train/grad_norm"]] == [1, 2, 3]
    assert [step for step, _ in history["train/tokens_per_s"]] == [1, 2, 3]
    assert history["eval/loss"] == [(3, pytest.approx(rows[-1]["val_loss"]))]
    params = run.data.params
    assert params["optimizer.type"] == "AdamW" and float(params["optimizer.params.lr"]) == 3e-3
    assert json.loads(params["optimizer.params.betas"]) == [0.9, 0.95] and params["trainer.model"] == "gpt-tiny"


def _only_mlflow_run(uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1
    return client, runs[0]


def _history(client, run_id: str, name: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))



CLIP = 0.05  # below every step's norm: clipping acts at each step


def _tracker_config(directory: str, reduction: str) -> dict:
    return adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, gradient_clipping=CLIP,
                        loss={"reduction": reduction}, mlflow={"enabled": True, "experiment_name": reduction,
                                                               "tracking_uri": f"file:{directory}/mlruns"})


def train_two_ranks_with_mlflow(directory: str) -> dict:
    """3 steps on 2 data-parallel ranks through forward/backward/step, so each rank's micro-batch losses are
    seen, once per loss reduction."""
    import paratrain

    out = {}
    with _environment(**QUIET):
        for reduction in ("token", "micro_batch"):
            engine, _, loader, _ = paratrain.initialize(model=tiny_gpt(), config=_tracker_config(directory, reduction),
                                                        training_data=corpus_windows())
            batches, micro_losses, norms = iter(loader), [], []
            for _ in range(3):
                step_losses = []
                for _ in range(engine.gradient_accumulation_steps()):
                    loss = engine(*next(batches))
                    engine.backward(loss)
                    engine.step()
                    step_losses.append(float(loss.detach()))
                micro_losses.append(step_losses)
                norms.append(engine.get_global_grad_norm())
            engine.destroy()
            out[reduction] = {"micro_losses": micro_losses, "norms": norms}
    return out


def test_the_tracker_logs_the_engines_loss_and_the_norm_before_clipping_on_2_ranks(world2, tmp_path):
    """train/grad_norm is the global norm before clipping, and train/loss the step's loss (under the "token"
    reduction the global mean, under "micro_batch" rank 0's mean micro-batch loss), at every step: against the
    ranks' own losses and a one-process reference's pre-clip norm (torch's clip_grad_norm_)."""
    import_or_skip("mlflow")
    from paratrain.testing.reference import reference_run

    ranks = world2.run(train_two_ranks_with_mlflow, str(tmp_path))
    # every micro-batch has as many target tokens: both reductions train the reference's steps
    reference = reference_run(tiny_gpt, {**_tracker_config(str(tmp_path), "token"), "train_batch_size": 8},
                              corpus_windows(), 3)
    assert all(norm > 2 * CLIP for norm in reference.grad_norms)  # the clip acts at every step
    for reduction in ("token", "micro_batch"):
        with _environment(**QUIET, MLFLOW_ALLOW_FILE_STORE="true"):
            client, run = _only_mlflow_run(f"file:{tmp_path / 'mlruns'}", reduction)
            losses, norms = (_history(client, run.info.run_id, name) for name in ("train/loss", "train/grad_norm"))
        rank0, rank1 = (r[reduction]["micro_losses"] for r in ranks)
        every_rank = [sum(a + b) / (len(a) + len(b)) for a, b in zip(rank0, rank1)]
        assert every_rank == pytest.approx(reference.losses, rel=1e-5), reduction  # the ranks' losses are real
        rank0_mean = [sum(step) / len(step) for step in rank0]
        assert rank0_mean != pytest.approx(every_rank, rel=1e-6)  # rank 0's mean is not the global one
        logged = every_rank if reduction == "token" else rank0_mean
        assert losses == [(step, pytest.approx(loss, rel=1e-5)) for step, loss in enumerate(logged, 1)], reduction
        assert ranks[0][reduction]["norms"] == ranks[1][reduction]["norms"] == \
            pytest.approx(reference.grad_norms, rel=1e-5), reduction
        assert norms == [(step, pytest.approx(norm, rel=1e-5)) for step, norm in enumerate(reference.grad_norms, 1)]
