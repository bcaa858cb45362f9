"""Real data on the CPU: packed against padded rows, document-masked attention against plain causal attention,
and ring attention with packed documents.

    python -m benchmarks.real_data            # writes benchmarks/results/real_data.json and the docs tables

1. Packed vs padded: documents cut from the embedded corpus with log-normal lengths (median a quarter of the
   row, sigma 1, 8..row tokens: a long tail like SFT data), trained as 8 rows per step either packed back to
   back (best fit, `paratrain.data.packing`) or one per row padded to the longest of its micro-batch (dynamic
   padding, transformers' DataCollatorWithPadding: the padded side at its best). Both through
   `engine.train_batch` on dp2 (2 ranks, one thread each), the same Llama, AdamW and seed, alternating A B A B.
   Reported: real target tokens per second and the padding fraction of the rows.
2. Attention cost: one attention core (forward + backward, b=4, 8 heads of 64, one thread) on packed rows,
   against causal attention over the same rows: per-document causal SDPA (what paratrain runs), and the
   element-wise mask over the whole row (what a window or scattered ids need). Target: documents <= 1.2x causal.
3. Ring attention at cp2 on packed rows against the same rows unpacked: the core's forward + backward time and
   the block parts skipped (nothing to attend).
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
        out.append(train[at:at + n].clone())
        at += n
    return out


def micro_batches(kind: str, docs: list[torch.Tensor], micro: int) -> list[dict]:
    from paratrain.data.packing import pack, packed_batch, padded_batch

    if kind == "padded":
        return [padded_batch(docs[i:i + micro]) for i in range(0, len(docs) - micro + 1, micro)]
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
    docs = documents(4000, ROW)
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


def ring_case(packed: bool, repeats: int = 5) -> dict:
    """cp2: the ring attention core alone on rows of 2048 (packed documents, or one document per row)."""
    import torch.distributed as dist

    from paratrain.attention import Documents
    from paratrain.comm import build_mesh
    from paratrain.context_parallel.ring_attention import RingAttentionCore
    from paratrain.mesh import ParallelDims

    mesh = build_mesh(ParallelDims(dist.get_world_size(), dp=1, cp=dist.get_world_size()))
    b, h, d, s = 2, 8, 64, 2048
    docs = None
    if packed:
        ids, doc, lengths = [], 0, iter(document_lengths(200, s, seed=2))
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


def run(repeats: int = 3, steps: int = 8, warmup: int = 2) -> dict:
    from paratrain.testing import World

    runs: dict[str, list] = {"packed": [], "padded": []}
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
    training["packed_vs_padded"] = round(training["packed"]["target_tokens_per_s"] /
                                         training["padded"]["target_tokens_per_s"], 3)
    ring = {}
    for packed in (False, True):
        with World(2, timeout_s=900) as world:
            ring["packed" if packed else "unpacked"] = world.run(ring_case, packed)[0]
    return {"command": COMMAND, "setup": {"model": MODEL, "row": ROW, "rows_per_step": ROWS_PER_STEP,
                                          "lengths": f"log-normal, median row/4, sigma {SIGMA}, 8..row",
                                          "optimizer": "AdamW fused", "threads_per_rank": 1, "dtype": "float32",
                                          "seed": SEED, "layout": "dp2 (2 ranks)", "steps": steps,
                                          "warmup": warmup, "repeats": repeats},
            "training": training, "attention": attention_costs(), "ring_cp2": ring}


def main() -> None:
    from benchmarks.suite import machine

    result = run()
    result["machine"] = machine()
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
