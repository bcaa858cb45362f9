"""The V schedules against 1F1B and ZB-H1: ZB-V and DualPipeV at p = 2 and 4, on the pipeline suite's GPT,
split, data and AdamW + clipping (`benchmarks/pp.py`), m = 2p micro-batches of 2 sequences per step for
every schedule at a given p.

ZB-V and DualPipeV put two chunks on every rank (stages r and 2p - 1 - r), so the model is cut into 2p
chunks (parameter counts balanced per rank: chunk r plus chunk 2p - 1 - r, `parallel/pp/v_partition.py`) where
1F1B and ZB-H1 cut it into p stages. Each case reports each rank's measured bubble in the last step and the
unit-slot bubble of its schedule; with PARATRAIN_BENCH_TIMELINES set to a directory rank 0 also writes the
step's timeline there, which `paratrain report DIR/<schedule>_p<p>` draws. Two more cases run 1F1B and ZB-H1
at p = 2 with tensor parallelism 2 (4 ranks): ZB-H1 then defers the tensor-parallel layers' weight gradients
to W (`paratrain/weight_grad.py`). On a CPU shared by more processes than cores a waiting rank's core goes to
someone else, so the bubble shows in the step time only when every rank has a core of its own.
"""

from __future__ import annotations

from functools import partial

from benchmarks.pp import paratrain_pp

CASES: dict = {}
PEERS: dict = {}
for _p in (2, 4):
    for _name, _label, _v in [("1f1b", "1F1B", 1), ("zb-h1", "ZB-H1", 1), ("zb-v", "ZB-V", 2),
                              ("dualpipev", "DualPipeV", 2)]:
        CASES[f"paratrain {_label} p{_p}"] = (partial(paratrain_pp, schedule=_name, virtual=_v), _p)
    for _label in ("ZB-V", "DualPipeV"):
        PEERS[f"paratrain {_label} p{_p}"] = [f"paratrain 1F1B p{_p}", f"paratrain ZB-H1 p{_p}"]
for _name, _label in [("1f1b", "1F1B"), ("zb-h1", "ZB-H1")]:  # the W-split with tensor-parallel layers
    CASES[f"paratrain {_label} p2 tp2"] = (partial(paratrain_pp, schedule=_name, tp=2), 4)
PEERS["paratrain ZB-H1 p2 tp2"] = ["paratrain 1F1B p2 tp2"]
BASELINE = "paratrain 1F1B p2"
