"""The DPO benchmark's section of docs/benchmarks.md, built from benchmarks/results/dpo.json (`dpo_run.py`)."""

from __future__ import annotations

STEP_TARGET, MEMORY_TARGET = 0.90, 1.00


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _met(value: float, target: float) -> str:
    return "yes" if value <= target else "**no**"


def step_table(result: dict) -> str:
    lines = ["| mode | paratrain step (ms) | TRL step (ms) | paratrain / TRL (median of rounds) | rounds' ratios "
             "(min–max) | target ≤ 0.90 | loss diff, first step | max loss diff, all steps |",
             "|---|---:|---:|---:|---|---|---:|---:|"]
    runs = [(mode, p) for mode, p in result["paired"].items()]
    runs += [(f"{mode}, TRL on DeepSpeed's default buckets", p)
             for mode, p in result.get("paired_deepspeed_defaults", {}).items()]
    for mode, p in runs:
        ratios = p["ratios"]
        lines.append(f"| {mode} | {_ms(p['median_step_s']['paratrain'])} | {_ms(p['median_step_s']['trl'])} | "
                     f"{p['median_ratio']:.3f} | {min(ratios):.3f}–{max(ratios):.3f} | "
                     f"{_met(p['median_ratio'], STEP_TARGET)} | {p['first_step_loss_diff']:.1e} | "
                     f"{p['max_loss_diff']:.1e} |")
    return "\n".join(lines)


def _defaults_note(result: dict) -> str:
    if not result.get("paired_deepspeed_defaults"):
        return ""
    return ("\nThe rows \"TRL on DeepSpeed's default buckets\" pair paratrain with TRL on DeepSpeed's own ZeRO-3 "
            "defaults (5e8-element reduce bucket, 5e7 prefetch, no overlap_comm; the same persistence threshold 0), "
            "in worlds of their own: whichever TRL configuration is faster here is its best, and the target is "
            "read against it.\n")


def memory_table(result: dict) -> str:
    lines = ["| mode | paratrain peak RSS / rank (MiB) | TRL peak RSS / rank (MiB) | ratio | target ≤ 1.00 | "
             "growth over imports, paratrain / TRL (MiB) | tensors held between steps, paratrain / TRL (MiB) | "
             "of which the reference (MiB) |", "|---|---:|---:|---:|---|---|---|---|"]
    for mode in result["paired"]:
        ours, trl = result["memory"][f"paratrain {mode}"], result["memory"][f"trl {mode}"]
        ratio = ours["peak_rss_mib"] / trl["peak_rss_mib"]
        lines.append(f"| {mode} | {ours['peak_rss_mib']:.0f} | {trl['peak_rss_mib']:.0f} | {ratio:.3f} | "
                     f"{_met(ratio, MEMORY_TARGET)} | {ours['growth_mib']:.0f} / {trl['growth_mib']:.0f} | "
                     f"{ours['state_mib']:.2f} / {trl['state_mib']:.2f} | "
                     f"{ours['reference_mib']:.2f} / {trl['reference_mib']:.2f} |")
    return "\n".join(lines)


def collectives_note(result: dict) -> str:
    """Collectives per step, rank 0, the last step of the memory runs (torch.distributed's calls for TRL;
    paratrain's own count, `engine.comm_stats()`)."""
    rows = []
    for mode in result["paired"]:
        trl = result["memory"][f"trl {mode}"].get("collectives_last_step_rank0")
        ours = result["memory"][f"paratrain {mode}"].get("collectives_last_step_rank0")
        if trl is None or ours is None:
            return ""
        rows.append(f"| {mode} | {sum(ours.values())} ({_calls(ours)}) | {sum(trl.values())} ({_calls(trl)}) |")
    def _trl_step(mode: str) -> float:
        return result["paired"][mode]["median_step_s"]["trl"] if mode in result["paired"] else 0.0

    gathers = {mode: result["memory"][f"trl {mode}"]["collectives_last_step_rank0"].get("all_gather_into_tensor", 0)
               for mode in result["paired"]}
    why = (f"DeepSpeed's ZeRO-3 under peft gathers parameters module by module — {gathers.get('LoRA')} all-gathers in "
           f"TRL's LoRA step against {gathers.get('full')} in its full step (the adapters' many small modules, in the "
           f"policy's forward, the reference forward with the adapters off and the backward) — which is why TRL's LoRA "
           f"step is slower than its full one here; paratrain gathers a whole unit (a decoder layer) at once.\n"
           if "LoRA" in gathers and "full" in gathers and _trl_step("LoRA") > _trl_step("full") else "")
    return ("\nCollectives per step (rank 0, the last step of the memory runs; paratrain's `engine.comm_stats()`, "
            "TRL's the torch.distributed calls DeepSpeed and accelerate make):\n\n| mode | paratrain | TRL |\n"
            "|---|---|---|\n" + "\n".join(rows) + "\n\n" + why)


