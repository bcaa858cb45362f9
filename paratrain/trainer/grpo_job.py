"""The online GRPO job behind `paratrain train` with objective.type "grpo" (docs/objectives.md):

    "objective": {"type": "grpo", "num_generations": 4, "max_completion_length": 12, "num_iterations": 1},
    "data": {"train": "prompts.jsonl", "format": "prompt"},
    "trainer": {"reward_funcs": ["rewards.py:correct"], "steps": 40}

Each rollout batch takes the next global batch of prompts (micro-batch x accumulation / num_generations on each
data-parallel rank, dealt by the data-parallel sampler: shuffled per epoch from the seed), samples num_generations
completions of each in the training layout, scores them and makes num_iterations (μ) optimizer steps on them
(`grpo.GRPOStep`). Nothing depends on the layout: the prompts of a step, their completions (a function of the seed,
the step and the global prompt index) and the rewards are the same in every layout.

The run directory has what every job writes (config.json, summary.json, metrics.jsonl / metrics.csv: one row per
rollout batch, at its last optimizer step, with TRL's names) and `completions.jsonl`: every completion of every step
(its prompt's index, generation, text, token ids and reward). A resumed run (checkpoint.auto_resume) takes the data
position from the optimizer step, so it samples the same rollouts the killed run would have.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

import paratrain.comm as comm
from paratrain.api import initialize, layout_label
from paratrain.config import ConfigError
from paratrain.data.datasets import DataParallelSampler
from paratrain.data.prompt_records import Prompts, read_prompts
from paratrain.data.sources import iter_records
from paratrain.data.tokenizer import load_tokenizer
from paratrain.engine.monitor import peak_rss_bytes
from paratrain.rl import RewardFunctions
from paratrain.trainer.grpo import GRPOSettings, GRPOStep
from paratrain.trainer.inputs import job_model
from paratrain.trainer.metrics_writer import MetricsWriter
from paratrain.trainer.objective_metrics import check_objective_job
from paratrain.trainer.run_outputs import finish, mib, progress_bar, save_pretrained_model, write_summary

SPLIT = ("generation_s", "rewards_s", "update_s")  # a step's time, split (GRPOResult.timings)
SAMPLES_IN_ROW = 4  # completions of a step shown in its metrics row (and the report); completions.jsonl has all
TRACKED = ("loss", "grad_norm", "reward", "reward_std", "kl", "entropy", "logprob_mismatch",
           "completions/mean_length", "completions/clipped_ratio")


@dataclass
class GRPOJob:
    engine: object
    step: GRPOStep
    prompts: Prompts
    sampler: DataParallelSampler
    tokenizer: object
    out: Path
    params: int


def _start(cfg, run_dir: str | None) -> GRPOJob:
    """The model, the prompts, the engine (resumed when checkpoint.auto_resume finds a checkpoint) and the
    prompt sampler at the resumed step's data position."""
    check_objective_job(cfg)
    torch.manual_seed(cfg.seed)
    o, t = cfg.objective, cfg.trainer
    rewards = RewardFunctions.named(t.reward_funcs, t.reward_weights)  # a bad name fails before the model is built
    built = job_model(t)
    seq_len = cfg.data.seq_len or built.seq_len
    limit = built.positions if built.directory is not None else built.seq_len
    if limit is not None and seq_len > limit:
        raise ConfigError(f"data.seq_len = {seq_len} is longer than the model's {limit} positions; lower data.seq_len")
    if o.max_completion_length >= seq_len:
        raise ConfigError(f"objective.max_completion_length = {o.max_completion_length} leaves no room for a prompt "
                          f"in the model's {seq_len} positions (data.seq_len); lower it")
    tokenizer = load_tokenizer(built.directory)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    field = cfg.data.fields.get("prompt", "prompt")
    prompts = read_prompts(iter_records(cfg.data.train), tokenizer, field, seq_len - o.max_completion_length, pad)
    engine, *_ = initialize(model=built.model, config=cfg)
    per_rank = _prompts_per_rank(engine, o.num_generations)
    dp = engine.mesh.size("dp")
    if len(prompts) < per_rank * dp:
        raise ConfigError(f"data.train has {len(prompts)} prompts, fewer than one optimizer step's ({per_rank} per "
                          f"data-parallel rank x {dp} ranks); add prompts, or lower the batch")
    sampler = DataParallelSampler(len(prompts), per_rank, dp, engine.mesh.local_rank("dp"), seed=cfg.seed,
                                  shuffle=cfg.data.shuffle)
    batches = engine.global_steps // o.num_iterations  # the data position is the optimizer step's
    sampler.load_state_dict({"epoch": batches // sampler.micro_batches_per_epoch, "start": 0, "seed": cfg.seed,
                             "position": batches % sampler.micro_batches_per_epoch})
    settings = GRPOSettings(num_generations=o.num_generations, max_completion_length=o.max_completion_length,
                            temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, num_iterations=o.num_iterations,
                            scale_rewards=o.scale_rewards, seed=cfg.seed, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=pad, generation_batch_size=o.generation_batch_size,
                            steps_per_generation=o.steps_per_generation)
    step = GRPOStep(engine, rewards, settings, partial(decode, tokenizer), conversational=prompts.conversational)
    _check_rollout_steps(cfg, step.updates_per_rollout)
    out = Path(run_dir or t.run_dir)
    if not cfg.comm.report_dir:  # hang reports land next to the metrics
        cfg.comm.report_dir = str(out)
    if engine.global_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(engine.config.model_dump(mode="json"), indent=2))
    return GRPOJob(engine, step, prompts, sampler, tokenizer, out, built.params)


