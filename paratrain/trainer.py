"""The built-in job behind `paratrain train`: the GPT on the embedded corpus, in any configured layout.

It writes a run directory: `config.json` (resolved), `metrics.jsonl` and `metrics.csv` (one row per step),
`summary.json`, and with pipeline.stages > 1 `timeline.json` (the last step's actions per rank, for
`paratrain report`). Rank 0 shows a progress bar with loss, tokens/s, model-state memory and comm bytes/step.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import time
from pathlib import Path

import torch

import paratrain.comm as comm
from paratrain.api import initialize
from paratrain.config import load_config
from paratrain.data import DataParallelLoader, DataParallelSampler, TokenWindows, corpus_fingerprint, load_corpus
from paratrain.distributed import init_distributed
from paratrain.models import GPT
from paratrain.monitor import peak_rss_bytes


class MetricsWriter:
    """Rank 0 appends one JSON line and one CSV row per step; both files are flushed as they grow.

    A run resumed from a checkpoint at step k keeps the rows of steps 1..k (`kept`) and rewrites the rest, so
    the files read as one uninterrupted run.
    """

    def __init__(self, run_dir: Path, enabled: bool, resumed_at: int = 0):
        self.enabled = enabled
        self._csv = None
        self.kept: list[dict] = []
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            path = run_dir / "metrics.jsonl"
            if resumed_at and path.is_file():
                rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                self.kept = [r for r in rows if r["step"] <= resumed_at]
            self._jsonl = path.open("w")
            self._csv_file = (run_dir / "metrics.csv").open("w", newline="")
            for row in self.kept:
                self.write(row)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        flat = {k: v for k, v in row.items() if not isinstance(v, (list, dict))}
        if self._csv is None:
            self._csv = csv.DictWriter(self._csv_file, fieldnames=list(flat), extrasaction="ignore")
            self._csv.writeheader()
        self._csv.writerow(flat)
        self._csv_file.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._csv_file.close()


def _progress(total: int, enabled: bool, stack: contextlib.ExitStack):
    if not enabled:
        return None
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    # The engine's steps_per_print lines go above the bar instead of through it.
    stack.enter_context(logging_redirect_tqdm(loggers=[logging.getLogger("paratrain")]))
    return tqdm(total=total, desc="train", dynamic_ncols=True, mininterval=0.5)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}MiB"


def train(config_source, run_dir: str | None = None, steps: int | None = None) -> dict:
    """Train the configured GPT; returns the summary (also written to run_dir/summary.json on rank 0)."""
    cfg = load_config(config_source)
    init_distributed(timeout=cfg.comm.timeout_s)
    t = cfg.trainer
    steps = steps or t.steps
    torch.manual_seed(cfg.seed)
    model = GPT(t.model, **t.model_overrides)
    num_params = model.num_params()  # before parallelizing: the model is split in place
    seq_len = model.config.seq_len
    train_tokens, val_tokens = load_corpus()
    train_data = TokenWindows(train_tokens, seq_len)
    out = Path(run_dir or t.run_dir)
    if not cfg.comm.report_dir:  # hang reports land next to the metrics
        cfg.comm.report_dir = str(out)
    engine, _, loader, _ = initialize(model=model, config=cfg, training_data=train_data)
    rank0 = engine.global_rank == 0
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        resolved = engine.config.model_dump(mode="json")
        (out / "config.json").write_text(json.dumps(resolved, indent=2))
    metrics = MetricsWriter(out, rank0, resumed_at=engine.global_steps)
    val_data = TokenWindows(val_tokens, seq_len)

    def val_loader() -> DataParallelLoader:  # the same validation batches at every evaluation
        return DataParallelLoader(val_data, DataParallelSampler(
            len(val_data), engine.train_micro_batch_size_per_gpu(), engine.pmesh.size("dp"),
            engine.pmesh.local_rank("dp"), seed=cfg.seed, shuffle=False))

    tokens_per_step = engine.train_batch_size() * seq_len
    redirect = contextlib.ExitStack()
    done = engine.global_steps  # > 0 when initialize() resumed from a checkpoint (checkpoint.auto_resume)
    bar = _progress(steps, rank0 and t.progress_bar, redirect)
    if bar is not None and done:
        bar.update(done)
    engine.comm_stats(reset=True)
    first_loss = metrics.kept[0]["loss"] if metrics.kept else None
    last_loss = metrics.kept[-1]["loss"] if metrics.kept else None
    val_loss = None
    start = time.perf_counter()
    for step in range(done + 1, steps + 1):
        tic = time.perf_counter()
        loss = float(engine.train_batch(loader))
        elapsed = time.perf_counter() - tic
        stats = engine.comm_stats(reset=True)
        comm_bytes = sum(c["bytes"] for ops in stats.values() for c in ops.values())
        memory = engine.memory_stats()
        first_loss = loss if first_loss is None else first_loss
        last_loss = loss
        row = {"step": step, "loss": loss, "lr": engine.get_lr()[0], "grad_norm": engine.get_global_grad_norm(),
               "step_time_s": elapsed, "tokens_per_s": tokens_per_step / elapsed, "state_bytes": memory["total"],
               "comm_bytes": comm_bytes, "comm": stats}
        if t.eval_every and (step % t.eval_every == 0 or step == steps):
            val_loss = float(engine.eval_batch(val_loader(), num_micro_batches=t.eval_batches))
            row["val_loss"] = val_loss
            engine.comm_stats(reset=True)  # evaluation traffic is not the next training step's
        if step % cfg.steps_per_print == 0 or step == steps:
            # Every rank's model-state bytes and peak RSS (a small all-gather, counted under the "metrics" tag).
            per_rank = comm.all_gather_object((memory["total"], peak_rss_bytes()), engine.pmesh.axis(
                ("dp", "pp", "cp", "tp")), tag="metrics")
            row["state_bytes_per_rank"] = [state for state, _ in per_rank]
            row["peak_rss_per_rank"] = [rss for _, rss in per_rank]
            engine.comm_stats(reset=True)
        metrics.write(row)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tokens_per_s']:.0f}", state=_mib(memory["total"]),
                            comm=f"{_mib(comm_bytes)}/step", refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    redirect.close()
    metrics.close()
    ck = cfg.checkpoint
    if ck.dir and steps > done and not (ck.save_every and steps % ck.save_every == 0):
        engine.save_checkpoint(ck.dir)  # the final state, unless the last step just saved it
    timeline = engine.pipeline_timeline()  # collective; None without a pipeline
    if timeline is not None and rank0:
        (out / "timeline.json").write_text(json.dumps(timeline))
    total = time.perf_counter() - start
    summary = {"steps": steps, "first_loss": first_loss, "last_loss": last_loss, "val_loss": val_loss,
               "resumed_at": done, "tokens_per_s": (steps - done) * tokens_per_step / max(total, 1e-9),
               "wall_s": total, "world_size": engine.world_size,
               "layout": engine.pmesh.dims.describe(), "params": num_params,
               "corpus": corpus_fingerprint(), "run_dir": str(out)}
    if rank0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        validation = f", validation {val_loss:.3f}" if val_loss is not None else ""
        resumed = f" (resumed at step {done})" if done else ""
        losses = f"{first_loss:.3f} -> {last_loss:.3f}" if last_loss is not None else "-"
        print(f"trained {steps} steps{resumed} on {engine.world_size} process(es) [{summary['layout']}]: loss "
              f"{losses}{validation}, {summary['tokens_per_s']:.0f} tokens/s; run directory {out}")
    comm.barrier(engine.pmesh.axis(("dp", "pp", "cp", "tp")))  # guarded like every other collective
    return summary
