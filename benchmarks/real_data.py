"""Real data on the CPU: packed against padded rows, document-masked attention against plain causal attention,
and ring attention with packed documents.

    python -m benchmarks.real_data            # writes benchmarks/results/real_data.json and the docs tables
    python -m benchmarks.real_data --table    # the docs tables from the committed JSON

1. Packed vs padded: documents cut from the embedded corpus with log-normal lengths (median a quarter of the
   row, sigma 1, 8..row tokens: a long tail like SFT data), trained as 8 rows per step either packed back to
   back (best fit, `paratrain.data.packing`), or one per row padded to the longest of its micro-batch (dynamic
   padding, transformers' DataCollatorWithPadding: the padded side at its best), or padded to the row (fixed
   shapes, padding="max_length"). Both through
   `engine.train_batch` on dp2 (2 ranks, one thread each), the same Llama, AdamW and seed, alternating A B A B.
   Reported: real target tokens per second and the padding fraction of the rows.
2. Attention cost: one attention core (forward + backward, b=4, 8 heads of 64, one thread) on packed rows,
   against causal attention over the same rows: per-document causal SDPA (what paratrain runs), and the
   element-wise mask over the whole row (what a window or scattered ids need). Target: documents <= 1.2x causal.
3. Ring attention at cp4 (4 ranks on the 2 cores: times are relative) on rows of 2048, one document per row
   against packed documents (log-normal, median 512 and 64 tokens): the core's forward + backward time and the
   block parts computed and skipped (nothing to attend).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "real_data.json"
COMMAND = "python -m benchmarks.real_data"
ROW = 512
ROWS_PER_STEP = 8
SIGMA = 1.0
MODEL = dict(vocab_size=256, seq_len=ROW, n_layer=4, n_head=4, n_kv_head=2, d_model=256, d_ff=704)
SEED = 0


def document_lengths(count: int, row: int, seed: int = SEED) -> list[int]:
    """Log-normal lengths, median row / 4, clipped to 8..row."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(count, generator=g, dtype=torch.float64)
    return [int(min(row, max(8, round(math.exp(math.log(row / 4) + SIGMA * z))))) for z in normal.tolist()]


def documents(count: int, row: int) -> list[torch.Tensor]:
    from paratrain.data import load_corpus

    train, _ = load_corpus()
    out, at = [], 0
    for n in document_lengths(count, row):
        if at + n > train.numel():
            at = 0
        out.append(train[at:at + n].clone())
        at += n
    return out


def micro_batches(kind: str, docs: list[torch.Tensor], micro: int) -> list[dict]:
    from paratrain.data.packing import pack, packed_batch, padded_batch

    if kind == "padded":  # to the longest of the micro-batch
        return [padded_batch(docs[i:i + micro]) for i in range(0, len(docs) - micro + 1, micro)]
    if kind == "padded to the row":  # fixed shapes (padding="max_length")
        return [padded_batch(docs[i:i + micro], length=ROW) for i in range(0, len(docs) - micro + 1, micro)]
    rows = pack([d.numel() for d in docs], ROW)
    return [packed_batch(docs, rows[i:i + micro], ROW) for i in range(0, len(rows) - micro + 1, micro)]


def train_case(kind: str, steps: int, warmup: int) -> dict:
    """One rank's run of `kind` (packed | padded) on dp2: tokens/s of real targets, padding fraction."""
    import torch.distributed as dist

    import paratrain
    from paratrain.models import Llama

    torch.manual_seed(SEED)
    model = Llama("llama-tiny", **MODEL)
    micro = ROWS_PER_STEP // dist.get_world_size()
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "batch_check": "dtype", "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "fused": True}}}
    engine, *_ = paratrain.initialize(model=model, config=cfg)
    docs = documents(1200, ROW)
    mine = micro_batches(kind, docs, micro)[dist.get_rank()::dist.get_world_size()]
    assert len(mine) >= steps + warmup, len(mine)
    tokens = real = 0
    for batch in mine[:warmup]:
        engine.train_batch(iter([batch]))
    dist.barrier()
    start = time.perf_counter()
    for batch in mine[warmup:warmup + steps]:
        engine.train_batch(iter([batch]))
        tokens += batch["input_ids"].numel()
        real += int((batch["labels"][:, 1:] != -100).sum())  # targets: each real token but a document's last
    dist.barrier()
    seconds = time.perf_counter() - start
    totals = torch.tensor([tokens, real], dtype=torch.float64)
    dist.all_reduce(totals)
    return {"seconds": seconds, "row_tokens": int(totals[0]), "target_tokens": int(totals[1])}


