"""The built-in job behind `paratrain train`: a GPT or Llama preset, or a Hugging Face model directory, on the
embedded corpus or on the `data` section's files (a fine-tuning job, docs/data.md), in any configured layout.

It writes a run directory: `config.json` (resolved), `metrics.jsonl` and `metrics.csv` (one row per step; an
MoE model's rows add the moe_* scalars and, in metrics.jsonl, `moe_tokens` {layer: tokens per expert}; every
row has the step's epoch, sample ids and `loader_wait_s`, a data job's its `padding_fraction` too),
`summary.json`, and with pipeline.stages > 1 `timeline.json` (the last step's actions per rank, for
`paratrain report`). Rank 0 shows a progress bar with loss, tokens/s, model-state memory, comm bytes/step and
the time left. Rows carry `eta_s`; evaluations add `val_loss` (`engine.evaluate`), trainer.eval_at_start a
row of step 0, and trainer.early_stopping may end the run early (docs/evaluation.md). With an objective (dpo on
data.format "preference") rows add its metrics by TRL's names (`rewards/accuracies`, ...; evaluations
`eval/rewards/accuracies`, ...), also sent to the trackers (`objective_metrics.py`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import torch

import paratrain.comm as comm
from paratrain.api import initialize, layout_label
from paratrain.config import ConfigError, load_config
from paratrain.config.fault_tolerance import GROUPS_ENV
from paratrain.data import (
    TokenWindows,
    corpus_fingerprint,
)
from paratrain.data.tokenizer import load_tokenizer
from paratrain.distributed import init_distributed
from paratrain.engine.monitor import peak_rss_bytes
from paratrain.failure import install_excepthook
from paratrain.trainer.early_stop import ValidationTracker
from paratrain.trainer.grpo_job import train_grpo
from paratrain.trainer.inputs import (
    TimedLoader,
    check_validation_size,
    corpus_ids,
    job_model,
    job_rows,
    split_validation,
    trainer_text,
)
from paratrain.trainer.metrics_writer import MetricsWriter
from paratrain.trainer.objective_metrics import check_objective_job, eval_columns, metric_names, tracked
from paratrain.trainer.replica_groups import train_replica_group
from paratrain.trainer.run_outputs import (
    duration,
    finish,
    mean,
    mib,
    progress_bar,
    save_pretrained_model,
    write_summary,
)
from paratrain.trainer.samples import Evaluator

# A row's values that every monitor and tracker gets too (engine.log_metrics), by transformers' Trainer names.
TRACKED = {"tokens_per_s": "train/tokens_per_s", "epoch": "train/epoch", "val_loss": "eval/loss",
           "eta_s": "train/eta_s", "step_time_s": "train/step_time_s", "state_bytes": "train/model_state_bytes"}


def _start(cfg, run_dir: str | None):
    """The model, its data (the `data` section's files, or the corpus) and the engine (resumed when
    checkpoint.auto_resume finds a checkpoint)."""
    t = cfg.trainer
    check_objective_job(cfg)
    torch.manual_seed(cfg.seed)
    if cfg.data.train and t.text:
        raise ConfigError(f"trainer.text = '{t.text}' and data.train = '{cfg.data.train}' both name what to train "
                          f"on; keep one (data.train reads .jsonl/.json/.parquet/.txt with formats and packing)")
    built = job_model(t)
    model, model_dir, seq_len, vocab, positions = built.model, built.directory, built.seq_len, built.vocab, \
        built.positions
    info = {"params": built.params, "seq_len": seq_len}
    if cfg.data.train:
        train_data, val_data, info["data"] = job_rows(cfg, model_dir, seq_len, vocab, positions)
        info["seq_len"] = train_data.seq_len
    else:
        ids = corpus_ids(trainer_text(t), model_dir, vocab)
        (train_ids, val_ids) = split_validation(ids)
        train_data, val_data = TokenWindows(train_ids, seq_len), TokenWindows(val_ids, seq_len)
    out = Path(run_dir or t.run_dir)
    if not cfg.comm.report_dir:  # hang reports land next to the metrics
        cfg.comm.report_dir = str(out)
    needs_validation = [key for key, on in (("trainer.early_stopping", t.early_stopping is not None),
                                            ("trainer.eval_at_start", t.eval_at_start),
                                            ("trainer.samples", t.samples is not None)) if on]
    if val_data is None and needs_validation:
        key = needs_validation[0]
        raise ConfigError(f"{key} needs validation rows, but data.train = '{cfg.data.train}' has no data.validation; "
                          f"set data.validation to a file of validation records, or remove {key}")
    info["sequences_per_sample"] = getattr(train_data, "sequences_per_sample", 1)  # a preference pair: 2 rows
    engine, _, loader, _ = initialize(model=model, config=cfg, training_data=train_data,
                                      collate_fn=getattr(train_data, "collate_fn", None))  # pairs: their collator
    check_validation_size(engine, val_data)
    evaluator = None if val_data is None else \
        Evaluator(val_data, t.samples, load_tokenizer(model_dir) if t.samples else None,
                  cfg.data.format if cfg.data.train else "text", cfg.data.fields, info["seq_len"], vocab)
    if engine.global_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(engine.config.model_dump(mode="json"), indent=2))
    return engine, loader, evaluator, out, info


def _step(engine, loader: TimedLoader, evaluator: Evaluator | None, step: int, steps: int,
          tokens_per_step: int) -> dict:
    """Train one step and return its metrics row (validation and per-rank memory when due)."""
    cfg, t = engine.config, engine.config.trainer
    epoch, samples = loader.next_global_batch()
    dataset = loader.loader.dataset  # the data section's rows know their padding (asked before the step takes them)
    padding = dataset.padding_fraction(samples) if hasattr(dataset, "padding_fraction") else None
    tic = time.perf_counter()
    loss = float(engine.train_batch(loader))
    elapsed = time.perf_counter() - tic  # a checkpoint's stall included, when the step saved one
    objective = engine.objective_metrics()  # rewards/accuracies, ... (TRL's names); empty for next-token loss
    stats = engine.comm_stats(reset=True)
    memory = engine.memory_stats()
    row = {"step": step, "loss": loss, "lr": engine.get_lr()[0], "grad_norm": engine.get_global_grad_norm(),
           "step_time_s": elapsed, "tokens_per_s": tokens_per_step / elapsed, "state_bytes": memory["total"],
           "comm_bytes": sum(c["bytes"] for ops in stats.values() for c in ops.values()), "comm": stats,
           "loader_wait_s": loader.take_wait(), "epoch": epoch, "samples": samples}
    if padding is not None:
        row["padding_fraction"] = padding
    row.update(objective)
    row.update(engine.checkpoint_timings())  # the save after the last row: its stall and step; write_s once written
    routing = engine.moe_routing()  # MoE: the step's routing over dp x cp (every step reduces it: _run_steps)
    if routing is not None:
        row.update(routing.row())
    if evaluator is not None and t.eval_every and (step % t.eval_every == 0 or step == steps):
        row.update(evaluator(engine))  # val_loss, and the sample generations
    if step % cfg.steps_per_print == 0 or step == steps:
        # Every rank's model-state bytes and peak RSS (a small all-gather, counted under the "metrics" tag).
        per_rank = comm.all_gather_object((memory["total"], peak_rss_bytes()), engine.mesh.world, tag="metrics")
        row["state_bytes_per_rank"] = [state for state, _ in per_rank]
        row["peak_rss_per_rank"] = [rss for _, rss in per_rank]
        engine.comm_stats(reset=True)
    return row


def train(config_source, run_dir: str | None = None, steps: int | None = None,
          save_pretrained: str | None = None) -> dict:
    """Train the configured model (a GPT or Llama preset); returns the summary (also written to
    run_dir/summary.json on rank 0)."""
    install_excepthook()  # under a launcher an uncaught error is reported once for the job (paratrain.failure)
    cfg = load_config(config_source)
    if os.environ.get(GROUPS_ENV):  # started by `paratrain train --replica-groups R`
        cfg = load_config({**cfg.model_dump(mode="json", exclude_unset=True), "fault_tolerance": {
            **cfg.fault_tolerance.model_dump(mode="json", exclude_unset=True), "enabled": True,
            "replica_groups": int(os.environ[GROUPS_ENV])}})
    init_distributed(timeout=cfg.comm.timeout_s)
    steps, save_pretrained = steps or cfg.trainer.steps, save_pretrained or cfg.trainer.save_pretrained
    if cfg.objective.type == "grpo":  # online: prompts in, rollouts sampled each step (grpo_job.py)
        return train_grpo(cfg, run_dir, steps, save_pretrained)
    if cfg.fault_tolerance.enabled:  # one replica group of several (replica_groups.py)
        return train_replica_group(cfg, run_dir, steps, _start)
    return _train_rows(cfg, run_dir, steps, save_pretrained)


def _train_rows(cfg, run_dir: str | None, steps: int, save_pretrained: str | None) -> dict:
    """The next-token or DPO job on its rows (or the corpus's windows), after init_distributed."""
    engine, loader, evaluator, out, model = _start(cfg, run_dir)
    rank0 = engine.global_rank == 0
    validating = evaluator is not None and (cfg.trainer.eval_every > 0 or cfg.trainer.eval_at_start)
    metrics = MetricsWriter(out, rank0, resumed_at=engine.global_steps, columns=eval_columns(engine, validating))
    engine.hold_scheduled_saves()  # each step's save waits for its row (_run_steps)
    tokens_per_step = engine.train_batch_size() * model["seq_len"] * model["sequences_per_sample"]
    redirect = contextlib.ExitStack()
    done = engine.global_steps  # > 0 when initialize() resumed from a checkpoint (checkpoint.auto_resume)
    bar = progress_bar(steps, rank0 and cfg.trainer.progress_bar, redirect)
    if bar is not None and done:
        bar.update(done)
    engine.comm_stats(reset=True)
    start, tracker = time.perf_counter(), ValidationTracker(cfg.trainer.early_stopping)
    try:
        rows = _run_steps(engine, TimedLoader(loader), evaluator, range(done + 1, steps + 1), tokens_per_step,
                          metrics, bar, save_pretrained, tracker)
    finally:
        if hasattr(loader, "stream"):  # data.streaming: stop making rows, end the tokenizer workers
            loader.close()
            loader.stream.pool.close()
    if bar is not None:
        bar.close()
    if hasattr(loader, "stream"):  # what tokenizing did to the windows the steps took rows from
        model["data"]["train"] = loader.data_summary()
    redirect.close()
    metrics.close()
    engine.monitor.close()  # flushed; the W&B / MLflow runs finish
    trained = [r for r in rows if "loss" in r]  # step 0's row (eval_at_start) has no training loss
    last = trained[-1]["step"] if trained else done  # before `steps` when early stopping ended the run
    finish(engine, out, last, done)
    if save_pretrained:  # a directory transformers (or peft, for an adapter) loads (collective)
        save_pretrained_model(engine, save_pretrained)
    counts = engine.parameter_counts()  # (collective)
    total = time.perf_counter() - start
    val_losses = [r["val_loss"] for r in rows if "val_loss" in r]
    summary = {"steps": last, "first_loss": trained[0]["loss"] if trained else None,
               "last_loss": trained[-1]["loss"] if trained else None,
               "val_loss": val_losses[-1] if val_losses else None, **tracker.summary(),
               "resumed_at": done, "tokens_per_s": (last - done) * tokens_per_step / max(total, 1e-9),
               "wall_s": total, "world_size": engine.world_size,
               "layout": layout_label(engine.mesh.dims, cfg.zero_optimization.stage),
               "params": counts["trainable"] + counts["frozen"], "trainable_params": counts["trainable"],
               "frozen_params": counts["frozen"], "checkpoints": engine.checkpoint_saves, "run_dir": str(out)}
    if "data" in model:  # the data section: what reading and tokenizing did, and the rows' padding
        summary |= {"data": model["data"], "padding_fraction": mean(r.get("padding_fraction") for r in rows),
                    "loader_wait_s": mean(r.get("loader_wait_s") for r in rows)}
    else:
        summary["corpus"] = cfg.trainer.text or corpus_fingerprint()
    if rank0:
        write_summary(summary, out)
    comm.barrier(engine.mesh.world)  # guarded like every other collective
    return summary


def _run_steps(engine, loader: TimedLoader, evaluator: Evaluator | None, steps: range, tokens_per_step: int,
               metrics: MetricsWriter, bar, save_pretrained: str | None, tracker: ValidationTracker) -> list[dict]:
    """Train `steps` (fewer when early stopping ends the run), writing each step's metrics row and advancing
    the progress bar; the rows' step, loss, validation loss, padding and loader wait, the kept rows of a
    resumed run first (their validation losses replayed into the tracker, so patience survives a restart)."""
    rows = list(metrics.kept)
    for kept in rows:
        if "val_loss" in kept:
            tracker.observe(kept["step"], kept["val_loss"])
    t = engine.config.trainer
    if t.eval_at_start and steps.start == 1 and evaluator is not None:  # before the first step, not on resume
        row = {"step": 0, **evaluator(engine)}
        tracker.observe(0, row["val_loss"])
        rows.append(row)
        metrics.write(row)
        engine.log_metrics(tracked(row, TRACKED, metric_names(engine)), step=0)
    engine.moe_routing()  # every row carries its step's routing: each step reduces it (MoE models only)
    start = time.perf_counter()
    for step in steps if tracker.stopped_at is None else ():
        row = _step(engine, loader, evaluator, step, steps[-1], tokens_per_step)
        # the wall time per step of this run so far (evaluations and data waits included) x the steps left
        row["eta_s"] = (steps[-1] - step) * (time.perf_counter() - start) / (step - steps.start + 1)
        keep = ("step", "loss", "val_loss", "padding_fraction", "loader_wait_s")
        rows.append({k: row[k] for k in keep if k in row})
        metrics.write(row)
        engine.save_held_checkpoint()  # after the row: a checkpoint never names a step whose row a kill could lose
        engine.log_metrics(tracked(row, TRACKED, metric_names(engine)))
        stop = "val_loss" in row and tracker.observe(step, row["val_loss"])  # the same on every rank
        if save_pretrained and t.save_pretrained_every and step % t.save_pretrained_every == 0 \
                and step != steps[-1] and not stop:
            save_pretrained_model(engine, save_pretrained)  # collective
        _show(bar, row)
        if stop:
            break
    return rows


def _show(bar, row: dict) -> None:
    """The step on rank 0's progress bar."""
    if bar is None:
        return
    padding = {"pad": f"{row['padding_fraction']:.0%}"} if "padding_fraction" in row else {}
    bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}", **padding,
                    state=mib(row["state_bytes"]), comm=f"{mib(row['comm_bytes'])}/step",
                    eta=duration(row["eta_s"]), refresh=False)
    bar.update(1)
