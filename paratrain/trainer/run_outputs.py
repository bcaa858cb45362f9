"""What every `paratrain train` job does around its steps (`job.py`'s next-token and DPO job, `grpo_job.py`'s
online GRPO job): rank 0's progress bar, the final checkpoint and pipeline timeline, save_pretrained, and the
summary (summary.json and the closing line)."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path


def progress_bar(total: int, enabled: bool, stack: contextlib.ExitStack):
    """Rank 0's bar (None when disabled); the engine's steps_per_print lines go above it instead of through it."""
    if not enabled:
        return None
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    stack.enter_context(logging_redirect_tqdm(loggers=[logging.getLogger("paratrain")]))
    return tqdm(total=total, desc="train", dynamic_ncols=True, mininterval=0.5)


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}MiB"


def duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def mean(values) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def save_pretrained_model(engine, directory: str) -> None:
    """trainer.save_pretrained (collective): the model as transformers loads it; with adapters, the adapter as peft
    loads it, or with trainer.save_merged both: the adapter in `adapter/`, the merged model in `merged/`."""
    if engine.adapters is None or not engine.config.trainer.save_merged:
        engine.save_pretrained(directory)
        return
    engine.save_pretrained(Path(directory) / "adapter")
    engine.save_pretrained(Path(directory) / "merged", merged=True)


def finish(engine, out: Path, steps: int, done: int) -> None:
    """The final checkpoint (unless the last step just saved it) and the pipeline timeline (collective)."""
    ck = engine.config.checkpoint
    if ck.dir and steps > done and not (ck.save_every and steps % ck.save_every == 0):
        engine.save_checkpoint(ck.dir)
    engine.wait_for_checkpoint()  # checkpoint.async_save: the run ends with its last checkpoint written
    timeline = engine.pipeline_timeline()  # collective; None without a pipeline
    if timeline is not None and engine.global_rank == 0:
        (out / "timeline.json").write_text(json.dumps(timeline))


def write_summary(summary: dict, out: Path, extra: str = "") -> None:
    """summary.json, and the run's closing line (`extra`: what the job adds to it, e.g. the reward)."""
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    val, done = summary["val_loss"], summary["resumed_at"]
    validation = f", validation {val:.3f}" if val is not None else ""
    if summary["stopped_early_at"] is not None:
        validation += (f", stopped early at step {summary['stopped_early_at']} (best validation "
                       f"{summary['best_val_loss']:.3f} at step {summary['best_val_step']})")
    resumed = f" (resumed at step {done})" if done else ""
    losses = f"{summary['first_loss']:.3f} -> {summary['last_loss']:.3f}" if summary["last_loss"] is not None else "-"
    print(f"trained {summary['steps']} steps{resumed} on {summary['world_size']} process(es) [{summary['layout']}]: "
          f"loss {losses}{extra}{validation}, {summary['tokens_per_s']:.0f} tokens/s; run directory {out}")
