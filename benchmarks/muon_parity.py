"""Muon's parity numbers, written to benchmarks/results/muon_parity.json: every layout of
tests/distributed/test_muon.py (the same functions) against torch's Muon + AdamW in one process, with the worst
relative errors of loss, gradient norm and parameters over 4 steps, and what each rank did (matrices
orthogonalized, Muon's collectives). The tests assert <= 1e-5; this records the values.

    python -m benchmarks.muon_parity
"""

from __future__ import annotations

import json
from pathlib import Path

from paratrain.testing import World
from tests.distributed.test_muon import _matrix2, _matrix4, _matrix8

OUT = Path(__file__).resolve().parent / "results" / "muon_parity.json"
KEYS = ("case", "loss_err", "norm_err", "param_err", "where", "ns_matrices", "muon_comm")


def main() -> None:
    rows = []
    for size, fn in ((2, _matrix2), (4, _matrix4), (8, _matrix8)):
        with World(size, timeout_s=900) as world:
            per_rank = world.run(fn)
        for i, first in enumerate(per_rank[0]):
            row = {k: first[k] for k in KEYS if k in first}
            row["ranks"] = size
            row["ns_matrices_per_rank"] = [r[i].get("ns_matrices") for r in per_rank]
            row["muon_comm_per_rank"] = [r[i].get("muon_comm") for r in per_rank]
            row.pop("ns_matrices", None)
            row.pop("muon_comm", None)
            rows.append(row)
    OUT.write_text(json.dumps({"steps": 4, "tolerance": 1e-5, "ns_dtype": "float32", "cases": rows}, indent=1) + "\n")
    for r in rows:
        print(f"{r['case']:<40} loss {r['loss_err']:.1e}  norm {r['norm_err']:.1e}  params {r['param_err']:.1e}")


if __name__ == "__main__":
    main()
