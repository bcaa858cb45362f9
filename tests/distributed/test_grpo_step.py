"""An online GRPO step (`paratrain.trainer.grpo.GRPOStep`: rollouts, rewards, group advantages, updates) gives the
same run in every layout: the same seeded job of 2 steps (4 prompts x 2 generations, two reward functions with
weights, num_iterations 2 so the clip acts on the second update) in DDP, ZeRO-3, tp2 and pp2 draws the same
completions token for token, the same global rewards, and the same loss and gradient norm at every update within
1e-5 (dp2 deals 2 prompts to each replica; tp2 and pp2 hold all 4 on one)."""

from __future__ import annotations

import math

import pytest
import torch

import paratrain
from tests.cases import tiny_hf

pytestmark = pytest.mark.multiprocess

PROMPTS, GENERATIONS, NEW, STEPS = 4, 2, 6, 2
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
LAYOUTS = {
    "ddp2": {},
    "zero3": ZERO3,
    "tp2": {"tensor_parallel": {"size": 2}},
    "pp2": {"pipeline": {"stages": 2, "schedule": "1f1b"}},
}


def even_tokens(prompts, completions, completion_ids, **columns):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def short(prompts, completions, completion_ids, target, **columns):
    return [-abs(len(ids) - t) for ids, t in zip(completion_ids, target)]


def _prompts(vocab: int):
    ids = torch.randint(40, vocab, (PROMPTS, 8), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :3], mask[2, :1], mask[3, :5] = 0, 0, 0
    return ids.masked_fill(mask == 0, 0), mask


def _run(layout: dict) -> dict:
    from paratrain.rl import RewardFunctions
    from paratrain.trainer.grpo import GRPOSettings, GRPOStep

    model = tiny_hf("llama")
    vocab = model.config.vocab_size
    engine, *_ = paratrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "train_batch_size": PROMPTS * GENERATIONS, "steps_per_print": 10**6,
        "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
        "objective": {"type": "grpo", "epsilon": 0.05, "temperature": 0.9}, **layout})
    step = GRPOStep(engine, RewardFunctions([even_tokens, short], weights=[1.0, 0.25]),
                    GRPOSettings(num_generations=GENERATIONS, max_completion_length=NEW, temperature=0.9,
                                 num_iterations=2, seed=4, eos_token_id=list(range(3, 40))))
    ids, mask = _prompts(vocab)
    dp, rank = engine.mesh.size("dp"), engine.mesh.local_rank("dp")
    mine = slice(rank * PROMPTS // dp, (rank + 1) * PROMPTS // dp)
    out = []
    for _ in range(STEPS):
        r = step(ids[mine], mask[mine], torch.arange(PROMPTS)[mine], columns={"target": [3] * (PROMPTS // dp)})
        completions = [row[m.bool()].tolist() for row, m in zip(r.rollout.completion_ids, r.rollout.completion_mask)]
        out.append({"losses": r.losses, "norms": r.grad_norms, "rewards": r.rewards.tolist(),
                    "completions": completions, "first_row": rank * PROMPTS // dp * GENERATIONS,
                    "metrics": r.metrics})
    engine.destroy()
    return out


def _runs() -> dict:
    return {name: _run(layout) for name, layout in LAYOUTS.items()}


def _one_rank_fails() -> str:
    """A reward function that raises on data-parallel rank 1 only: every rank raises the error, naming it."""
    import torch.distributed as dist

    from paratrain.rl import RewardError, RewardFunctions

    def flaky(prompts, completions, completion_ids, **columns):
        if dist.get_rank() == 1:
            raise KeyError("answer")
        return [0.0] * len(completions)

    from paratrain.layout.mesh import Axis

    world = Axis("dp", tuple(range(dist.get_world_size())), dist.get_rank(), dist.group.WORLD)
    try:
        RewardFunctions([flaky]).score([None], [[1]], [[1]], {}, world)
    except RewardError as exc:
        return str(exc)
    return "no error"


def _close(a: float, b: float, floor: float = 1e-3) -> bool:
    return abs(a - b) <= 1e-5 * max(abs(b), floor)


def _same_rewards(a: list, b: list) -> bool:
    return all((math.isnan(x) and math.isnan(y)) or abs(x - y) <= 1e-6 for x, y in zip(a, b))


def test_a_reward_that_fails_on_one_rank_stops_every_rank_with_its_name(world2):
    messages = world2.run(_one_rank_fails)
    assert all("data-parallel rank 1" in m and "'flaky'" in m and "KeyError" in m for m in messages), messages


def test_a_grpo_step_is_the_same_run_in_every_layout(world2):
    ranks = world2.run(_runs)
    reference = None
    for name in LAYOUTS:
        steps = []
        for s in range(STEPS):
            rows = {}
            for r in ranks:
                first = r[name][s]["first_row"]
                rows.update({first + i: c for i, c in enumerate(r[name][s]["completions"])})
            one = ranks[0][name][s]
            steps.append({"completions": [rows[i] for i in sorted(rows)], "rewards": one["rewards"],
                          "losses": one["losses"], "norms": one["norms"], "metrics": one["metrics"]})
        if reference is None:
            reference = steps
            assert steps[0]["completions"] != steps[1]["completions"]  # the update changed the policy's rollouts
            assert any(abs(x) > 0 for x in steps[0]["losses"]), steps  # the advantages were not all 0
            assert steps[0]["metrics"]["logprob_mismatch"] <= 1e-6, steps[0]["metrics"]
            assert steps[0]["metrics"]["clip_ratio/region_mean"] > 0, steps[0]["metrics"]  # the clip acted
            continue
        for s, (mine, want) in enumerate(zip(steps, reference)):
            assert mine["completions"] == want["completions"], (name, s)
            assert _same_rewards(mine["rewards"], want["rewards"]), (name, s, mine["rewards"], want["rewards"])
            # the first update's loss is 0 in exact arithmetic (every ratio 1, each group's advantages summing to 0):
            # what is left is the rounding of the sampler's log-probs against training's, ~1e-8 here, so the losses
            # are compared on the scale of their terms (0.01 and up), not relative to that rounding
            assert all(_close(a, b, 1e-2) for a, b in zip(mine["losses"], want["losses"])), (name, s, mine, want)
            assert all(_close(a, b) for a, b in zip(mine["norms"], want["norms"])), (name, s, mine, want)