def _check_rollout_steps(cfg, updates: int) -> None:
    """Every rank, once the batch is known: the saves fall between rollout batches of num_iterations x
    generation_batch_size / train_batch_size optimizer steps (the run's steps: `train_grpo`)."""
    if updates == cfg.objective.num_iterations:  # checked with the config, before the model was built
        return
    for key, value in (("checkpoint.save_every", cfg.checkpoint.save_every),
                       ("trainer.save_pretrained_every", cfg.trainer.save_pretrained_every)):
        if value % updates:
            raise ConfigError(f"{key} = {value} is not a multiple of the {updates} optimizer steps of a rollout "
                              f"batch (objective.num_iterations x generation_batch_size / train_batch_size): the "
                              f"job saves between rollout batches; set {key} to a multiple of {updates}")


def _prompts_per_rank(engine, generations: int) -> int:
    """Every rank, before the first rollout: a rank's step is whole groups of num_generations completions."""
    rows = engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps()
    if rows % generations:
        raise ConfigError(f"objective.num_generations = {generations} does not divide the completions of a "
                          f"data-parallel rank's step, train_micro_batch_size_per_gpu x gradient_accumulation_steps "
                          f"= {rows}: each rank samples whole groups of a prompt's completions; choose a "
                          f"num_generations that divides {rows}, or change the batch")
    return rows // generations


