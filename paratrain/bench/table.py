"""The markdown table of a bench run, and writing it between markers into a document (docs/strategies.md)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from paratrain.bench.cases import GLOBAL_BATCH, MODELS
from paratrain.errors import InvalidValueError

BEGIN, END = "<!-- paratrain bench: begin -->", "<!-- paratrain bench: end -->"
MIB = 2**20


def _mib(n: float) -> str:
    return f"{n / MIB:.2f} MiB"


def _state(row: dict) -> str:
    values, psi = row["state_per_rank"], row["params"]
    low, high = min(values), max(values)
    text = _mib(low) if low == high else f"{_mib(low)} – {_mib(high)}"
    per_param = f"{low / psi:.2f}" if low == high else f"{low / psi:.2f} – {high / psi:.2f}"
    return f"{text} ({per_param} B/Ψ)"


def _comm(row: dict) -> str:
    if not row["comm_per_step"]:
        return "none"
    psi = row["params"]
    return "<br>".join(f"{axis}: {_mib(b)} ({b / 4 / psi:.2f} Ψ)" for axis, b in sorted(row["comm_per_step"].items()))


def _loss(row: dict) -> str:
    losses = row["losses"]
    return f"{losses[0]:.4f} → {losses[-1]:.4f}"


def markdown(rows: list[dict], command: str, nproc: int, model: str, steps: int) -> str:
    psi = rows[0]["params"] if rows else 0
    m = MODELS[model]
    load = f", load average {os.getloadavg()[0]:.1f} at the start" if hasattr(os, "getloadavg") else ""
    lines = [
        f"Measured by `{command}`: the {model} GPT (Ψ = {psi:,} parameters, {m['n_layer']} layers, d = "
        f"{m['d_model']}), one global batch of {GLOBAL_BATCH} sequences × {m['seq_len']} tokens per optimizer "
        f"step, fp32 AdamW, N = {nproc} ranks, on {platform.machine()} with {os.cpu_count()} CPU cores{load}.",
        "Model state and communication are counted, so they are exact and the same on any machine: model state "
        "is `engine.memory_stats()` (parameters + gradients + optimizer state, B/Ψ = bytes per parameter), "
        "communication the payload of the collectives a rank takes part in per optimizer step "
        "(`engine.comm_stats()`, the largest rank per axis, the 4-byte loss report left out; Ψ = that many fp32 "
        "elements). Payload is the logical tensor: an all-reduce of Ψ counts Ψ, though a ring moves about "
        "2Ψ(N−1)/N per rank, while an all-gather or a reduce-scatter of Ψ counts Ψ and moves Ψ(N−1)/N — so "
        "ZeRO-1/2's 2Ψ is DDP's wire traffic, ZeRO-3's 3Ψ is 1.5× it, and SP's all-gathers + reduce-scatters "
        "are TP's all-reduces; point-to-point messages count once sent and once received. "
        "Step time (median of the slowest rank) and peak RSS (largest process) are measured: on a "
        "shared CPU machine they are noisy, so rerun the command on yours. Every row starts from the same "
        "weights and trains on the same batches: the loss column agrees to rounding.",
        "",
        "| strategy | layout | model state per rank | formula | communication per step (per rank) | formula | "
        "step time | peak RSS | loss, step 1 → last |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['strategy']} | {row['layout']} | {_state(row)} | {row['memory_formula']} | "
                     f"{_comm(row)} | {row['comm_formula']} | {row['step_s'] * 1000:.0f} ms | "
                     f"{row['peak_rss'] / MIB:.0f} MiB | {_loss(row)} |")
    return "\n".join(lines)


def write_between_markers(path: str | Path, text: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace what lies between `begin` and `end` (the strategies table's markers by default) in `path` with
    `text`."""
    path = Path(path)
    doc = path.read_text()
    if begin not in doc or end not in doc or doc.index(begin) > doc.index(end):
        raise InvalidValueError(f"{path} has no '{begin}' ... '{end}' block to write the table into; add the two lines "
                                f"where it belongs")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")
