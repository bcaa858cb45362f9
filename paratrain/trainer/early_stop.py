"""The validation losses of a `paratrain train` run: the best one so far, and when to stop because they have
stopped improving (`trainer.early_stopping`). Every rank keeps its own tracker and decides alone: the losses it
is given are the same number on every rank (`engine.evaluate` ends in one all-reduce, so no rank can stop
while another trains on)."""

from __future__ import annotations

from paratrain.config.outputs import EarlyStoppingConfig


class ValidationTracker:
    """`observe` each evaluation in step order; `stopped_at` is the step of the evaluation that ended the
    patience (None while training goes on, and always without early stopping)."""

    def __init__(self, early_stopping: EarlyStoppingConfig | None):
        self.settings = early_stopping
        self.best_loss: float | None = None
        self.best_step: int | None = None
        self.without_improvement = 0  # evaluations in a row since the best
        self.stopped_at: int | None = None

    def observe(self, step: int, val_loss: float) -> bool:
        """Record an evaluation; True when the run should stop after this step."""
        min_delta = self.settings.min_delta if self.settings is not None else 0.0
        if self.best_loss is None or val_loss < self.best_loss - min_delta:
            self.best_loss, self.best_step, self.without_improvement = val_loss, step, 0
        else:
            self.without_improvement += 1
        if self.settings is not None and self.without_improvement >= self.settings.patience:
            self.stopped_at = step
        return self.stopped_at is not None

    def summary(self) -> dict:
        return {"best_val_loss": self.best_loss, "best_val_step": self.best_step, "stopped_early_at": self.stopped_at}
