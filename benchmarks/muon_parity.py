"""Muon's parity numbers, written to benchmarks/results/muon_parity.json: every layout of
tests/distributed/test_muon.py (the same functions) against torch's Muon + AdamW in one process, with the worst
relative errors of loss, gradient norm and parameters over 4 steps, and what each rank did (matrices
orthogonalized, Muon's collectives). The tests assert <= 1e-5; this records the values. Beside them ("other"):
DeepSpeed-style groups, masked rows, bf16 against one process in bf16 (and one process in fp32's distance from
that) and torch's own bfloat16 iteration against torch.optim.Muon, which the tests hold to looser bounds.

    python -m benchmarks.muon_parity
"""

from __future__ import annotations

import json
from pathlib import Path

from paratrain.testing import World
from tests.distributed.test_muon import _groups_and_bf16, _matrix2, _matrix4, _matrix8

OUT = Path(__file__).resolve().parent / "results" / "muon_parity.json"
KEYS = ("case", "loss_err", "norm_err", "param_err", "where", "ns_matrices", "muon_comm")
OTHER_KEYS = ("case", "loss_err", "norm_err", "param_err", "fp32_loss_err", "fp32_param_err")


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
    with World(2, timeout_s=900) as world:
        other = [{k: r[k] for k in OTHER_KEYS if k in r} for r in world.run(_groups_and_bf16)[0]]
    OUT.write_text(json.dumps({"steps": 4, "tolerance": 1e-5, "ns_dtype": "float32", "cases": rows, "other": other},
                              indent=1) + "\n")
    for r in rows + other:
        print(f"{r['case']:<40} loss {r['loss_err']:.1e}  norm {r['norm_err']:.1e}  params {r['param_err']:.1e}")


if __name__ == "__main__":
    main()
