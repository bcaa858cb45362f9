"""Muon against AdamW on the demo job (configs/demo.json: gpt-mini on the embedded corpus), each at its tuned lr.

    python -m benchmarks.muon_convergence          # benchmarks/results/muon_convergence.json, the picture, the doc
    python -m benchmarks.muon_convergence --steps 10 --eval-every 5 --eval-batches 2 --no-doc --results /tmp/mc

Each sweep point is the demo job (`paratrain.trainer.job.train`, the `paratrain train` job) in one process (dp1,
one thread, a fresh spawned world per point) with the demo's global batch: micro-batch 16 = the demo's 2
processes x 8, so the same tokens per step; the demo's seed, warm-up + cosine schedule (over the run's steps),
clipping 1.0 and model. Only the optimizer section changes. Validation loss: the trainer's evaluation every
`--eval-every` steps on the same first `--eval-batches` micro-batches of the corpus's validation split (the last
10%), every point the same windows.

The sweep: AdamW (the demo's betas and weight decay) at each lr of ADAMW_LRS; then Muon at each lr of MUON_LRS,
its AdamW part (embeddings, head, norms, biases: the model spec's choice) at the best AdamW lr. Best = the
lowest validation loss at the last step; a best at the edge of its grid adds the next lr beyond it (up to 2
more points per optimizer), so each chosen lr is bracketed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.suite import DOC, RESULTS, ROOT, machine
from paratrain.bench.table import write_between_markers
from paratrain.testing import World

ADAMW_LRS = (1e-3, 3e-3, 1e-2)
MUON_LRS = (0.01, 0.02, 0.05)
MUON = {"momentum": 0.95, "weight_decay": 0.1, "ns_steps": 5, "ns_dtype": "bfloat16", "adjust_lr_fn": None}
MICRO_BATCH = 16  # the demo's 2 processes x 8 in one process
IMAGE = ROOT / "docs" / "images" / "muon_convergence.png"
BEGIN, END = "<!-- muon_convergence -->", "<!-- /muon_convergence -->"


def demo_config(optimizer: dict, steps: int, eval_every: int, eval_batches: int) -> dict:
    cfg = json.loads((ROOT / "configs" / "demo.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = MICRO_BATCH
    cfg["optimizer"] = optimizer
    cfg["scheduler"]["params"].update(total_num_steps=steps, warmup_num_steps=max(1, steps // 10))
    cfg["trainer"].update(steps=steps, eval_every=eval_every, eval_batches=eval_batches, progress_bar=False)
    return cfg


def adamw(lr: float) -> dict:
    demo = json.loads((ROOT / "configs" / "demo.json").read_text())["optimizer"]["params"]
    return {"type": "AdamW", "params": {**demo, "lr": lr}}


def muon(lr: float, adamw_lr: float) -> dict:
    part = {**adamw(adamw_lr)["params"], "eps": 1e-8}
    return {"type": "Muon", "params": {"lr": lr, **MUON, "adamw": part}}


def train_point(cfg: dict) -> dict:
    """One sweep point, in a spawned one-process world: the trainer's rows."""
    from paratrain.engine.monitor import peak_rss_bytes
    from paratrain.trainer.job import train

    with tempfile.TemporaryDirectory() as run_dir:
        summary = train(cfg, run_dir=run_dir)
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"val_steps": [r["step"] for r in rows if "val_loss" in r],
            "val_loss": [r["val_loss"] for r in rows if "val_loss" in r], "train_loss": [r["loss"] for r in rows],
            "wall_s": summary["wall_s"], "tokens_per_s": summary["tokens_per_s"], "peak_rss": peak_rss_bytes()}


def sweep(name: str, lrs, make, args) -> list[dict]:
    """Every lr of `lrs`; if the best is the largest or smallest, one more lr beyond it (x / the grid's ratio),
    so the chosen lr is bracketed."""
    points, lrs = [], list(lrs)
    while lrs:
        lr = lrs.pop(0)
        print(f"[muon_convergence] {name} lr {lr:g}", file=sys.stderr, flush=True)
        optimizer = make(lr)
        with World(1, timeout_s=1800) as world:
            curve = world.run(train_point, demo_config(optimizer, args.steps, args.eval_every, args.eval_batches))[0]
        points.append({"optimizer": name, "lr": lr, "config": optimizer, **curve})
        if not lrs and len(points) < 5:
            tried = sorted(p["lr"] for p in points)
            chosen = best(points)["lr"]
            if chosen in (tried[0], tried[-1]):
                step = tried[-1] / tried[-2] if chosen == tried[-1] else tried[0] / tried[1]
                lrs.append(float(f"{chosen * step:.2g}"))
    return points


