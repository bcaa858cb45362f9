"""Expert parallelism: paratrain ep2 vs DeepSpeed-MoE ep_size=2 vs paratrain without EP (DDP), 2 ranks, CPU/gloo.

    DS_ACCELERATOR=cpu python -m benchmarks.moe              # run, write benchmarks/results/moe.json and the doc
    python -m benchmarks.moe --table                         # rebuild the docs table from the committed JSON

One model for all three cases (`MoEBench`): token embedding -> L blocks of [RMSNorm -> MoE] with residuals ->
RMSNorm -> head, cross-entropy + AUX_COEF x the mean of the blocks' balancing losses. No attention: the step is
about the experts and their all-to-all. 8 SwiGLU experts (down(silu(gate x) * up x), no biases), top-2, softmax
router in float32 with the two weights renormalised, dropless. The paratrain cases use `paratrain.moe.MoELayer`;
the DeepSpeed case uses `deepspeed.moe.layer.MoE` with a SwiGLU expert module, and copies every weight of the
paratrain model built from the same seed (router, the experts its ep rank holds, embedding, norms, head), so the
three start from the same parameters. Same data (`LocalBatches`), same AdamW (fused, lr 1e-3, betas (0.9, 0.95),
weight decay 0.1), clipping at 1.0, fp32, one torch thread per rank; checked by `benchmarks.common` as every
suite's cases are. DeepSpeed runs ZeRO stage 0 (plain data parallelism: its expert gradients all-reduced over
the expert-data-parallel group), as paratrain's cases run without ZeRO (DDP).

Remaining differences, recorded in the JSON too: DeepSpeed's l_aux counts only each token's *first* choice in
f_e (paratrain's balancing loss counts both of the k choices), so the aux term (coefficient 0.01) and its
gradient on the router differ slightly; DeepSpeed's top-2 picks the second expert by argmax of the logits
excluding the first (the same expert as the second-best softmax score), and with drop_tokens=False its capacity
is the ep group's largest expert count (an all-reduce MAX), the dispatch buffer padded to it on every rank,
while paratrain's dropless dispatch sends exactly the rows each expert gets (counted uneven all-to-all).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import traceback

import torch.distributed as dist

from benchmarks.common import (
    LocalBatches,
    Timer,
    check_same_setup,
    deepspeed_optimizer,
    expected_setup,
    paratrain_optimizer,
    record_setup,
    run_case,
)
from benchmarks.moe_model import AUX_COEF, MODEL, deepspeed_model, paratrain_model
from benchmarks.suite import RESULTS, machine, write_doc

SEQ_LEN = 128
MICRO_BATCH = 8
COMMAND = "DS_ACCELERATOR=cpu python -m benchmarks.moe"


def _batches() -> LocalBatches:
    return LocalBatches(MICRO_BATCH, dist.get_world_size(), dist.get_rank(), seq_len=SEQ_LEN)


def _per_step(snapshot: dict, steps: int) -> dict:
    """{axis/op/tag: bytes per step} of a by-tag comm snapshot."""
    out = {}
    for axis, ops in snapshot.items():
        for op, tags in ops.items():
            for tag, count in tags.items():
                out[f"{axis}/{op}/{tag}"] = count["bytes"] / steps
    return out


def _paratrain(ep: int, steps: int, warmup: int) -> dict:
    import paratrain

    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 1.0,
           "optimizer": paratrain_optimizer(), "expert_parallel": {"size": ep}}
    model = paratrain_model()
    engine, *_ = paratrain.initialize(model=model, config=cfg)
    batches = _batches()
    timer = Timer(warmup, record_setup(engine.optimizer, model, batches))
    engine.comm_stats(reset=True)
    timer.measure(steps, lambda: engine.train_batch(batches))
    comm = _per_step(engine.comm_stats(reset=True, by_tag=True), warmup + steps)
    return timer.result(state_bytes=engine.memory_stats()["total"], comm_bytes_per_step=comm)


def paratrain_ep2(steps: int, warmup: int) -> dict:
    return _paratrain(2, steps, warmup)


def paratrain_no_ep(steps: int, warmup: int) -> dict:
    return _paratrain(1, steps, warmup)


def deepspeed_ep2(steps: int, warmup: int) -> dict:
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.utils.logger.setLevel(logging.WARNING)
    model = deepspeed_model(2, dist.get_rank() % 2)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                    "name": "parameters"})
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 1.0,
              "optimizer": deepspeed_optimizer(), "steps_per_print": 10**9, "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config,
                                      dist_init_required=False)
    batches = _batches()

    def step():
        x, y = next(batches)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the same metric cost as train_batch's global mean loss
        return mean / dist.get_world_size()

    timer = Timer(warmup, record_setup(engine.optimizer, model, batches))
    timer.measure(steps, step)
    return timer.result(state_bytes=None)


CASES = {
    "paratrain ep2": paratrain_ep2,
    "DeepSpeed-MoE ep_size=2": deepspeed_ep2,
    "paratrain no EP (DDP)": paratrain_no_ep,
}
OURS, PEERS = "paratrain ep2", ["DeepSpeed-MoE ep_size=2", "paratrain no EP (DDP)"]
DIFFERENCES = [
    "DeepSpeed's l_aux counts each token's first choice only in f_e; paratrain's balancing loss counts both "
    "top-2 choices (coefficient 0.01 in both): the aux term and its router gradient differ slightly.",
    "DeepSpeed dropless (drop_tokens=False) pads every expert's buffer to the ep group's largest count (an "
    "all-reduce MAX) and all-to-alls the padded (E, C, d) buffer; paratrain sends exactly the routed rows "
    "(counted uneven all-to-all).",
    "DeepSpeed runs ZeRO stage 0; the paratrain cases run DDP (no ZeRO). Both average expert gradients over "
    "the expert-data-parallel group (size 1 here with ep 2).",
]


def run(repeats: int, steps: int, warmup: int) -> dict:
    from paratrain.testing import World

    raw: dict[str, list] = {case: [] for case in CASES}
    errors: dict[str, str] = {}
    for r in range(repeats):
        for case, fn in CASES.items():
            if case in errors:
                continue
            print(f"[moe] repeat {r + 1}/{repeats}: {case}", file=sys.stderr, flush=True)
            try:
                with World(2, timeout_s=600) as world:
                    raw[case].append(world.run(run_case, case, fn, steps, warmup))
            except Exception as exc:  # recorded instead of a number (e.g. DeepSpeed-MoE refusing CPU/gloo)
                errors[case] = f"{type(exc).__name__}: {exc}"[-4000:]
                traceback.print_exc()
    # every case, repeat and rank built the same optimizer, threads, dtype and seeds (refused otherwise)
    check_same_setup({"expected": expected_setup(), **{f"{case} (repeat {i + 1}, rank {r})": rank["setup"]
                                                       for case, runs in raw.items() for i, ranks in enumerate(runs)
                                                       for r, rank in enumerate(ranks)}})
    tokens = 2 * MICRO_BATCH * SEQ_LEN
    summary = {}
    for case, runs in raw.items():
        if not runs:
            summary[case] = {"error": errors.get(case, "no run")}
            continue
        medians = [statistics.median(max(s) for s in zip(*(rk["step_times"] for rk in ranks))) for ranks in runs]
        step = statistics.median(medians)
        summary[case] = {"median_step_s": step, "tokens_per_s": tokens / step,
                         "peak_rss_mib": statistics.median(max(rk["peak_rss"] for rk in ranks) for ranks in runs)
                         / 2**20, "last_loss": runs[0][0]["losses"][-1], "first_loss": runs[0][0]["losses"][0],
                         "comm_bytes_per_step": runs[0][0].get("comm_bytes_per_step")}
        if case in errors:
            summary[case]["error"] = errors[case]
    ours = summary[OURS]
    for peer in PEERS:
        if "tokens_per_s" in ours and "tokens_per_s" in summary[peer]:
            ours.setdefault("vs", {})[peer] = {
                "tokens_per_s_ratio": ours["tokens_per_s"] / summary[peer]["tokens_per_s"],
                "peak_rss_ratio": ours["peak_rss_mib"] / summary[peer]["peak_rss_mib"]}
    return {"suite": "moe", "command": f"{COMMAND} --repeats {repeats} --steps {steps} --warmup {warmup}",
            "machine": machine(), "model": {**MODEL, "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH,
                                            "aux_coef": AUX_COEF, "attention": False, "capacity": "dropless"},
            "tokens_per_step": tokens, "repeats": repeats, "steps": steps, "warmup": warmup,
            "differences": DIFFERENCES, "errors": errors, "summary": summary,
            "setup": {case: runs[0][0]["setup"] for case, runs in raw.items() if runs}, "raw": raw}


def _ep_bytes(comm: dict | None) -> str:
    if not comm:
        return "—"
    parts = []
    for tag in ("ep_dispatch", "ep_combine", "ep_counts"):
        total = sum(v for k, v in comm.items() if k.endswith("/" + tag))
        if total:
            parts.append(f"{tag.removeprefix('ep_')} {total / 2**10:.1f}")
    return ", ".join(parts) or "—"


def _repeat_medians(runs: list) -> str:
    """Each repeat's median step (slowest rank), to show this shared machine's spread."""
    return ", ".join(f"{statistics.median(max(s) for s in zip(*(rk['step_times'] for rk in ranks))) * 1e3:.0f}"
                     for ranks in runs)


def table(result: dict) -> str:
    lines = [f"{result['repeats']} interleaved repeats x {result['steps']} measured steps after "
             f"{result['warmup']} warm-up; {result['tokens_per_step']} tokens per step (global), 2 ranks. "
             f"Model: {result['model']}.", "",
             "| case | median step (ms) | tokens/s | peak RSS / rank, worst (MiB) | paratrain ep2 tokens/s ratio "
             "| paratrain ep2 RSS ratio | first / last loss | ep all-to-all KiB/step/rank | per-repeat medians (ms) |",
             "|---|---:|---:|---:|---:|---:|---|---|---|"]
    ours = result["summary"][OURS]
    for case, row in result["summary"].items():
        if "tokens_per_s" not in row:
            lines.append(f"| {case} | error | — | — | — | — | — | — | — |")
            continue
        vs = ours.get("vs", {}).get(case)
        ratio = f"{vs['tokens_per_s_ratio']:.3f}" if vs else "—"
        rss = f"{vs['peak_rss_ratio']:.3f}" if vs else "—"
        lines.append(f"| {case} | {row['median_step_s'] * 1e3:.1f} | {row['tokens_per_s']:.0f} | "
                     f"{row['peak_rss_mib']:.0f} | {ratio} | {rss} | {row['first_loss']:.4f} / "
                     f"{row['last_loss']:.4f} | {_ep_bytes(row.get('comm_bytes_per_step'))} | "
                     f"{_repeat_medians(result['raw'][case])} |")
    lines += ["", "Ratios are paratrain ep2 / the row's case (tokens/s: > 1 is faster; RSS: < 1 is smaller). "
                  "tokens/s is the global tokens of a step over the median over repeats of each repeat's median "
                  "step (a step's time is its slowest rank's). The all-to-all bytes are rank 0's, summed over "
                  "forward and backward, from `engine.comm_stats(by_tag=True)`; DeepSpeed exposes no such count. "
                  "This machine is shared and noisy: compare the per-repeat medians before reading a ratio."]
    for case, error in result["errors"].items():
        lines += ["", f"{case} did not run: `{error.strip().splitlines()[-1][:600]}`"]
    lines += ["", "Differences that remain between the cases:", ""] + [f"- {d}" for d in result["differences"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--table", action="store_true", help="rebuild the doc table from the committed JSON only")
    parser.add_argument("--no-doc", action="store_true", help="print the table, do not touch docs/benchmarks.md")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    path = RESULTS / "moe.json"
    if args.table:
        result = json.loads(path.read_text())
    else:
        result = run(args.repeats, args.steps, args.warmup)
        RESULTS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    body = table(result)
    print(body)
    if not args.no_doc:
        write_doc("moe", body, result["command"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
