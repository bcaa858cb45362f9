"""Run the DPO benchmark (`benchmarks/dpo.py`: the model, data and both sides) and write
benchmarks/results/dpo.json and its section of docs/benchmarks.md.

    DS_ACCELERATOR=cpu python -m benchmarks.dpo_run --rounds 12 --warmup 3
    python -m benchmarks.dpo_run --render benchmarks/results/dpo.json     # the doc section from a result

Three parts, each in fresh 2-rank worlds:
- **Step time, paired.** One world per mode (LoRA, full) holds TRL's trainer and paratrain's engine. TRL's own
  `train()` drives; a callback runs paratrain's step after TRL's on even rounds and before it on odd ones, a
  barrier before each. TRL's step is on_step_begin to on_step_end (its forward, reference forward, backward,
  DeepSpeed's reduce, clip and step, metric gathers); paratrain's is `engine.train_batch`. A step's time is its
  slowest rank's; a round's ratio is paratrain's step over TRL's, the result the median over rounds. Losses of
  every step are compared (the mean over ranks of TRL's per-rank losses against paratrain's global mean); the two
  sides' setups (`benchmarks.common.record_setup`) must be equal and TRL's micro-batches paratrain's.
- **Peak memory, alone.** One world per case (each side, each mode, each reference mode), so ru_maxrss is the
  case's own: every world imports the same libraries first (torch, transformers, peft, deepspeed, trl,
  accelerate, paratrain), then builds its case and runs `--memory-steps` steps; reported: the peak RSS of the
  larger rank, and its growth over the RSS after imports. Also the tensor bytes held between steps
  (paratrain: `memory_stats()['total']`; TRL: DeepSpeed's partitions, flat buffers, gradients and optimizer
  state, plus its reference engine's partitions).
- **The reference modes, paired.** paratrain alone, one world per mode: LoRA with the adapters off, with an
  initial frozen copy and with the batch's precomputed log-probs; full with the initial copy and the batch's,
  their steps in rotation. The adapters-off mode is asserted to hold no second copy: `reference_params` is 0 and
  the total tensor bytes equal the precomputed mode's (which holds no reference at all); the test that asserts the
  same in every run of the suite is tests/distributed/test_objectives.py
  (test_the_reference_is_placed_like_the_policy_and_adapters_off_cost_nothing_4_ranks).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.suite import DOC, RESULTS, machine
from paratrain.testing import World

BEGIN, END = "<!-- dpo -->", "<!-- /dpo -->"
MODES = {"LoRA": True, "full": False}
REFERENCE_MODES = {"LoRA": ["adapters_off", "initial", "batch"], "full": ["initial", "batch"]}
LIBRARIES = ("torch", "transformers", "peft", "deepspeed", "trl", "accelerate")


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _import_all() -> int:
    """Every library either side uses, imported in every world before anything is built: RSS after imports."""
    import accelerate  # noqa: F401
    import deepspeed  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401
    import trl  # noqa: F401

    import paratrain  # noqa: F401

    return _rss_now()


# ---- step time: TRL and paratrain alternated in one world ------------------------------------------------------
def _paired(lora: bool, rounds: int, warmup: int, zero: dict | None) -> dict:
    import torch.distributed as dist
    from transformers import TrainerCallback

    from benchmarks import dpo
    from benchmarks.common import check_same_setup, record_setup

    _import_all()
    steps = warmup + rounds
    examples = dpo.pairs(dist.get_world_size() * dpo.PAIRS * steps)
    ours = dpo.paratrain_case(lora, examples, steps)
    times = {"trl": [], "paratrain": []}
    losses = []

    def ours_step():
        seconds, loss = dpo.Stopwatch.time(ours["step"])
        times["paratrain"].append(seconds)
        losses.append(loss.detach().clone())

    class Alternate(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step % 2 == 1:
                ours_step()
            dist.barrier()
            self.tic = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times["trl"].append(time.perf_counter() - self.tic)
            if state.global_step % 2 == 1:  # global_step already counts this step: an even round just ended
                ours_step()

    trainer = dpo.trl_trainer(lora, examples, steps, dpo.temp_dir(), callbacks=[Alternate()], zero=zero)
    trainer.train()
    # what TRL's side built (optimizer class and flags below DeepSpeed's wrapper, threads, dtype, seeds): refused
    # unless it is paratrain's
    trl_setup = record_setup(trainer.model_wrapped.optimizer, trainer.model, ours["batches"])
    check_same_setup({"paratrain": ours["setup"], "TRL DPOTrainer on DeepSpeed": trl_setup})
    ours_tokens = [int(b["input_ids"].sum()) for b in ours["batches"].batches]
    if trainer.bench_tokens != ours_tokens:
        raise RuntimeError("TRL's micro-batches are not paratrain's: token sums "
                           f"{trainer.bench_tokens} against {ours_tokens}")
    return {"times": {k: v[warmup:] for k, v in times.items()},
            "warmup_times": {k: v[:warmup] for k, v in times.items()},
            "trl_losses": [float(t) for t in trainer.bench_losses], "paratrain_losses": [float(t) for t in losses],
            "setup": ours["setup"], "trl_setup": trl_setup, "paratrain_config": ours["config"],
            "deepspeed_config": dpo.deepspeed_config(zero),
            "trl_args": {k: v for k, v in trainer.args.to_dict().items() if k in TRL_ARGS},
            "state_bytes": {"paratrain": ours["memory"](), "trl": dpo.trl_state_bytes(trainer)}}


TRL_ARGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "adam_beta1", "adam_beta2",
            "adam_epsilon", "weight_decay", "max_grad_norm", "lr_scheduler_type", "bf16", "fp16",
            "gradient_checkpointing", "train_sampling_strategy", "seed", "beta", "loss_type",
            "precompute_ref_log_probs", "max_length", "disable_dropout")


def _slowest(ranks: list[dict], key: str, side: str) -> list[float]:
    return [max(t) for t in zip(*(r[key][side] for r in ranks))]


def paired(lora: bool, rounds: int, warmup: int, zero: dict | None = None) -> dict:
    with World(2, timeout_s=1800) as world:
        ranks = world.run(_paired, lora, rounds, warmup, zero)
    ours, trl = _slowest(ranks, "times", "paratrain"), _slowest(ranks, "times", "trl")
    ratios = [a / b for a, b in zip(ours, trl)]
    trl_mean = [sum(r["trl_losses"][i] for r in ranks) / len(ranks) for i in range(len(ranks[0]["trl_losses"]))]
    diffs = [abs(a - b) for a, b in zip(ranks[0]["paratrain_losses"], trl_mean)]
    r0 = ranks[0]
    return {"median_ratio": statistics.median(ratios), "ratios": ratios,
            "median_step_s": {"paratrain": statistics.median(ours), "trl": statistics.median(trl)},
            "step_times": {"paratrain": ours, "trl": trl},
            "warmup_step_times": {s: _slowest(ranks, "warmup_times", s) for s in ("paratrain", "trl")},
            "losses": {"paratrain": r0["paratrain_losses"], "trl_mean_over_ranks": trl_mean,
                       "trl_per_rank": [r["trl_losses"] for r in ranks]},
            "first_step_loss_diff": diffs[0], "max_loss_diff": max(diffs), "loss_diffs": diffs,
            "state_bytes_per_rank": [r["state_bytes"] for r in ranks],
            "setup": {"paratrain": r0["setup"], "trl": r0["trl_setup"]},
            "ran_with": {"paratrain": r0["paratrain_config"], "trl_deepspeed": r0["deepspeed_config"],
                         "trl_args": r0["trl_args"]}}


# ---- peak memory: one case alone per world ---------------------------------------------------------------------
def _alone(side: str, lora: bool, steps: int, reference: str | None) -> dict:
    import resource

    import torch.distributed as dist

    from benchmarks import dpo

    after_imports = _import_all()
    examples = dpo.pairs(dist.get_world_size() * dpo.PAIRS * steps)
    if side == "trl":
        counter = dpo.collective_counter()
        trainer = dpo.trl_trainer(lora, examples, steps, dpo.temp_dir(), callbacks=[counter])
        trainer.train()
        state, collectives = dpo.trl_state_bytes(trainer), counter.last_step
    else:
        case = dpo.paratrain_case(lora, examples, steps, reference)
        for _ in range(steps):
            case["engine"].comm_stats(reset=True)
            case["step"]()
        stats = case["engine"].comm_stats()
        collectives = {f"{axis} {op}": v["calls"] for axis, ops in stats.items() for op, v in ops.items()}
        state = case["memory"]()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_rss": peak, "rss_after_imports": after_imports, "state_bytes": state,
            "collectives_last_step": collectives}


def alone(side: str, lora: bool, steps: int, reference: str | None = None) -> dict:
    with World(2, timeout_s=1800) as world:
        ranks = world.run(_alone, side, lora, steps, reference)
    worst = max(ranks, key=lambda r: r["peak_rss"])
    return {"peak_rss_mib": worst["peak_rss"] / 2**20,
            "growth_mib": max(r["peak_rss"] - r["rss_after_imports"] for r in ranks) / 2**20,
            "state_mib": max(r["state_bytes"]["total"] for r in ranks) / 2**20,
            "reference_mib": max(r["state_bytes"]["reference_params"] for r in ranks) / 2**20,
            "collectives_last_step_rank0": ranks[0]["collectives_last_step"], "ranks": ranks}


# ---- the reference modes: paratrain's engines in rotation ------------------------------------------------------
def _reference_modes(lora: bool, modes: list[str], rounds: int, warmup: int) -> dict:
    import torch.distributed as dist

    from benchmarks import dpo

    _import_all()
    steps = warmup + rounds
    examples = dpo.pairs(dist.get_world_size() * dpo.PAIRS * steps)
    cases = {mode: dpo.paratrain_case(lora, examples, steps, mode) for mode in modes}
    times = {mode: [] for mode in modes}
    losses = {mode: [] for mode in modes}
    for i in range(steps):
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            seconds, loss = dpo.Stopwatch.time(cases[mode]["step"])
            losses[mode].append(float(loss))
            if i >= warmup:
                times[mode].append(seconds)
    return {"times": times, "losses": losses, "memory": {mode: case["memory"]() for mode, case in cases.items()}}


def reference_modes(lora: bool, rounds: int, warmup: int) -> dict:
    modes = REFERENCE_MODES["LoRA" if lora else "full"]
    with World(2, timeout_s=1800) as world:
        ranks = world.run(_reference_modes, lora, modes, rounds, warmup)
    out = {}
    for mode in modes:
        slowest = [max(t) for t in zip(*(r["times"][mode] for r in ranks))]
        memory = ranks[0]["memory"][mode]
        out[mode] = {"median_step_s": statistics.median(slowest), "step_times": slowest,
                     "losses": ranks[0]["losses"][mode], "memory_stats_rank0": memory}
    if lora:  # adapters off: no second copy of the weights (memory asserted)
        for r in ranks:
            off, batch = r["memory"]["adapters_off"], r["memory"]["batch"]
            assert off["reference_params"] == 0, off
            assert off["total"] == batch["total"], (off, batch)
        out["adapters_off_holds_no_second_copy"] = True
    return out


# ---- the run ---------------------------------------------------------------------------------------------------
def versions() -> dict:
    return {name: importlib.metadata.version(name) for name in LIBRARIES}


def run(rounds: int, warmup: int, memory_steps: int, with_defaults: bool = False) -> dict:
    started = datetime.now(timezone.utc)
    tic = time.time()
    out = {"started": started.strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(), "versions": versions(),
           "rounds": rounds, "warmup": warmup, "memory_steps": memory_steps, "load_average": {"start": os.getloadavg()},
           "model": _model_record(), "paired": {}, "paired_deepspeed_defaults": {}, "memory": {},
           "reference_modes": {}}
    for name, lora in MODES.items():
        print(f"[dpo] paired {name}", file=sys.stderr, flush=True)
        out["paired"][name] = paired(lora, rounds, warmup)
        print(f"[dpo] {name}: paratrain / TRL median ratio {out['paired'][name]['median_ratio']:.3f}", flush=True)
    if with_defaults:  # TRL on DeepSpeed's default buckets: is the tuned config its best here?
        from benchmarks.dpo import DEEPSPEED_DEFAULT_ZERO3

        for name, lora in MODES.items():
            print(f"[dpo] paired {name}, DeepSpeed's defaults", file=sys.stderr, flush=True)
            out["paired_deepspeed_defaults"][name] = paired(lora, rounds, warmup, DEEPSPEED_DEFAULT_ZERO3)
    out["load_average"]["after_paired"] = os.getloadavg()
    for name, lora in MODES.items():
        for side in ("paratrain", "trl"):
            print(f"[dpo] memory {name} {side}", file=sys.stderr, flush=True)
            out["memory"][f"{side} {name}"] = alone(side, lora, memory_steps)
        for mode in REFERENCE_MODES[name]:
            print(f"[dpo] memory {name} reference {mode}", file=sys.stderr, flush=True)
            out["memory"][f"paratrain {name} reference {mode}"] = alone("paratrain", lora, memory_steps, mode)
    out["load_average"]["after_memory"] = os.getloadavg()
    for name, lora in MODES.items():
        print(f"[dpo] reference modes {name}", file=sys.stderr, flush=True)
        out["reference_modes"][name] = reference_modes(lora, rounds, warmup)
    out["load_average"]["end"] = os.getloadavg()
    out["wall_s"] = time.time() - tic
    return out


def _model_record() -> dict:
    from benchmarks import dpo

    model = dpo.llama(lora=False)
    return {"shape": dpo.SHAPE, "parameters": sum(p.numel() for p in model.parameters()), "seq": dpo.SEQ,
            "pairs_per_rank": dpo.PAIRS, "beta": dpo.BETA, "clip": dpo.CLIP, "lora": dpo.LORA}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--with-defaults", action="store_true",
                        help="also pair paratrain with TRL on DeepSpeed's default ZeRO-3 buckets")
    parser.add_argument("--no-doc", action="store_true", help="print the section, leave docs/benchmarks.md alone")
    parser.add_argument("--results", type=Path, default=RESULTS / "dpo.json")
    parser.add_argument("--render", type=Path, help="run nothing: write the doc section from this dpo.json")
    args = parser.parse_args(argv)
    from benchmarks.dpo_report import section
    from paratrain.bench.table import write_between_markers

    if args.render:
        result = json.loads(args.render.read_text())
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        result = run(args.rounds, args.warmup, args.memory_steps, args.with_defaults)
        args.results.write_text(json.dumps(result, indent=1) + "\n")
    text = section(result)
    print(text)
    if not args.no_doc:
        write_between_markers(DOC, text, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
