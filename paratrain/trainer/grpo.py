"""One online GRPO step in the training layout: rollouts of this rank's prompts, rewards gathered over the
data-parallel ranks, group advantages of the rollout batch, and `num_iterations` passes of updates on the same
rollouts. A rollout batch is one optimizer step's prompts, or with TRL's `generation_batch_size` = k x the global
batch (or `steps_per_generation` = k x gradient_accumulation_steps) k optimizer steps' prompts, sampled and scored
at once and then trained as k consecutive optimizer steps, the i-th on the i-th step's prompts (TRL shuffles the
rows first; in order, which step a row trains in is the same in every layout); every pass of `num_iterations` goes
over all k.

    step = GRPOStep(engine, RewardFunctions.named(["rewards.py:correct"]), GRPOSettings(num_generations=4, ...))
    result = step(prompt_ids, prompt_mask, prompt_index, prompts=texts, columns={"answer": [...]})

Nothing in it depends on the layout: a rollout's tokens are a function of (seed, step, global prompt index,
generation index) (`engine.rollout`), the rewards and advantages are the global batch's, and the objective is
normalised by global counts. Each data-parallel replica passes its own prompts, dealt by the caller (the global
prompt index says which); the ranks of one replica pass the same ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import paratrain.comm as comm
from paratrain.errors import InvalidValueError
from paratrain.generation import Rollout, rollout_keys
from paratrain.rl import RewardFunctions, group_advantages


@dataclass
class GRPOSettings:
    """TRL's names and defaults (GRPOConfig), except max_completion_length's (TRL: 512)."""

    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    num_iterations: int = 1
    scale_rewards: str = "group"
    seed: int = 0
    eos_token_id: int | list[int] | None = None
    pad_token_id: int = 0
    generation_batch_size: int | None = None  # completions per rollout batch over all ranks; None: one step's
    steps_per_generation: int | None = None  # or: micro-batches per rollout batch on a rank (TRL's; not both)


@dataclass
class GRPOResult:
    losses: list[float]  # one per update (num_iterations x the rollout batch's optimizer steps of them)
    grad_norms: list[float]  # the global gradient norm before clipping, per update
    rollout: Rollout  # this rank's completions
    rewards: torch.Tensor  # (global rows,) weighted rewards, NaN where nothing scored
    advantages: torch.Tensor  # (this rank's rows,)
    metrics: dict[str, float] = field(default_factory=dict)  # TRL's names
    timings: dict[str, float] = field(default_factory=dict)  # generation_s, rewards_s, update_s: this rank's


class GRPOStep:
    def __init__(self, engine, rewards: RewardFunctions, settings: GRPOSettings,
                 decode_text: Callable[[list[int]], str] | None = None, conversational: bool = False):
        """`decode_text`: a completion's token ids -> its text (the reward functions get the ids otherwise);
        `conversational`: the prompts are message lists, so each completion is given as
        [{"role": "assistant", "content": text}] (TRL's conversational form)."""
        self.engine, self.rewards, self.settings, self.decode_text = engine, rewards, settings, decode_text
        self.conversational = conversational
        if engine.objective is None or engine.objective.objective.name != "grpo":
            raise InvalidValueError("a GRPO step trains the grpo objective: set objective.type to \"grpo\"")
        self.steps_per_rollout = steps_per_rollout(settings, engine.gradient_accumulation_steps(),
                                                   engine.train_micro_batch_size_per_gpu() * engine.dp_world_size)
        self.updates_per_rollout = settings.num_iterations * self.steps_per_rollout  # optimizer steps per call

    def __call__(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prompt_index: torch.Tensor,
                 prompts: list | None = None, columns: dict[str, list] | None = None) -> GRPOResult:
        s, engine = self.settings, self.engine
        generations = s.num_generations
        rows = prompt_ids.shape[0] * generations
        self._check_rows(rows)
        tic = time.perf_counter()
        ids, mask = prompt_ids.repeat_interleave(generations, 0), prompt_mask.repeat_interleave(generations, 0)
        keys = rollout_keys(s.seed, engine.global_steps, torch.as_tensor(prompt_index).repeat_interleave(generations),
                            torch.arange(generations).repeat(prompt_ids.shape[0]))
        rollout = engine.rollout(ids, mask, keys, max_new_tokens=s.max_completion_length, temperature=s.temperature,
                                 top_k=s.top_k, top_p=s.top_p, eos_token_id=s.eos_token_id,
                                 pad_token_id=s.pad_token_id)
        rollout = Rollout(*(t.cpu() for t in (rollout.completion_ids, rollout.completion_mask, rollout.log_probs)))
        # every row padded to max_completion_length, and on to a length sequence parallelism splits (masked out)
        multiple = engine.tokens_per_forward
        rollout = rollout.padded(s.max_completion_length + (-(ids.shape[1] + s.max_completion_length) % multiple))
        timings = {"generation_s": time.perf_counter() - tic}
        tic = time.perf_counter()
        scored = self._rewards(rollout, prompts, columns, generations)
        advantage = group_advantages(scored, self.rewards.weights, self.rewards.names, generations, s.scale_rewards)
        rank = engine.mesh.local_rank("dp")
        mine = advantage.advantages[rank * rows:(rank + 1) * rows]
        batches = self._micro_batches(rollout.to_batch(ids, mask, mine))
        timings["rewards_s"] = time.perf_counter() - tic
        tic = time.perf_counter()
        losses, norms, metrics = [], [], dict(advantage.metrics)
        per_step = len(batches) // self.steps_per_rollout  # micro-batches of one optimizer step
        for _ in range(s.num_iterations):
            for part in range(self.steps_per_rollout):
                losses.append(float(engine.train_batch(iter(batches[part * per_step:(part + 1) * per_step]))))
                norms.append(engine.get_global_grad_norm())
                step_metrics = engine.objective_metrics()
                mismatch = step_metrics.pop("logprob_mismatch", None)
                if len(losses) == 1 and mismatch is not None:  # only the first update has the sampler's weights
                    metrics["logprob_mismatch"] = mismatch
                metrics.update(step_metrics)
        timings["update_s"] = time.perf_counter() - tic
        metrics.update(self._completion_metrics(rollout))
        return GRPOResult(losses, norms, rollout, advantage.rewards, mine, metrics, timings)

    def _check_rows(self, rows: int) -> None:
        engine = self.engine
        expected = engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps() * \
            self.steps_per_rollout
        if rows != expected:
            raise InvalidValueError(f"a GRPO step of {rows // self.settings.num_generations} prompts x "
                                    f"num_generations {self.settings.num_generations} = {rows} completions per "
                                    f"data-parallel rank, but train_micro_batch_size_per_gpu x "
                                    f"gradient_accumulation_steps x the rollout batch's {self.steps_per_rollout} "
                                    f"optimizer steps is {expected}: they must be equal (each micro-batch counts "
                                    f"completions, as TRL's per_device_train_batch_size)")

    def _rewards(self, rollout: Rollout, prompts, columns, generations: int) -> torch.Tensor:
        completion_ids = [row[m.bool()].tolist() for row, m in zip(rollout.completion_ids, rollout.completion_mask)]
        texts = [self.decode_text(c) for c in completion_ids] if self.decode_text is not None else completion_ids
        if self.conversational:
            texts = [[{"role": "assistant", "content": text}] for text in texts]
        repeated = [p for p in (prompts or [None] * (len(completion_ids) // generations)) for _ in range(generations)]
        extra = {name: [v for v in values for _ in range(generations)] for name, values in (columns or {}).items()}
        return self.rewards.score(repeated, texts, completion_ids, extra, self.engine.mesh.axis("dp"))

    def _micro_batches(self, batch: dict) -> list[dict]:
        size = self.engine.train_micro_batch_size_per_gpu()
        rows = batch["completion_ids"].shape[0]
        return [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, rows, size)]

    def _completion_metrics(self, rollout: Rollout) -> dict[str, float]:
        """TRL's completions/mean_length and completions/clipped_ratio (the share that ended without an end token)
        over the global batch (one all-reduce)."""
        mask = rollout.completion_mask.bool()
        eos = self.settings.eos_token_id
        ends = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        ended = (torch.isin(rollout.completion_ids, torch.tensor(ends, dtype=torch.long)) & mask).any(dim=1)
        totals = torch.tensor([float(mask.sum()), float((~ended).sum()), float(mask.shape[0])], dtype=torch.float64,
                              device=self.engine.device)
        comm.all_reduce(totals, self.engine.mesh.axis("dp"), tag="metrics")
        totals = totals.cpu()
        return {"completions/mean_length": float(totals[0] / totals[2]),
                "completions/clipped_ratio": float(totals[1] / totals[2])}


def steps_per_rollout(settings: GRPOSettings, accumulation: int, per_micro_step: int) -> int:
    """Optimizer steps a rollout batch feeds: TRL's generation_batch_size (completions over all ranks) over the
    global batch, or its steps_per_generation (a rank's micro-batches) over the accumulation."""
    size, micro_steps = settings.generation_batch_size, settings.steps_per_generation
    if size is not None and micro_steps is not None:
        raise InvalidValueError("objective.generation_batch_size and objective.steps_per_generation both size the "
                                "rollout batch: keep one (generation_batch_size is the same in every layout)")
    global_batch = per_micro_step * accumulation
    if size is not None:
        if size < 1 or size % global_batch:
            raise InvalidValueError(f"objective.generation_batch_size = {size} is not a multiple of train_batch_size "
                                    f"= {global_batch}: a rollout batch feeds whole optimizer steps; give "
                                    f"{global_batch} x the optimizer steps it should feed")
        return size // global_batch
    if micro_steps is None:
        return 1
    if micro_steps < 1 or micro_steps % accumulation:
        raise InvalidValueError(f"objective.steps_per_generation = {micro_steps} is not a multiple of "
                                f"gradient_accumulation_steps = {accumulation} in this layout: a rollout batch feeds "
                                f"whole optimizer steps; give {accumulation} x the optimizer steps it should feed, "
                                f"or objective.generation_batch_size (the same in every layout)")
    return micro_steps // accumulation
