"""Generation speed: engine.generate in each layout against transformers' own `generate` in one process, on
the same model (a Llama of 4 layers, width 256, 8 heads / 4 key-value heads, vocabulary 2,048; random
weights, fp32), the same 4 left-padded prompts of up to 32 tokens and 32 new tokens each, greedy, one thread
per rank. Every case runs in a fresh spawned world, the cases interleaved over the repeats; a call's time is
its slowest rank's, after one warm-up call. Every case must return transformers' tokens (checked; a case that
differs is an error, not a row). Under ZeRO-3 the parameter all-gathers of one call are counted: one per unit
per call, not per token.

    python -m benchmarks.generate --repeats 3

writes benchmarks/results/generate.json and prints the table docs/evaluation.md shows. Nothing asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.testing import World

RESULTS = Path(__file__).resolve().parent / "results" / "generate.json"
BATCH, PROMPT, NEW = 4, 32, 32
SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False)
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
CASES = {  # name: (ranks, paratrain layout or None for transformers, use_cache)
    "transformers generate, 1 process": (1, None, True),
    "paratrain, 1 process": (1, {}, True),
    "paratrain, 1 process, no KV cache": (1, {}, False),
    "paratrain DDP, 2 ranks": (2, {}, True),
    "paratrain ZeRO-3, 2 ranks": (2, ZERO3, True),
    "paratrain tp2": (2, {"tensor_parallel": {"size": 2}}, True),
    "paratrain pp2 (1F1B)": (2, {"pipeline": {"stages": 2}, "gradient_accumulation_steps": 2}, True),
}


def _model():
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()


def _prompts():
    ids = torch.randint(3, SHAPE["vocab_size"], (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 5, 11, 17)):
        mask[row, :pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _case(layout: dict | None, use_cache: bool, repeats: int) -> dict:
    import paratrain

    torch.set_num_threads(1)
    ids, mask = _prompts()
    reference = _model().generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                  eos_token_id=None)
    if layout is None:
        model = _model()
        call = lambda: model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,  # noqa: E731
                                      pad_token_id=0, eos_token_id=None)
        engine = None
    else:
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  **layout}
        engine, *_ = paratrain.initialize(model=_model(), config=config)
        call = lambda: engine.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0,  # noqa: E731
                                       use_cache=use_cache)
    out = call()  # warm-up, and the check
    if not torch.equal(out.cpu(), reference):
        raise AssertionError(f"tokens differ from transformers': {out[:, PROMPT:].tolist()}")
    times, gathers = [], None
    for _ in range(repeats):
        if engine is not None:
            engine.comm_stats(reset=True)
        if dist.is_initialized():
            dist.barrier()
        tic = time.perf_counter()
        call()
        times.append(time.perf_counter() - tic)
        if engine is not None:
            stats = engine.comm_stats(by_tag=True)
            gathers = stats.get("dp", {}).get("all_gather", {}).get("param", {}).get("calls", 0)
    units = len(getattr(engine.grad_sync, "units", [])) + 1 if engine is not None else None
    return {"times": times, "gathers_per_call": gathers, "zero3_units": units}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds over the cases")
    parser.add_argument("--calls", type=int, default=3, help="timed calls per case and round")
    args = parser.parse_args(argv)
    raw: dict[str, list] = {name: [] for name in CASES}
    for _ in range(args.repeats):
        for name, (ranks, layout, use_cache) in CASES.items():
            with World(ranks, timeout_s=900) as world:
                results = world.run(_case, layout, use_cache, args.calls)
            raw[name].append({"times": [max(t) for t in zip(*(r["times"] for r in results))],
                              "gathers_per_call": results[0]["gathers_per_call"],
                              "zero3_units": results[0]["zero3_units"]})
    tokens = BATCH * NEW
    summary = {}
    for name, rounds in raw.items():
        median = statistics.median(t for r in rounds for t in r["times"])
        summary[name] = {"median_call_s": median, "tokens_per_s": tokens / median,
                         "gathers_per_call": rounds[0]["gathers_per_call"], "zero3_units": rounds[0]["zero3_units"]}
    peer = summary["transformers generate, 1 process"]["median_call_s"]
    for row in summary.values():
        row["speed_vs_transformers"] = peer / row["median_call_s"]
    result = {"batch": BATCH, "prompt": PROMPT, "new_tokens": NEW, "shape": SHAPE, "repeats": args.repeats,
              "calls": args.calls, "raw": raw, "summary": summary}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print("| case | ms per call | tokens/s | vs transformers | ZeRO-3 gathers per call |")
    print("|---|---:|---:|---:|---|")
    for name, row in summary.items():
        gathers = "" if row["gathers_per_call"] in (None, 0) else \
            f"{row['gathers_per_call']} ({row['zero3_units']} units)"
        print(f"| {name} | {row['median_call_s'] * 1e3:.1f} | {row['tokens_per_s']:.0f} | "
              f"{row['speed_vs_transformers']:.2f}x | {gathers} |")


if __name__ == "__main__":
    main()
