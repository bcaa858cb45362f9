"""The job's objective: what `paratrain train` trains with an `objective` section, and its metrics' names.

A dpo objective trains on `data.format: "preference"` pairs (docs/objectives.md). Its metrics ride in each step's
row of metrics.jsonl / metrics.csv by TRL's names (`rewards/chosen`, `rewards/rejected`, `rewards/accuracies`,
`rewards/margins`, `logps/chosen`, `logps/rejected`), an evaluation's with `eval/` before them; the trackers get
them as TRL's Trainer logs them there: `train/rewards/accuracies`, `eval/rewards/accuracies`, ...
"""

from __future__ import annotations

from paratrain.config import ConfigError


def check_objective_job(cfg) -> None:
    """Every rank, before the model is built: the objective has the data it trains on."""
    kind = cfg.objective.type
    if kind == "grpo":
        raise ConfigError("objective.type \"grpo\" trains on rollouts (completions with advantages), which "
                          "`paratrain train` does not make yet: train GRPO's loss through paratrain.initialize "
                          "with your rollouts (docs/objectives.md)")
    if kind == "dpo" and not cfg.data.train:
        raise ConfigError("objective.type \"dpo\" trains on preference pairs: set data.train to a file of records "
                          "with prompt, chosen and rejected, and data.format to \"preference\" (docs/data.md)")
    if cfg.data.format == "preference" and cfg.trainer.samples is not None:
        raise ConfigError("trainer.samples generates from prompts in the data format, which is not built for "
                          "data.format \"preference\" yet; remove trainer.samples")


def metric_names(engine) -> tuple[str, ...]:
    """The objective's metric names (TRL's), none for next-token cross-entropy."""
    return engine.objective.metrics.names if engine.objective is not None else ()


def eval_columns(engine, validating: bool) -> tuple[str, ...]:
    """metrics.csv's columns of an evaluation (none without one): the validation loss and the objective's eval/
    metrics."""
    return ("val_loss", *(f"eval/{name}" for name in metric_names(engine))) if validating else ()


def tracked(row: dict, names: dict[str, str], objective: tuple[str, ...]) -> dict[str, float]:
    """A metrics row's values for the trackers: `names` (row key -> tracker name) and the objective's metrics,
    a training step's under train/, an evaluation's (already eval/...) as they are."""
    out = {name: row[key] for key, name in names.items() if row.get(key) is not None}
    for name in objective:
        if name in row:
            out[f"train/{name}"] = row[name]
        if f"eval/{name}" in row:
            out[f"eval/{name}"] = row[f"eval/{name}"]
    return out