def attention_costs(repeats: int = 7) -> dict:
    """Forward + backward of one attention core on packed rows (ms), one thread."""
    from paratrain.attention import Documents, allowed_pairs

    torch.set_num_threads(1)
    b, h, d, s = 4, 8, 64, 2048
    lengths = document_lengths(400, s, seed=1)
    rows = []
    it = iter(lengths)
    for _ in range(b):
        ids, doc = [], 0
        while len(ids) < s:
            ids += [doc] * next(it)
            doc += 1
        rows.append(ids[:s])
    ids = torch.tensor(rows)
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    index = torch.arange(s)
    mask = allowed_pairs(ids, index, index, None)

    def timed(run) -> float:
        best = []
        for _ in range(repeats):
            for t in (q, k, v):
                t.grad = None
            start = time.perf_counter()
            run().sum().backward()
            best.append(time.perf_counter() - start)
        return statistics.median(best[1:]) * 1e3

    from paratrain.attention import masked_attention

    causal = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    per_document = timed(lambda: masked_attention(q, k, v, Documents(ids), None))
    element_mask = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    return {"shape": [b, h, s, d], "documents_per_row": [len(set(r)) for r in rows], "causal_ms": round(causal, 1),
            "documents_ms": round(per_document, 1), "element_mask_ms": round(element_mask, 1),
            "documents_vs_causal": round(per_document / causal, 3), "mask_vs_causal": round(element_mask / causal, 3)}


