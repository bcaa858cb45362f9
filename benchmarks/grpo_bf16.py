"""What bf16 does to the sampler/training log-prob agreement of a GRPO step: one online step (`GRPOStep`: 4 prompts x
4 generations x 16 sampled tokens, temperature 1) on the Llama of benchmarks/generate.py in fp32 and in bf16
(`"bf16": {"enabled": true}`: bf16 compute, fp32 master weights), in one process, DDP, ZeRO-3 and tp2, recording
`logprob_mismatch` (the mean |log p - log p_sampler| over the completion tokens at the update).

    python -m benchmarks.grpo_bf16

writes benchmarks/results/grpo_bf16.json and prints the table docs/objectives.md shows. A measurement, not a
target: fp32 is the exact mode (<= 1e-6, tests/distributed/test_rollouts.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.generate import SHAPE, ZERO3, _model
from paratrain.testing import World

RESULTS = Path(__file__).resolve().parent / "results" / "grpo_bf16.json"
PROMPTS, GENERATIONS, PROMPT, NEW = 4, 4, 16, 16
LAYOUTS = {"1 process": (1, {}), "DDP, 2 ranks": (2, {}), "ZeRO-3, 2 ranks": (2, ZERO3),
           "tp2": (2, {"tensor_parallel": {"size": 2}})}


def _case(layout: dict, precision: str) -> dict:
    import paratrain
    from paratrain.rl import RewardFunctions
    from paratrain.trainer.grpo import GRPOSettings, GRPOStep

    torch.set_num_threads(1)

    def even(prompts, completions, completion_ids, **kwargs):
        return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    engine, *_ = paratrain.initialize(model=_model().train(), config={
        "train_batch_size": PROMPTS * GENERATIONS, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": precision == "bf16"},
        "objective": {"type": "grpo", "max_completion_length": NEW}, **layout})
    dp, rank = engine.mesh.size("dp"), engine.mesh.local_rank("dp")
    ids = torch.randint(3, SHAPE["vocab_size"], (PROMPTS, PROMPT), generator=torch.Generator().manual_seed(1))
    mine = torch.arange(rank * PROMPTS // dp, (rank + 1) * PROMPTS // dp)
    step = GRPOStep(engine, RewardFunctions([even]), GRPOSettings(num_generations=GENERATIONS,
                                                                  max_completion_length=NEW, pad_token_id=0))
    result = step(ids[mine], torch.ones_like(ids[mine]), mine)
    return {"logprob_mismatch": result.metrics["logprob_mismatch"], "loss": result.losses[0]}


def main() -> None:
    results = {}
    for name, (ranks, layout) in LAYOUTS.items():
        for precision in ("fp32", "bf16"):
            with World(ranks, timeout_s=900) as world:
                results[f"{name}, {precision}"] = world.run(_case, layout, precision)[0]
    RESULTS.write_text(json.dumps({"prompts": PROMPTS, "generations": GENERATIONS, "new_tokens": NEW,
                                   "shape": SHAPE, "results": results}, indent=1) + "\n")
    print("| layout | fp32 logprob_mismatch | bf16 logprob_mismatch |")
    print("|---|---:|---:|")
    for name in LAYOUTS:
        print(f"| {name} | {results[f'{name}, fp32']['logprob_mismatch']:.2e} | "
              f"{results[f'{name}, bf16']['logprob_mismatch']:.2e} |")


if __name__ == "__main__":
    main()
