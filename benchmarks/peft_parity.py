"""The adapters' parity numbers, written to benchmarks/results/peft_parity.json: every case of
tests/distributed/test_peft_parity.py (the same functions: peft models as they come and paratrain's `peft`
section, LoRA and DoRA, in every layout) against one process, with the worst relative errors of the loss and the
gradient norm per step and of every tensor at the end, over 3 steps. The tests assert <= 1e-5; this records the
values.

    python -m benchmarks.peft_parity
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from paratrain.testing import World
from tests.distributed.test_peft_parity import MATRIX_4, MATRIX_8, SECTION_4, _run, base_directories, compared

OUT = Path(__file__).resolve().parent / "results" / "peft_parity.json"
KEYS = ("case", "layout", "loss_err", "norm_err", "param_err", "where", "passed", "same_on_every_rank")


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp, World(4, timeout_s=900) as world:
        weights = base_directories(Path(tmp))
        for matrix in (MATRIX_4, SECTION_4):
            rows += compared(world.run(_run, matrix, weights), matrix)
    with World(8, timeout_s=900) as world:
        rows += compared(world.run(_run, MATRIX_8, {}), MATRIX_8)
    rows = [{k: r[k] for k in KEYS} for r in rows]
    OUT.write_text(json.dumps({"steps": 3, "tolerance": 1e-5, "cases": rows}, indent=1) + "\n")
    for r in rows:
        print(f"{r['case']:<45} {r['layout']:<28} loss {r['loss_err']:.1e}  norm {r['norm_err']:.1e}  "
              f"params {r['param_err']:.1e}")
    print(f"worst: loss {max(r['loss_err'] for r in rows):.1e}, norm {max(r['norm_err'] for r in rows):.1e}, "
          f"params {max(r['param_err'] for r in rows):.1e} over {len(rows)} cases")


if __name__ == "__main__":
    main()