def ring_case(median: int | None, repeats: int = 5) -> dict:
    """cp4: the ring attention core alone on rows of 2048: packed documents of log-normal lengths around
    `median`, or (None) one document per row."""
    import torch.distributed as dist

    from paratrain.attention import Documents
    from paratrain.comm import build_mesh
    from paratrain.layout.mesh import ParallelDims
    from paratrain.parallel.cp.ring_attention import RingAttentionCore

    mesh = build_mesh(ParallelDims(dist.get_world_size(), dp=1, cp=dist.get_world_size()))
    b, h, d, s = 2, 8, 64, 2048
    docs = None
    if median is not None:
        ids, doc, lengths = [], 0, iter(document_lengths(2000, 4 * median, seed=2))
        while len(ids) < b * s:
            ids += [doc] * next(lengths)
            doc += 1
        docs = Documents(torch.tensor(ids[:b * s]).view(b, s))
    local = s // mesh.axis("cp").size
    q, k, v = (torch.randn(b, h, local, d, requires_grad=True) for _ in range(3))
    core = RingAttentionCore(mesh.axis("cp"))
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        core(q, k, v, docs).sum().backward()
        times.append(time.perf_counter() - start)
    pairs = torch.tensor([core.pairs.computed, core.pairs.skipped], dtype=torch.float64)
    dist.all_reduce(pairs)
    return {"ms": round(statistics.median(times[1:]) * 1e3, 1), "parts_computed": int(pairs[0]) // repeats,
            "parts_skipped": int(pairs[1]) // repeats}


def run(repeats: int = 5, steps: int = 8, warmup: int = 2) -> dict:
    from paratrain.testing import World

    runs: dict[str, list] = {"packed": [], "padded": [], "padded to the row": []}
    for r in range(repeats):
        for kind in runs:
            print(f"[real_data] repeat {r + 1}/{repeats}: {kind}", file=sys.stderr, flush=True)
            with World(2, timeout_s=900) as world:
                ranks = world.run(train_case, kind, steps, warmup)
            runs[kind].append(ranks[0] | {"seconds": max(x["seconds"] for x in ranks)})  # the slower rank's
    training = {}
    for kind, results in runs.items():
        rates = [x["target_tokens"] / x["seconds"] for x in results]
        padding = 1 - results[0]["target_tokens"] / results[0]["row_tokens"]
        training[kind] = {"target_tokens_per_s": round(statistics.median(rates), 1),
                          "repeats": [round(x, 1) for x in rates], "non_target_fraction": round(padding, 4)}
    for peer in ("padded", "padded to the row"):  # the ratio of medians, and of each repeat's A/B pair
        pairs = [a / b for a, b in zip(training["packed"]["repeats"], training[peer]["repeats"])]
        training[f"packed_vs_{peer.replace(' ', '_')}"] = {
            "median": round(training["packed"]["target_tokens_per_s"] / training[peer]["target_tokens_per_s"], 3),
            "per_repeat": [round(x, 3) for x in pairs]}
    ring = {}
    for median in (None, 512, 64):
        with World(4, timeout_s=900) as world:
            ring["one document per row" if median is None else f"packed, median {median}"] = \
                world.run(ring_case, median)[0]
    return {"command": COMMAND, "setup": {"model": MODEL, "row": ROW, "rows_per_step": ROWS_PER_STEP,
                                          "lengths": f"log-normal, median row/4, sigma {SIGMA}, 8..row",
                                          "optimizer": "AdamW fused", "threads_per_rank": 1, "dtype": "float32",
                                          "seed": SEED, "layout": "dp2 (2 ranks)", "steps": steps,
                                          "warmup": warmup, "repeats": repeats},
            "training": training, "attention": attention_costs(), "ring_cp4": ring}


def training_table(result: dict) -> str:
    t, setup = result["training"], result["setup"]
    lines = ["| rows | target tokens/s (median) | per repeat | share of row tokens without a target | "
             "packed / this (median; per repeat) |", "|---|---:|---|---:|---|"]
    for kind in ("packed", "padded", "padded to the row"):
        row = t[kind]
        vs = t.get(f"packed_vs_{kind.replace(' ', '_')}")
        ratio = f"{vs['median']:.2f}x; {', '.join(f'{x:.2f}' for x in vs['per_repeat'])}" if vs else "—"
        lines.append(f"| {kind} | {row['target_tokens_per_s']:.0f} | "
                     f"{', '.join(f'{x:.0f}' for x in row['repeats'])} | {row['non_target_fraction']:.1%} | {ratio} |")
    lines += ["", f"{setup['repeats']} interleaved repeats x {setup['steps']} measured steps after "
                  f"{setup['warmup']} warm-up; {setup['rows_per_step']} rows of {setup['row']} tokens per step on "
                  f"{setup['layout']}; documents {setup['lengths']}; the built-in Llama {setup['model']}, "
                  f"{setup['optimizer']}, {setup['dtype']}, one thread per rank. \"padded\" pads each micro-batch "
                  f"to its longest document (transformers' DataCollatorWithPadding), \"padded to the row\" to "
                  f"{setup['row']} (padding=\"max_length\")."]
    return "\n".join(lines)


def attention_table(result: dict) -> str:
    a = result["attention"]
    b, h, s, d = a["shape"]
    return "\n".join([
        "| kernel | forward + backward (ms) | / causal |", "|---|---:|---:|",
        f"| causal attention over the whole row | {a['causal_ms']:.1f} | 1.00 |",
        f"| one causal attention per document (paratrain) | {a['documents_ms']:.1f} | "
        f"{a['documents_vs_causal']:.2f} |",
        f"| element-wise document mask over the row | {a['element_mask_ms']:.1f} | {a['mask_vs_causal']:.2f} |",
        "", f"b={b}, {h} heads of {d}, rows of {s} tokens packed with {', '.join(map(str, a['documents_per_row']))} "
            f"documents, fp32, one thread; the median of the timed repeats."])


def ring_table(result: dict) -> str:
    lines = ["| rows of 2048 | ring core forward + backward (ms) | block parts computed | skipped |",
             "|---|---:|---:|---:|"]
    for name, row in result["ring_cp4"].items():
        parts = ("— (no masks: causality alone)", "—") if name == "one document per row" else \
            (str(row["parts_computed"]), str(row["parts_skipped"]))
        lines.append(f"| {name} | {row['ms']:.1f} | {parts[0]} | {parts[1]} |")
    lines += ["", "cp4 (4 ranks on 2 cores: the times compare the cases, not the hardware); parts counted over "
                  "the 4 ranks per call (each rank: its own block and 3 others)."]
    return "\n".join(lines)


def doc_sections(result: dict) -> dict[str, str]:
    return {"real-data-training": training_table(result),
            "real-data-attention": attention_table(result) + "\n\n" + ring_table(result)}


def write_docs(result: dict) -> None:
    import re

    from benchmarks.suite import write_doc

    page = ROOT / "docs" / "real-data.md"
    text = page.read_text()
    for name, body in doc_sections(result).items():
        text = re.sub(rf"<!-- {name}:begin -->.*?<!-- {name}:end -->",
                      lambda _, n=name, b=body: f"<!-- {n}:begin -->\n{b}\n<!-- {n}:end -->", text, flags=re.S)
    page.write_text(text)
    write_doc("real_data", "\n\n".join(doc_sections(result).values()), COMMAND)


def main() -> None:
    from benchmarks.suite import machine

    if "--table" in sys.argv:  # rebuild the docs from the committed JSON only
        result = json.loads(RESULT.read_text())
    else:
        result = run()
        result["machine"] = machine()
        result["date"] = time.strftime("%Y-%m-%d")
        RESULT.write_text(json.dumps(result, indent=2) + "\n")
    write_docs(result)
    print("\n\n".join(doc_sections(result).values()))


if __name__ == "__main__":
    main()
