"""Real training data, exact in every layout: masked prompts, right and left padding and packed documents, each
layout against one process that runs every document alone and divides the sum of its token losses by the
number of targets (`tests/real_data.py`).

Every case trains 3 AdamW steps of 8 rows with at least 2 accumulation steps and clipping active (asserted on
the reference), fp32, and must match per step on the loss and the global gradient norm and, at the end, on
every parameter within 1e-5 relative. AdamW's eps is STABLE_EPS for every family (tests/cases.py says why:
gradient elements of ~1e-9, e.g. the token row of the padding id, whose first Adam step would be sign(noise)).
One world runs its whole matrix in one `World.run`; one reference per (model, kind) serves all layouts.
"""

from __future__ import annotations

import functools
import time

import torch.distributed as dist

from paratrain.testing.parity import compare, reference_config, run_layout, summarize
from paratrain.testing.reference import reference_run
from tests.cases import STABLE_EPS, adamw_config, hf_param_groups, import_or_skip, tiny_hf, tiny_llama
from tests.real_data import KINDS, RealRows, documents_loss

import_or_skip("transformers")

STEPS = 3
ROWS = 8  # the global batch
CLIP = 0.5  # below every reference step's gradient norm: clipping is active (asserted)


def real_layout(micro: int, dp: int, tp: int = 1, pp: int = 1, cp: int = 1, zero: int = 0, sp: bool = False,
                schedule: str = "1f1b", cp_method: str = "ring", ulysses: int | None = None, ep: int = 1,
                ckpt: str | None = None, offload: bool = False, offload_param: bool = False) -> dict:
    cfg = adamw_config(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=ROWS // (micro * dp),
                       gradient_clipping=CLIP, data_parallel={"size": dp},
                       tensor_parallel={"size": tp, "sequence_parallel": sp},
                       context_parallel={"size": cp, "method": cp_method,
                                         **({"ulysses_size": ulysses} if ulysses else {})},
                       pipeline={"stages": pp, "schedule": schedule, "partition": "uniform",
                                 "virtual_stages": 2 if schedule in ("zb-v", "dualpipev") else 1},
                       zero_optimization={"stage": zero, "stage3_param_persistence_threshold": 0},
                       expert_parallel={"size": ep})
    cfg["optimizer"]["params"]["eps"] = STABLE_EPS
    if ckpt:
        cfg["activation_checkpointing"] = {"enabled": True, "granularity": ckpt}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if offload_param:  # ZeRO-3: the parameter shards (a frozen base's too) wait on the host between gathers
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    assert cfg["gradient_accumulation_steps"] >= 2
    return cfg


LAYOUTS_4 = {"ddp": real_layout(1, 4), "zero1": real_layout(1, 4, zero=1), "zero3": real_layout(1, 4, zero=3),
             "dp2·tp2 sp": real_layout(2, 2, tp=2, sp=True), "dp2·pp2 1f1b": real_layout(2, 2, pp=2),
             "dp2·pp2 zb-v": real_layout(2, 2, pp=2, schedule="zb-v"), "dp2·cp2 ring": real_layout(2, 2, cp=2),
             "ulysses2": real_layout(2, 2, cp=2, cp_method="ulysses"),
             "usp 2x2": real_layout(2, 1, cp=4, cp_method="usp", ulysses=2)}
THREE = ("ddp", "dp2·cp2 ring", "dp2·pp2 1f1b")
MORE_4 = {"zero2 offload": real_layout(1, 4, zero=2, offload=True),  # the update on the host
          "dp2·cp2 selective": real_layout(2, 2, cp=2, ckpt="selective"),  # recomputed ring attention
          "dp2·pp2 full": real_layout(2, 2, pp=2, ckpt="full")}  # recomputed blocks in a pipeline
WINDOW = 5  # Mistral's sliding window, shorter than the rows of 16

MATRIX_4 = [("llama", kind, name) for kind in KINDS for name in LAYOUTS_4] + \
    [(family, kind, name) for family in ("qwen2", "builtin-llama", "mixtral") for kind in ("masked", "packed")
     for name in THREE] + \
    [("mistral-window", kind, name) for kind in ("masked", "packed") for name in ("ddp", "dp2·tp2 sp",
                                                                                   "dp2·cp2 ring")] + \
    [("llama", "masked", "zero2 offload"), ("llama", "packed", "dp2·cp2 selective"),
     ("llama", "packed", "dp2·pp2 full"), ("qwen2-alternating", "packed", "ddp"),
     ("qwen2-alternating", "packed", "dp2·cp2 ring")]
MATRIX_8 = [("llama", kind, "dp2·pp2·tp2") for kind in KINDS]
LAYOUTS_8 = {"dp2·pp2·tp2": real_layout(2, 2, pp=2, tp=2)}


def model_factory(family: str):
    if family == "builtin-llama":
        return tiny_llama
    if family == "mistral-window":
        return functools.partial(tiny_hf, "mistral", sliding_window=WINDOW)
    if family == "qwen2-alternating":  # layer 0 full attention, layer 1 a sliding window
        return functools.partial(tiny_hf, "qwen2", use_sliding_window=True, sliding_window=WINDOW,
                                 max_window_layers=1)
    return functools.partial(tiny_hf, family)


def config_of(family: str, name: str) -> dict:
    cfg = {**LAYOUTS_4, **MORE_4, **LAYOUTS_8}[name]
    if family == "mixtral":  # experts split over 2 of the data x context-parallel ranks
        cfg = {**cfg, "expert_parallel": {"size": 2}}
    return cfg


def _run(matrix: list[tuple[str, str, str]]) -> list:
    runs = []
    for family, kind, name in matrix:
        start = time.perf_counter()
        run = run_layout(config_of(family, name), model_factory(family), RealRows(kind), STEPS,
                         keep_state=dist.get_rank() == 0, model_parameters=hf_param_groups)
        run.extra["seconds"] = time.perf_counter() - start
        runs.append(run)
    return runs


def _check(per_rank: list[list], matrix: list[tuple[str, str, str]]) -> list[str]:
    refs, lines = {}, []
    for i, (family, kind, name) in enumerate(matrix):
        run = per_rank[0][i]
        assert run.train_batch_size == ROWS, (family, kind, name)
        if (family, kind) not in refs:
            refs[(family, kind)] = reference_run(model_factory(family), reference_config(config_of(family, name), run),
                                                 RealRows(kind), STEPS, loss_of=documents_loss,
                                                 param_groups=hf_param_groups)
            assert all(norm > CLIP for norm in refs[(family, kind)].grad_norms), (family, kind)  # clipping active
        summary = summarize(compare(run, refs[(family, kind)]))
        assert summary["passed"], (family, kind, name, run.case, summary)
        assert all(other[i].losses == run.losses for other in per_rank[1:]), (family, kind, name)
        lines.append(f"{family} {kind} {run.case}: loss {summary['loss_err']:.1e} norm {summary['norm_err']:.1e} "
                     f"param {summary['param_err']:.1e} ({run.extra['seconds']:.1f}s)")
    return lines


def test_real_data_matrix_4_ranks(world4):
    lines = _check(world4.run(_run, MATRIX_4), MATRIX_4)
    print("\n".join(lines))
    assert len(lines) == len(MATRIX_4) == 65


def test_real_data_dp2_pp2_tp2_8_ranks(world8):
    lines = _check(world8.run(_run, MATRIX_8), MATRIX_8)
    print("\n".join(lines))