def _rollout_batch(job: GRPOJob, last: int) -> tuple[dict, list[dict]]:
    """One rollout batch: its metrics row and (rank 0) its completions, one record each. Every rank's memory is
    gathered as the next-token job does: when the batch passes a multiple of steps_per_print, and at step `last`."""
    engine, generations = job.engine, job.step.settings.num_generations
    indices, mine = [], []  # the rollout batch: steps_per_generation / accumulation optimizer steps' prompts
    for _ in range(job.step.steps_per_rollout):
        epoch, step_indices = job.sampler.next_global_batch()
        indices += step_indices
        mine += job.sampler.next_indices()
    ids, mask, prompts, columns = job.prompts.take(mine)
    tic = time.perf_counter()
    result = job.step(ids, mask, torch.tensor(mine), prompts=prompts, columns=columns)
    elapsed = time.perf_counter() - tic
    rollout = result.rollout
    own = [row[m.bool()].tolist() for row, m in zip(rollout.completion_ids, rollout.completion_mask)]
    gathered = comm.all_gather_object((own, mine), engine.mesh.axis("dp"), tag="metrics")
    per_step = len(mine) // job.step.steps_per_rollout  # a rank's prompts of one optimizer step
    rows = []  # (place in the sampler's order, rank's row): result.rewards runs rank by rank
    for rank, (completions, theirs) in enumerate(gathered):
        for i, tokens in enumerate(completions):
            j = i // generations
            rows.append(((j // per_step, rank, j % per_step, i % generations), theirs[j], tokens))
    records = [{"step": engine.global_steps, "prompt": prompt, "generation": place[3],
                "text": decode(job.tokenizer, tokens), "completion_ids": tokens,
                "reward": None if torch.isnan(reward) else float(reward)}
               for (place, prompt, tokens), reward in sorted(zip(rows, result.rewards), key=lambda x: x[0][0])]
    everyone = [r["completion_ids"] for r in records]
    memory = engine.memory_stats()
    stats = engine.comm_stats(reset=True)
    row = {"step": engine.global_steps, "loss": statistics.fmean(result.losses), "losses": result.losses,
           "grad_norm": result.grad_norms[-1], "grad_norms": result.grad_norms, "lr": engine.get_lr()[0],
           "step_time_s": elapsed, "tokens_per_s": sum(map(len, everyone)) / elapsed, **result.timings,
           "state_bytes": memory["total"], "comm_bytes": sum(c["bytes"] for ops in stats.values()
                                                             for c in ops.values()),
           "comm": stats, "epoch": epoch, "samples": indices, **result.metrics,
           "rollouts": [{"prompt": _shown(job.prompts.prompts[r["prompt"]]), "completion": r["text"],
                         "reward": r["reward"]} for r in records[::generations][:SAMPLES_IN_ROW]]}
    row.update(engine.checkpoint_timings())  # the save after the last row: its stall and step; write_s once written
    every, step, mu = engine.config.steps_per_print, engine.global_steps, job.step.updates_per_rollout
    if step == last or step // every != (step - mu) // every:
        per_rank = comm.all_gather_object((memory["total"], peak_rss_bytes()), engine.mesh.world, tag="metrics")
        row["state_bytes_per_rank"] = [state for state, _ in per_rank]
        row["peak_rss_per_rank"] = [rss for _, rss in per_rank]
        engine.comm_stats(reset=True)
    return row, records


def decode(tokenizer, ids: list[int]) -> str:
    """A completion's text, specials skipped; ids past the tokenizer's vocabulary (an embedding padded beyond it)
    decode to nothing, as transformers' fast tokenizers decode them."""
    known = len(tokenizer)
    return tokenizer.decode([i for i in ids if i < known], skip_special_tokens=True)


def _shown(prompt) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


class CompletionsLog:
    """Rank 0's completions.jsonl: a resumed run keeps the records up to its step and rewrites the rest."""

    def __init__(self, path: Path, enabled: bool, resumed_at: int):
        self.handle = None
        if not enabled:
            return
        kept = []
        if resumed_at and path.is_file():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= resumed_at]
        self.handle = path.open("w")
        self.handle.writelines(line + "\n" for line in kept)

    def write(self, records: list[dict]) -> None:
        if self.handle is not None:
            self.handle.writelines(json.dumps(r) + "\n" for r in records)
            self.handle.flush()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


def train_grpo(cfg, run_dir: str | None, steps: int, save_pretrained: str | None) -> dict:
    """`paratrain train` for objective.type "grpo" (after init_distributed); returns the summary."""
    mu = cfg.objective.num_iterations
    if steps % mu:  # `--steps` overrides trainer.steps (checked with the config): refused before the model is built
        raise ConfigError(f"the run's steps ({steps}) are not a multiple of objective.num_iterations = {mu}: each "
                          f"rollout batch is {mu} optimizer steps; give a multiple of {mu}")
    job = _start(cfg, run_dir)
    engine, out, mu = job.engine, job.out, job.step.updates_per_rollout
    if steps % mu:
        raise ConfigError(f"the run's steps ({steps}) are not a multiple of a rollout batch's {mu} optimizer steps "
                          f"(objective.num_iterations x generation_batch_size / train_batch_size); give a multiple "
                          f"of {mu}")
    rank0, done = engine.global_rank == 0, engine.global_steps
    metrics = MetricsWriter(out, rank0, resumed_at=done)
    engine.hold_scheduled_saves()  # each rollout batch's save waits for its rows
    completions = CompletionsLog(out / "completions.jsonl", rank0, done)
    redirect = contextlib.ExitStack()
    bar = progress_bar(steps, rank0 and cfg.trainer.progress_bar, redirect)
    if bar is not None and done:
        bar.update(done)
    engine.comm_stats(reset=True)
    start, rows = time.perf_counter(), list(metrics.kept)
    every = cfg.trainer.save_pretrained_every
    for _ in range(done, steps, mu):
        row, records = _rollout_batch(job, steps)
        metrics.write(row)
        completions.write(records)
        engine.save_held_checkpoint()  # after the rows: no checkpoint names a step whose rows a kill could lose
        engine.log_metrics({f"train/{k}": row[k] for k in TRACKED if row.get(k) is not None})
        rows.append({k: row[k] for k in ("step", "loss", "reward", "tokens_per_s", *SPLIT)})
        if save_pretrained and every and row["step"] % every == 0 and row["step"] != steps:
            save_pretrained_model(engine, save_pretrained)  # collective
        if bar is not None:
            bar.set_postfix(reward=f"{row['reward']:.3f}", loss=f"{row['loss']:.4f}",
                            length=f"{row['completions/mean_length']:.1f}", state=mib(row["state_bytes"]),
                            refresh=False)
            bar.update(mu)
    if bar is not None:
        bar.close()
    redirect.close()
    metrics.close()
    completions.close()
    engine.monitor.close()
    finish(engine, out, steps, done)
    if save_pretrained:
        save_pretrained_model(engine, save_pretrained)
    return _summary(job, rows, done, steps, time.perf_counter() - start)


def _summary(job: GRPOJob, rows: list[dict], done: int, steps: int, wall_s: float) -> dict:
    """summary.json (rank 0) and the closing line, after the last collective of the run."""
    engine, cfg = job.engine, job.engine.config
    counts = engine.parameter_counts()  # (collective)
    new = [r for r in rows if r["step"] > done]
    summary = {"steps": steps, "first_loss": rows[0]["loss"] if rows else None,
               "last_loss": rows[-1]["loss"] if rows else None, "val_loss": None, "stopped_early_at": None,
               "first_reward": rows[0]["reward"] if rows else None, "last_reward": rows[-1]["reward"] if rows else None,
               "prompts": len(job.prompts), "resumed_at": done,
               "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in new) if new else 0.0, "wall_s": wall_s,
               "world_size": engine.world_size, "layout": layout_label(engine.mesh.dims, cfg.zero_optimization.stage),
               "params": counts["trainable"] + counts["frozen"], "trainable_params": counts["trainable"],
               "frozen_params": counts["frozen"], "checkpoints": engine.checkpoint_saves, "run_dir": str(job.out),
               "time_split_s": {k: statistics.median(r[k] for r in new) for k in SPLIT} if new else None}
    if engine.global_rank == 0:
        reward = f", reward {summary['first_reward']:.3f} -> {summary['last_reward']:.3f}" if rows else ""
        write_summary(summary, job.out, reward)
    comm.barrier(engine.mesh.world)
    return summary
