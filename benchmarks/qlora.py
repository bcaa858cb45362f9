"""QLoRA against LoRA in the same layout, in the real job on 2 processes:

    python -m benchmarks.qlora --rounds 2

paratrain's Llama (4 layers, width 512, SwiGLU 1,408, 8 heads over 4 k/v heads, the byte vocabulary, 128-token
rows; 12.06 M parameters) trained by `paratrain train --nproc-per-node 2` on the embedded corpus, ZeRO-3 over dp2
with every tensor sharded as FSDP2 shards them (`stage3_param_persistence_threshold` 0: at the default the adapters
and norms would stay whole on every rank), fp32, AdamW, 4 rows per rank per step, through the `peft` section: LoRA
r 8 on every projection of the blocks. The jobs differ only in `peft.quantize_base`: "nf4" (the adapted bases in
4 bits, bitsandbytes' CPU backend), "nf4" with `double_quant` (the blocks' scales quantized again, as torchao's NF4
always does), "nf4" by torchao (`quantize_backend` "torchao": torchao's own NF4 format, the like-for-like memory
comparison), or none. Each round runs them back to back, rotating which goes
first. Read
from the runs' files:
- step: the median `step_time_s` from step 3 on;
- model state per rank: `memory_stats()`' total and its frozen part (the rows' `state_bytes_per_rank`, the summary);
- peak RSS per rank (`peak_rss_per_rank`): the whole process, the Python and torch runtime included.
The losses are not compared (a 4-bit base is another model). Results: benchmarks/results/qlora.json; the docs'
table is printed at the end. Nothing asserts a time.

Beside both, in the same rounds: torch FSDP2 + torchao's NF4, torchtune's way (`benchmarks/qlora_fsdp2.py`), the
same model, shapes and AdamW under torch's launcher; its model state is its shards of every parameter (NF4 scales
included), gradients and optimizer state between steps. paratrain's `memory_stats()` also counts the units gathered
at that moment and the parts of the 4-bit weights' quantization state it keeps whole (with double quantization, the
scales' code book and offset).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "qlora.json"
STEPS = 12
MODEL = {"vocab_size": 256, "seq_len": 128, "n_layer": 4, "n_head": 8, "n_kv_head": 4, "d_model": 512, "d_ff": 1408}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ORDER = ["lora", "qlora", "qlora_double", "qlora_torchao", "fsdp2_torchao"]


def _config(quantize: str | None, double: bool = False, backend: str = "bitsandbytes") -> dict:
    quantized = {"quantize_base": quantize, "double_quant": double, "quantize_backend": backend} if quantize else {}
    peft = {"r": 8, "alpha": 16, "target_modules": TARGETS, **quantized}
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 4,
            "seed": 1234, "peft": peft,
            "trainer": {"model": "llama-tiny", "model_overrides": MODEL, "steps": STEPS, "eval_every": 0,
                        "progress_bar": False}}


def _run(quantize: str | None, work: Path, double: bool = False, backend: str = "bitsandbytes") -> dict:
    (work / "c.json").write_text(json.dumps(_config(quantize, double, backend)))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "paratrain.cli", "train", "--config", "c.json", "--nproc-per-node",
                           "2", "--run-dir", "run"], cwd=work, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    last = next(r for r in reversed(rows) if "state_bytes_per_rank" in r)
    return {"step_s": statistics.median(r["step_time_s"] for r in rows[2:]), "loss": [r["loss"] for r in rows],
            "state_bytes_per_rank": last["state_bytes_per_rank"], "peak_rss_per_rank": last["peak_rss_per_rank"],
            "summary": json.loads((work / "run" / "summary.json").read_text()), "wall_s": time.perf_counter() - start}


def _peer(work: Path) -> dict:
    """torch FSDP2 over torchao's NF4 (`benchmarks/qlora_fsdp2.py`), the same model, shapes and optimizer."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           "29640", str(ROOT / "benchmarks" / "qlora_fsdp2.py"), "--out", str(work), "--steps",
                           str(STEPS)], cwd=work, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]
    return {"step_s": statistics.median(ranks[0]["step_times_s"][2:]),
            "state_bytes_per_rank": [sum(r["state"].values()) for r in ranks], "state": [r["state"] for r in ranks],
            "wall_s": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    out = {"suite": "qlora", "machine": os.uname().machine, "cpus": os.cpu_count(), "rounds": []}
    for i in range(args.rounds):
        pair = {}
        for kind in ORDER[i % len(ORDER):] + ORDER[:i % len(ORDER)]:  # each round starts with another
            with tempfile.TemporaryDirectory() as tmp:
                pair[kind] = _peer(Path(tmp)) if kind == "fsdp2_torchao" else \
                    _run("nf4" if kind.startswith("qlora") else None, Path(tmp), double=kind != "qlora",
                         backend="torchao" if kind == "qlora_torchao" else "bitsandbytes")
        peer = pair["fsdp2_torchao"]
        pair["step_ratio"] = pair["qlora"]["step_s"] / pair["lora"]["step_s"]
        for kind, suffix in (("qlora", ""), ("qlora_double", "_double"), ("qlora_torchao", "_torchao")):
            pair[f"step_vs_fsdp2{suffix}"] = pair[kind]["step_s"] / peer["step_s"]
            pair[f"state_vs_fsdp2{suffix}"] = max(pair[kind]["state_bytes_per_rank"]) / \
                max(peer["state_bytes_per_rank"])
        out["rounds"].append(pair)
        print(f"round {i}: step {pair['lora']['step_s'] * 1e3:.0f} ms (LoRA) vs {pair['qlora']['step_s'] * 1e3:.0f} ms"
              f" (QLoRA) vs {pair['qlora_double']['step_s'] * 1e3:.0f} ms (double) vs "
              f"{pair['qlora_torchao']['step_s'] * 1e3:.0f} ms (torchao NF4) vs "
              f"{peer['step_s'] * 1e3:.0f} ms (FSDP2 + torchao), state {pair['lora']['state_bytes_per_rank']} vs "
              f"{pair['qlora']['state_bytes_per_rank']} vs {pair['qlora_double']['state_bytes_per_rank']} vs "
              f"{pair['qlora_torchao']['state_bytes_per_rank']} vs {peer['state_bytes_per_rank']}", flush=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))
    return 0