def best(points: list[dict]) -> dict:
    return min(points, key=lambda p: p["val_loss"][-1])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, color in (("AdamW", "tab:blue"), ("Muon", "tab:red")):
        chosen = result["best"][name]
        for p in (p for p in result["points"] if p["optimizer"] == name):
            mine = p["lr"] == chosen["lr"]
            ax.plot(p["val_steps"], p["val_loss"], color=color, alpha=1.0 if mine else 0.3, lw=2 if mine else 1,
                    ls="-" if mine else "--", marker="o" if mine else None, ms=3,
                    label=f"{name} lr {p['lr']:g}" + (" (best)" if mine else ""))
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{result['model']} on the embedded corpus, {result['tokens_per_step']:,} tokens/step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(result: dict, command: str) -> str:
    rows = ["| optimizer | lr | AdamW-part lr | validation loss, last step | lowest | train loss, last step | "
            "seconds |", "|---|---:|---:|---:|---:|---:|---:|"]
    for p in result["points"]:
        part = p["config"]["params"]["adamw"]["lr"] if p["optimizer"] == "Muon" else None
        mark = "**" if p["lr"] == result["best"][p["optimizer"]]["lr"] else ""
        rows.append(f"| {p['optimizer']} | {mark}{p['lr']:g}{mark} | {'—' if part is None else f'{part:g}'} | "
                    f"{mark}{p['val_loss'][-1]:.4f}{mark} | {min(p['val_loss']):.4f} | {p['train_loss'][-1]:.4f} | "
                    f"{p['wall_s']:.0f} |")
    a, m = result["best"]["AdamW"], result["best"]["Muon"]
    grids = {"AdamW": ADAMW_LRS, "Muon": MUON_LRS}
    added = [f"{p['optimizer']} lr {p['lr']:g}" for p in result["points"] if p["lr"] not in grids[p["optimizer"]]]
    extended = (f"Added beyond the grid because the best was at its edge: {', '.join(added)}." if added else
                "Each tuned lr lies inside its grid.")
    return (f"### Muon vs AdamW convergence\n\nMeasured {result['started']} on {result['machine']}; the sweep took "
            f"{result['wall_s'] / 60:.1f} min.\n\nCommand: `{command}`\n\n"
            f"The demo job (`configs/demo.json`: {result['model']}, {result['params']:,} parameters, on the embedded "
            f"corpus) in one process (dp1) with the demo's global batch ({MICRO_BATCH} sequences of "
            f"{result['seq_len']} tokens = its 2 processes x 8), {result['steps']} steps = "
            f"{result['tokens']:,} tokens for every point, its seed, clipping and warm-up + cosine schedule; "
            f"validation loss every {result['eval_every']} steps on the same {result['eval_windows']} held-out "
            f"windows. AdamW swept over lr {', '.join(f'{x:g}' for x in ADAMW_LRS)}; Muon (momentum 0.95, 5 "
            f"Newton-Schulz steps in bfloat16, weight decay 0.1, on the hidden matrices) over lr "
            f"{', '.join(f'{x:g}' for x in MUON_LRS)}, its AdamW part at AdamW's best lr. Tuned: **AdamW lr "
            f"{a['lr']:g}, validation loss {a['val_loss'][-1]:.4f}; Muon lr {m['lr']:g}, validation loss "
            f"{m['val_loss'][-1]:.4f}** ({m['val_loss'][-1] - a['val_loss'][-1]:+.4f}); Muon took "
            f"{m['wall_s'] / a['wall_s']:.2f}x AdamW's time on this CPU. Every point's curve: "
            f"`benchmarks/results/muon_convergence.json`.\n\n![validation loss vs step, Muon and AdamW at their tuned "
            f"lr](images/muon_convergence.png)\n\n" + "\n".join(rows) + "\n\nBold: the tuned lr. " + extended + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-batches", type=int, default=45, help="micro-batches of 16 (45: all 720 windows)")
    parser.add_argument("--no-doc", action="store_true", help="leave docs/ alone (the picture goes to --results)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    start = time.time()
    points = sweep("AdamW", ADAMW_LRS, adamw, args)
    adamw_lr = best(points)["lr"]
    points += sweep("Muon", MUON_LRS, lambda lr: muon(lr, adamw_lr), args)
    chosen = {name: best([p for p in points if p["optimizer"] == name]) for name in ("AdamW", "Muon")}
    demo = json.loads((ROOT / "configs" / "demo.json").read_text())
    from paratrain.models import build_model

    model = build_model(demo["trainer"]["model"])
    seq_len = model.config.seq_len
    result = {"machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(start)),
              "wall_s": time.time() - start, "model": demo["trainer"]["model"],
              "params": sum(p.numel() for p in model.parameters()), "seq_len": seq_len, "processes": 1,
              "micro_batch": MICRO_BATCH, "steps": args.steps, "tokens_per_step": MICRO_BATCH * seq_len,
              "tokens": args.steps * MICRO_BATCH * seq_len, "eval_every": args.eval_every,
              "eval_windows": args.eval_batches * MICRO_BATCH, "adamw_lrs": ADAMW_LRS, "muon_lrs": MUON_LRS,
              "points": points, "best": {name: {k: p[k] for k in ("lr", "val_loss", "wall_s")}
                                         for name, p in chosen.items()}}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "muon_convergence.json").write_text(json.dumps(result, indent=1))
    command = (f"python -m benchmarks.muon_convergence --steps {args.steps} --eval-every {args.eval_every} "
               f"--eval-batches {args.eval_batches}")
    plot(result, args.results / IMAGE.name if args.no_doc else IMAGE)
    print(section(result, command))
    if not args.no_doc:
        write_between_markers(DOC, section(result, command), BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
