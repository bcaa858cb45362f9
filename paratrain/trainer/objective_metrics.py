"""The job's objective: what `paratrain train` trains with an `objective` section, and its metrics' names.

A dpo objective trains on `data.format: "preference"` pairs (docs/objectives.md); a grpo objective is an online
job (`grpo_job.py`) that samples from `data.format: "prompt"` rows and scores with trainer.reward_funcs. Its
metrics ride in each step's row of metrics.jsonl / metrics.csv by TRL's names (`rewards/chosen`,
`rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`), an evaluation's
with `eval/` before them; the trackers get them as TRL's Trainer logs them there: `train/rewards/accuracies`,
`eval/rewards/accuracies`, ...
"""

from __future__ import annotations

from paratrain.config import ConfigError


def check_objective_job(cfg) -> None:
    """Every rank, before the model is built: the objective has the data it trains on."""
    kind = cfg.objective.type
    if kind == "grpo":
        check_grpo_job(cfg)
        return
    if kind == "dpo" and not cfg.data.train:
        raise ConfigError("objective.type \"dpo\" trains on preference pairs: set data.train to a file of records "
                          "with prompt, chosen and rejected, and data.format to \"preference\" (docs/data.md)")
    if cfg.data.format == "preference" and cfg.trainer.samples is not None:
        raise ConfigError("trainer.samples generates from prompts in the data format, which is not built for "
                          "data.format \"preference\" yet; remove trainer.samples")


def check_grpo_job(cfg) -> None:
    """A grpo job samples from prompts and scores with reward functions; its steps come in rollout batches of
    num_iterations (μ) updates, so the step counts that cut the run are whole batches."""
    o, t = cfg.objective, cfg.trainer
    if not cfg.data.train or not t.reward_funcs:
        missing = "data.train (a file of prompt records, data.format \"prompt\")" if not cfg.data.train else \
            "trainer.reward_funcs (e.g. [\"rewards.py:correct\"])"
        raise ConfigError(f"objective.type \"grpo\" samples completions for prompts and scores them: set {missing} "
                          f"(docs/objectives.md)")
    for key, on in (("data.validation", cfg.data.validation), ("trainer.samples", t.samples),
                    ("trainer.early_stopping", t.early_stopping), ("trainer.eval_at_start", t.eval_at_start)):
        if on:
            raise ConfigError(f"{key}: a grpo job does not evaluate held-out data yet (its report shows the last "
                              f"step's completions); remove {key}")
    mu = o.num_iterations
    for key, value in (("trainer.steps", t.steps), ("checkpoint.save_every", cfg.checkpoint.save_every),
                       ("trainer.save_pretrained_every", t.save_pretrained_every)):
        if value % mu:
            raise ConfigError(f"{key} = {value} is not a multiple of objective.num_iterations = {mu}: each rollout "
                              f"batch is {mu} optimizer steps, and the job stops and saves between batches; set "
                              f"{key} to a multiple of {mu}")


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