def table(out: dict) -> str:
    def median(kind: str, read) -> float:
        return statistics.median(read(r[kind]) for r in out["rounds"])

    lines = ["| ZeRO-3 dp2, LoRA r 8 on every projection | step (ms) | model state per rank (MiB) | peak RSS per rank "
             "(MiB) |", "|---|---:|---:|---:|"]
    for kind, label in (("lora", "paratrain LoRA, fp32 base"), ("qlora", "paratrain QLoRA, nf4 base (bitsandbytes)"),
                        ("qlora_double", "paratrain QLoRA, nf4 base, double quantization (bitsandbytes)"),
                        ("qlora_torchao", "paratrain QLoRA, torchao NF4 base (`quantize_backend` torchao)"),
                        ("fsdp2_torchao", "torch FSDP2 + torchao NF4 (torchtune's way; its scales double-quantized)")):
        rss = f"{median(kind, lambda r: max(r['peak_rss_per_rank'])) / 2**20:.0f}" if kind != "fsdp2_torchao" else "-"
        lines.append(f"| {label} | {median(kind, lambda r: r['step_s']) * 1e3:.0f} | "
                     f"{median(kind, lambda r: max(r['state_bytes_per_rank'])) / 2**20:.1f} | {rss} |")
    for key, what in (("step_ratio", "QLoRA step / LoRA step"), ("step_vs_fsdp2", "QLoRA step / FSDP2 + torchao's"),
                      ("state_vs_fsdp2", "QLoRA model state / FSDP2 + torchao's"),
                      ("step_vs_fsdp2_double", "QLoRA (double) step / FSDP2 + torchao's"),
                      ("state_vs_fsdp2_double", "QLoRA (double) model state / FSDP2 + torchao's"),
                      ("step_vs_fsdp2_torchao", "QLoRA (torchao NF4) step / FSDP2 + torchao's"),
                      ("state_vs_fsdp2_torchao", "QLoRA (torchao NF4) model state / FSDP2 + torchao's")):
        ratios = ", ".join(f"{r[key]:.3f}" for r in out["rounds"])
        lines.append(f"\n{what}: {statistics.median(r[key] for r in out['rounds']):.3f} (rounds {ratios})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
