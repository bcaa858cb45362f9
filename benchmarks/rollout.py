"""Rollout speed: a GRPO rollout batch sampled by `engine.rollout` in each layout against transformers' own
`generate` (sampling) in one process, on the same model as benchmarks/generate.py (a Llama of 4 layers, width 256,
vocabulary 2,048; random weights, fp32): 8 left-padded prompts of up to 32 tokens x 4 generations = 32 rows of 32
new tokens, temperature 1, the full distribution (transformers: top_k 0, top_p 1), no end token, one thread per
rank. Data-parallel layouts deal 4 prompts to each replica, as the GRPO job does; tp2 and pp2 sample all 8 on one.
paratrain also returns each token's log-prob (the sampler's, which training recomputes); transformers' generate
returns tokens only (TRL then runs a forward for the log-probs, not counted here). Every case runs in a fresh
spawned world, interleaved over the repeats; a call's time is its slowest rank's, after one warm-up call. Every
layout must sample paratrain's one-process completions token for token (checked; a case that differs is an error).

    python -m benchmarks.rollout --repeats 3

writes benchmarks/results/rollout.json and prints the table docs/benchmarks.md shows. Nothing asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.generate import SHAPE, ZERO3, _model
from paratrain.testing import World

RESULTS = Path(__file__).resolve().parent / "results" / "rollout.json"
PROMPTS, GENERATIONS, PROMPT, NEW = 8, 4, 32, 32
PEER = "transformers generate (sampling), 1 process"
CASES = {  # name: (ranks, paratrain layout or None for transformers)
    PEER: (1, None),
    "paratrain, 1 process": (1, {}),
    "paratrain DDP, 2 ranks": (2, {}),
    "paratrain ZeRO-3, 2 ranks": (2, ZERO3),
    "paratrain tp2": (2, {"tensor_parallel": {"size": 2}}),
    "paratrain pp2 (1F1B)": (2, {"pipeline": {"stages": 2}, "gradient_accumulation_steps": 2}),
}


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, SHAPE["vocab_size"], (PROMPTS, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row in range(PROMPTS):
        mask[row, :3 * row] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _case(layout: dict | None, calls: int) -> dict:
    import paratrain
    from paratrain.generation import rollout_keys

    torch.set_num_threads(1)
    ids, mask = _prompts()
    if layout is None:
        model = _model()
        rows, row_mask = ids.repeat_interleave(GENERATIONS, 0), mask.repeat_interleave(GENERATIONS, 0)

        def call():
            return model.generate(rows, attention_mask=row_mask, max_new_tokens=NEW, do_sample=True, temperature=1.0,
                                  top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)[:, PROMPT:]
        first = 0
    else:
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **layout}
        engine, *_ = paratrain.initialize(model=_model(), config=config)
        dp, rank = engine.mesh.size("dp"), engine.mesh.local_rank("dp")
        mine = torch.arange(rank * PROMPTS // dp, (rank + 1) * PROMPTS // dp)
        rows, row_mask = ids[mine].repeat_interleave(GENERATIONS, 0), mask[mine].repeat_interleave(GENERATIONS, 0)
        keys = rollout_keys(0, 1, mine.repeat_interleave(GENERATIONS), torch.arange(GENERATIONS).repeat(len(mine)))

        def call():
            return engine.rollout(rows, row_mask, keys, max_new_tokens=NEW, temperature=1.0, pad_token_id=0)
        first = int(mine[0]) * GENERATIONS
    out = call()  # warm-up
    times = []
    for _ in range(calls):
        if dist.is_initialized():
            dist.barrier()
        tic = time.perf_counter()
        call()
        times.append(time.perf_counter() - tic)
    tokens = out if layout is None else out.completion_ids
    return {"times": times, "first_row": first, "tokens": tokens.tolist()}


def _global_rows(results: list[dict]) -> list[list[int]]:
    """The rollout batch's rows in global order from every rank's (a replica's ranks hold the same rows)."""
    rows = {}
    for result in results:
        rows.update({result["first_row"] + i: row for i, row in enumerate(result["tokens"])})
    return [rows[i] for i in sorted(rows)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds over the cases")
    parser.add_argument("--calls", type=int, default=3, help="timed calls per case and round")
    args = parser.parse_args(argv)
    raw: dict[str, list] = {name: [] for name in CASES}
    sampled: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, (ranks, layout) in CASES.items():
            with World(ranks, timeout_s=900) as world:
                results = world.run(_case, layout, args.calls)
            raw[name].append([max(t) for t in zip(*(r["times"] for r in results))])
            sampled.setdefault(name, _global_rows(results))
    reference = sampled["paratrain, 1 process"]
    for name in CASES:
        if name != PEER and sampled[name] != reference:
            raise AssertionError(f"{name} sampled other completions than paratrain in one process")
    tokens = PROMPTS * GENERATIONS * NEW
    summary = {}
    for name, rounds in raw.items():
        median = statistics.median(t for r in rounds for t in r)
        summary[name] = {"median_call_s": median, "tokens_per_s": tokens / median,
                         "per_round_median_s": [statistics.median(r) for r in rounds]}
    peer = summary[PEER]["median_call_s"]
    for row in summary.values():
        row["speed_vs_transformers"] = peer / row["median_call_s"]
        row["per_round_speed"] = [p / r for p, r in zip(summary[PEER]["per_round_median_s"],
                                                        row["per_round_median_s"])]
    result = {"prompts": PROMPTS, "generations": GENERATIONS, "prompt": PROMPT, "new_tokens": NEW, "shape": SHAPE,
              "repeats": args.repeats, "calls": args.calls, "same_completions_in_every_layout": True, "raw": raw,
              "summary": summary}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print("| case | ms per rollout batch | tokens/s | vs transformers (per round) |")
    print("|---|---:|---:|---|")
    for name, row in summary.items():
        rounds = ", ".join(f"{s:.2f}" for s in row["per_round_speed"])
        print(f"| {name} | {row['median_call_s'] * 1e3:.1f} | {row['tokens_per_s']:.0f} | "
              f"{row['speed_vs_transformers']:.2f}x ({rounds}) |")


if __name__ == "__main__":
    main()
