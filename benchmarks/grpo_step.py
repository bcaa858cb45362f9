"""A GRPO step in one process: paratrain's `GRPOStep` against TRL's `GRPOTrainer` (no vLLM: transformers' generate),
as each side's users run it, on the same transformers Llama as benchmarks/generate.py (4 layers, width 256,
vocabulary 2,048; random weights, fp32), the same 4 prompts of 32 tokens per step x 4 generations = 16 completions
of up to 32 sampled tokens (temperature 1, the full distribution), the same reward (the share of even token ids),
DAPO's loss with beta 0 and one update per rollout batch, torch's fused AdamW (benchmarks.common.ADAMW), clipping
1.0, seed 0, one thread. A step is the whole of it: sampling, rewards, advantages, the log-probs, backward and update
(TRL: `on_step_begin` to `on_step_end` of `trainer.train()`; paratrain: the `GRPOStep` call, whose rollout also
returns the sampler's log-probs). Each side runs alone in its own process, the two alternating over the rounds.

    python -m benchmarks.grpo_step --rounds 2 --steps 12 --warmup 2

writes benchmarks/results/grpo_step.json and prints the table docs/benchmarks.md shows. Nothing asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import ADAMW, SEED
from benchmarks.generate import SHAPE, _model

RESULTS = Path(__file__).resolve().parent / "results" / "grpo_step.json"
PROMPTS, GENERATIONS, PROMPT, NEW, CLIP = 4, 4, 32, 32, 1.0


def even_tokens(prompts=None, completions=None, completion_ids=None, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def _prompt_ids(steps: int) -> torch.Tensor:
    return torch.randint(3, SHAPE["vocab_size"], (steps * PROMPTS, PROMPT), generator=torch.Generator().manual_seed(1))


def _tokenizer():
    """Words t0..t2047 as ids (t0 pad, t2 eos): TRL tokenizes its text prompts back to the very ids paratrain gets."""
    import tokenizers
    import transformers

    vocab = {f"t{i}": i for i in range(SHAPE["vocab_size"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2")


def trl_case(steps: int) -> dict:
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    times, lengths = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.tic = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.tic)

    def reward(prompts, completions, completion_ids, **kwargs):
        lengths.extend(len(ids) for ids in completion_ids)
        return even_tokens(completion_ids=completion_ids)

    rows = [{"prompt": " ".join(f"t{i}" for i in row)} for row in _prompt_ids(steps).tolist()]
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, per_device_train_batch_size=PROMPTS * GENERATIONS,
        gradient_accumulation_steps=1, num_generations=GENERATIONS, max_completion_length=NEW, temperature=1.0,
        top_k=0, top_p=1.0, beta=0.0, loss_type="dapo", num_iterations=1, max_steps=steps,
        learning_rate=ADAMW["lr"], adam_beta1=ADAMW["betas"][0], adam_beta2=ADAMW["betas"][1],
        adam_epsilon=ADAMW["eps"], weight_decay=ADAMW["weight_decay"], optim="adamw_torch_fused", max_grad_norm=CLIP,
        lr_scheduler_type="constant", warmup_steps=0, bf16=False, fp16=False, seed=SEED, data_seed=SEED,
        shuffle_dataset=False, logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0)
    reward.__name__ = "even_tokens"
    trainer = GRPOTrainer(model=_model().train(), reward_funcs=[reward], args=args,
                          train_dataset=datasets.Dataset.from_list(rows), processing_class=_tokenizer(),
                          callbacks=[Clock()])
    trainer.train()
    return {"times": times, "mean_completion_length": statistics.fmean(lengths)}


def paratrain_case(steps: int) -> dict:
    import paratrain
    from paratrain.rl import RewardFunctions
    from paratrain.trainer.grpo import GRPOSettings, GRPOStep

    lengths = []

    def reward(prompts, completions, completion_ids, **kwargs):
        lengths.extend(len(ids) for ids in completion_ids)
        return even_tokens(completion_ids=completion_ids)

    engine, *_ = paratrain.initialize(model=_model().train(), config={
        "train_micro_batch_size_per_gpu": PROMPTS * GENERATIONS, "gradient_clipping": CLIP, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]), "fused": True}},
        "objective": {"type": "grpo", "loss_type": "dapo", "beta": 0.0, "max_completion_length": NEW}})
    step = GRPOStep(engine, RewardFunctions([reward], names=["even_tokens"]),
                    GRPOSettings(num_generations=GENERATIONS, max_completion_length=NEW, seed=SEED, eos_token_id=2,
                                 pad_token_id=0))
    ids, times, split = _prompt_ids(steps), [], []
    for s in range(steps):
        prompts = ids[s * PROMPTS:(s + 1) * PROMPTS]
        tic = time.perf_counter()
        result = step(prompts, torch.ones_like(prompts), torch.arange(s * PROMPTS, (s + 1) * PROMPTS))
        times.append(time.perf_counter() - tic)
        split.append(result.timings)
    return {"times": times, "split": split, "mean_completion_length": statistics.fmean(lengths)}


def _run(case: str, steps: int) -> dict:
    """One side alone in a fresh process with one thread."""
    code = (f"import json, torch; torch.set_num_threads(1); from benchmarks.grpo_step import {case}; "
            f"print('RESULT ' + json.dumps({case}({steps})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         cwd=Path(__file__).resolve().parents[1], env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin",
                                                                       "PYTHONWARNINGS": "ignore"})
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{case} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each side")
    parser.add_argument("--steps", type=int, default=12, help="steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    args = parser.parse_args(argv)
    raw = {"trl": [], "paratrain": []}
    for _ in range(args.rounds):
        for side, case in (("trl", "trl_case"), ("paratrain", "paratrain_case")):
            raw[side].append(_run(case, args.steps))
    medians = {side: [statistics.median(r["times"][args.warmup:]) for r in runs] for side, runs in raw.items()}
    summary = {side: {"median_step_s": statistics.median(t for r in raw[side] for t in r["times"][args.warmup:]),
                      "per_run_median_s": medians[side],
                      "mean_completion_length": statistics.fmean(r["mean_completion_length"] for r in raw[side])}
               for side in raw}
    summary["paratrain"]["split_median_s"] = {
        k: statistics.median(t[k] for r in raw["paratrain"] for t in r["split"][args.warmup:])
        for k in raw["paratrain"][0]["split"][0]}
    ratio = summary["paratrain"]["median_step_s"] / summary["trl"]["median_step_s"]
    result = {"prompts": PROMPTS, "generations": GENERATIONS, "prompt": PROMPT, "new_tokens": NEW, "shape": SHAPE,
              "optimizer": {**ADAMW, "fused": True}, "rounds": args.rounds, "steps": args.steps,
              "warmup": args.warmup, "raw": raw, "summary": summary, "paratrain_over_trl": ratio,
              "per_run_ratio": [p / t for p, t in zip(medians["paratrain"], medians["trl"])]}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print("| side | median step (ms) | mean completion tokens | paratrain / TRL (per run) |")
    print("|---|---:|---:|---|")
    runs = ", ".join(f"{r:.3f}" for r in result["per_run_ratio"])
    for side in ("trl", "paratrain"):
        row = summary[side]
        cell = f"{ratio:.3f} ({runs})" if side == "paratrain" else ""
        print(f"| {'TRL GRPOTrainer' if side == 'trl' else 'paratrain GRPOStep'} | {row['median_step_s'] * 1e3:.1f} | "
              f"{row['mean_completion_length']:.1f} | {cell} |")
    split = summary["paratrain"]["split_median_s"]
    print("paratrain's step, split (median ms): " + ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.1f}"
                                                             for k, v in split.items()))


if __name__ == "__main__":
    main()