def _calls(counts: dict) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def reference_table(result: dict) -> str:
    lines = ["| mode | reference | median step (ms) | / precomputed (`batch`) | reference tensors / rank (MiB) | "
             "all tensors / rank (MiB) | peak RSS / rank, alone (MiB) |", "|---|---|---:|---:|---:|---:|---:|"]
    for mode, cases in result["reference_modes"].items():
        batch = cases["batch"]["median_step_s"]
        for ref, case in cases.items():
            if not isinstance(case, dict):
                continue
            memory = case["memory_stats_rank0"]
            rss = result["memory"].get(f"paratrain {mode} reference {ref}", {}).get("peak_rss_mib")
            lines.append(f"| {mode} | `{ref}` | {_ms(case['median_step_s'])} | {case['median_step_s'] / batch:.3f} | "
                         f"{memory['reference_params'] / 2**20:.2f} | {memory['total'] / 2**20:.2f} | "
                         f"{'—' if rss is None else f'{rss:.0f}'} |")
    return "\n".join(lines)


def section(result: dict) -> str:
    m, v = result["model"], result["versions"]
    loads = ", ".join(f"{k} {' / '.join(f'{x:.1f}' for x in val)}" for k, val in result["load_average"].items())
    command = (f"DS_ACCELERATOR=cpu python -m benchmarks.dpo_run --rounds {result['rounds']} --warmup "
               f"{result['warmup']} --memory-steps {result['memory_steps']}"
               + (" --with-defaults" if result.get("paired_deepspeed_defaults") else ""))
    return f"""### dpo

Measured {result['started']} on {result['machine']}; transformers {v['transformers']}, TRL
{v['trl']}, DeepSpeed {v['deepspeed']}, accelerate {v['accelerate']}, peft {v['peft']}. The whole run took
{result['wall_s'] / 60:.1f} min; load average (1 / 5 / 15 min) {loads} — the machine was shared with other
developers' runs.

Command: `{command}` (`benchmarks/dpo.py`, `benchmarks/dpo_run.py`; raw step times, losses, configs and
memory per rank: `benchmarks/results/dpo.json`).

A DPO step (sigmoid, beta {m['beta']}) on ZeRO-3, 2 ranks: paratrain against TRL's `DPOTrainer` on DeepSpeed
ZeRO-3, run as TRL's users run it (`trainer.train()`), on the same transformers Llama ({m['parameters'] / 1e6:.1f}M
parameters: 4 layers, width 256, 8 heads over 4 k/v heads), the same {m['pairs_per_rank']} preference pairs per rank
and step (cut from the embedded corpus, collated by `PreferenceCollator` padded to {m['seq']}, in the same order),
seed 0, fp32, torch's fused AdamW (lr 0.001, betas (0.9, 0.95), weight decay 0.1; DeepSpeed's `torch_adam` +
`fused`), clipping {m['clip']}, no accumulation, constant learning rate. LoRA: peft's adapters (r 8, alpha 16, every
projection; TRL builds them from the same `LoraConfig`, then gets the very same values), the reference the base with
the adapters off on both sides. Full: a frozen copy of the initial model, ZeRO-3-sharded on both (TRL:
`prepare_deepspeed`). ZeRO-3 shards every tensor on both sides (persistence threshold 0); DeepSpeed with
overlap_comm, contiguous_gradients and 1M-element reduce and prefetch buckets. accelerate 1.16 does not take
DeepSpeed without an accelerator device (it counts 1 process), so the benchmark makes accelerate's state first on
the gloo world and marks it DeepSpeed (`benchmarks/dpo.py`, `accelerate_state_on_cpu`); DeepSpeed then runs with
DS_ACCELERATOR=cpu.

**Step time**, paired in one world per mode: TRL's `train()` drives and a callback runs paratrain's step after
TRL's in even rounds and before it in odd ones, a barrier before each; TRL's step is `on_step_begin` to
`on_step_end` (forward, reference forward, backward, DeepSpeed's reduce, clip and update, TRL's metric gathers),
paratrain's `engine.train_batch`. A step's time is its slowest rank's; {result['rounds']} rounds after
{result['warmup']} warm-up. Losses: TRL's mean over ranks against paratrain's global mean, every step (the first
step's DPO loss is ln 2 on both sides, as the policy is its reference; the later steps check the updates). Both
sides record what they built (`benchmarks.common.record_setup`: the optimizer below DeepSpeed's wrapper, its flags,
threads, dtype, seeds) and the run is refused unless the records are equal; TRL's micro-batches are checked to be
paratrain's (their token sums, step by step and rank by rank).

{step_table(result)}
{_defaults_note(result)}
**Peak memory**, each case alone in a fresh 2-rank world that imports the same libraries first and runs
{result['memory_steps']} steps: `ru_maxrss` of the larger rank; its growth over the RSS after imports; and the
tensors held between steps (paratrain: `memory_stats()['total']`; TRL: DeepSpeed's partitions, flat buffers,
gradients and optimizer state, plus its reference engine's partitions).

{memory_table(result)}

{collectives_note(result)}
**The reference forward's cost**, paratrain alone, one world per mode, the engines' steps in rotation:
`adapters_off` (the base with the adapters off: no second copy), `initial` (a frozen copy of the model as handed
in, ZeRO-3-sharded), `batch` (TRL's `precompute_ref_log_probs`: the log-probs computed beforehand and carried by
the micro-batch: no reference forward in the step). The benchmark asserts that `adapters_off` holds no reference
tensor and as many tensor bytes as `batch`; tests/distributed/test_objectives.py asserts the same on 4 ranks in
every run of the suite (`reference_params` 0 with the adapters off, exactly the policy's shards with the initial
copy).

{reference_table(result)}
"""
