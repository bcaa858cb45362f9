"""LoRA and DoRA, exact in every layout: a peft model as it comes against the same peft model in one process.

peft's LoRA and DoRA on every linear layer of a transformers Llama (grouped-query attention) and Qwen2 (q/k/v
biases in the frozen base) train 3 AdamW steps on rows with masked prompts (and packed documents in a few
layouts), fp32, clipping active (asserted on the reference), with no plan written: DDP, ZeRO-1/2/3, ZeRO-3 with
optimizer and parameter offload (the frozen base's shards on the host, asserted), and with the model built on
the meta device and its base loaded from a Hugging Face directory (the adapters then start as paratrain draws
them), tp2 with and without sequence parallelism, dp2·tp2 ZeRO-3 SP, pp2 (1F1B, ZB-H1), cp2 (ring, Ulysses) on
4 ranks, dp2·pp2·tp2 on 8. Per step the loss and the global gradient norm (what sees a wrongly weighted loss)
and at the end every adapter and base tensor must be within 1e-5 of the reference, which runs each document
alone through peft's own layers (`tests/real_data.py`). paratrain's own `peft` section is checked the same way
on its built-in Llama (LoRA, DoRA, LoRA under Muon), GPT and MoE (LoRA on every expert, ep2 with ZeRO and tp).
"""

from __future__ import annotations

import functools
import time

import torch.distributed as dist

from paratrain.testing.parity import compare, reference_config, run_layout, summarize
from paratrain.testing.reference import reference_run
from tests.cases import STABLE_EPS, import_or_skip, tiny_hf
from tests.distributed.test_real_data import ROWS, STEPS, real_layout
from tests.peft_cases import SECTIONS, peft_hf, section_model
from tests.real_data import RealRows, documents_loss

import_or_skip("peft")

CLIP = 0.05  # below every reference step's gradient norm (asserted): clipping is active

LAYOUTS_4 = {"ddp": real_layout(1, 4), "zero1": real_layout(1, 4, zero=1), "zero2": real_layout(1, 4, zero=2),
             "zero3": real_layout(1, 4, zero=3),
             "zero3 offload": real_layout(1, 4, zero=3, offload=True, offload_param=True),
             "zero3 meta": real_layout(1, 4, zero=3), "tp2": real_layout(2, 2, tp=2),
             "tp2 sp": real_layout(2, 2, tp=2, sp=True), "dp2·tp2 zero3 sp": real_layout(2, 2, tp=2, sp=True, zero=3),
             "pp2 1f1b": real_layout(2, 2, pp=2), "pp2 zb-h1": real_layout(2, 2, pp=2, schedule="zb-h1"),
             "cp2 ring": real_layout(2, 2, cp=2), "cp2 ulysses": real_layout(2, 2, cp=2, cp_method="ulysses")}
LAYOUTS_8 = {"dp2·pp2·tp2": real_layout(2, 2, pp=2, tp=2)}
MODELS = [("llama", "lora"), ("llama", "dora"), ("qwen2", "lora"), ("qwen2", "dora")]
PACKED = ("ddp", "tp2 sp", "pp2 1f1b", "cp2 ring")  # also on packed documents (llama LoRA)
MATRIX_4 = [(family, method, "masked", name) for family, method in MODELS for name in LAYOUTS_4] + \
    [("llama", "lora", "packed", name) for name in PACKED]
MATRIX_8 = [(family, method, "masked", "dp2·pp2·tp2") for family, method in MODELS]
# paratrain's `peft` section on its own Llama and MoE (no peft package): "section" as the family
SECTION_4 = [("section", "llama lora", "masked", name) for name in ("ddp", "zero3", "tp2 sp", "pp2 zb-h1")] + \
    [("section", "llama dora", "packed", name) for name in ("zero2", "dp2·tp2 zero3 sp", "cp2 ring")] + \
    [("section", "moe experts", "masked", name) for name in ("ep2", "ep2 zero1", "ep2 zero3", "tp2 ep2")] + \
    [("section", "gpt lora", "packed", name) for name in ("zero3", "tp2 sp")] + \
    [("section", "llama lora muon", "masked", name) for name in ("ddp", "dp2·tp2 zero3 sp", "pp2 1f1b")]
MUON = {"type": "Muon", "params": {"lr": 0.02, "weight_decay": 0.05, "ns_dtype": "float32",
                                   "adamw": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": STABLE_EPS}}}
LAYOUTS_4.update({"ep2": real_layout(1, 4, ep=2), "ep2 zero1": real_layout(1, 4, ep=2, zero=1),
                  "ep2 zero3": real_layout(1, 4, ep=2, zero=3), "tp2 ep2": real_layout(2, 2, tp=2, ep=2)})


def config_of(name: str, weights: str | None = None) -> dict:
    cfg = {**{**LAYOUTS_4, **LAYOUTS_8}[name], "gradient_clipping": CLIP}
    if name.endswith("meta"):  # the base from a model directory, the adapters from their names
        cfg["checkpoint"] = {"load_weights": weights}
    return cfg


def base_directories(root) -> dict[str, str]:
    """Each family's base model saved as transformers saves it (what `load_weights` of a meta model reads)."""
    out = {}
    for family in {family for family, _ in MODELS}:
        tiny_hf(family).save_pretrained(root / family)
        out[family] = str(root / family)
    return out


def factory(family: str, method: str, name: str, reference: bool = False):
    if family == "section":
        return functools.partial(section_model, method, reference)
    return functools.partial(peft_hf, family, method, meta=name.endswith("meta"), reference=reference)


def run_config(family: str, method: str, name: str, weights: dict[str, str]) -> dict:
    cfg = config_of(name, weights.get(family))
    if method.endswith("muon"):
        cfg["optimizer"] = MUON
    return {**cfg, "peft": SECTIONS[method]} if family == "section" else cfg


def _run(matrix: list[tuple[str, str, str, str]], weights: dict[str, str]) -> list:
    runs = []
    for family, method, kind, name in matrix:
        start = time.perf_counter()
        run = run_layout(run_config(family, method, name, weights), factory(family, method, name), RealRows(kind),
                         STEPS, keep_state=dist.get_rank() == 0, inspect=_placement)
        run.extra["seconds"] = time.perf_counter() - start
        runs.append(run)
    return runs


def _placement(engine) -> dict:
    """Under ZeRO: the offload policy, the devices of the frozen base's shards, and the model-state bytes."""
    sync = engine.grad_sync
    if not (hasattr(sync, "frozen_segments") and hasattr(sync, "offload")):  # DDP, tp, pp: nothing to offload
        return {}
    return {"offload_param": sync.offload.offload_param, "host": sync.offload.host,
            "frozen_devices": {shard.device for shard, _ in sync.frozen_segments()}, "memory": engine.memory_stats()}


def _frozen_shards_on_the_host(extra: dict) -> None:
    """offload_param: every frozen shard lives on the host, and the memory statistics count it there. (On this
    CPU-only machine host and device are one memory; tests/unit/test_zero_offload.py tells them apart with a
    stand-in device, tests/unit/test_gpu_path.py on CUDA.)"""
    memory = extra["memory"]
    assert extra["offload_param"] and extra["frozen_devices"] == {extra["host"]}, extra
    assert memory["frozen_params"] > 0 and memory["host"] >= memory["frozen_params"], memory
    assert memory["device"] == memory["total"] - memory["host"], memory


def compared(per_rank: list[list], matrix: list[tuple[str, str, str, str]]) -> list[dict]:
    """Each case of `matrix` against its one-process reference (one per model, kind and start): the worst
    errors over the steps (`summarize`), whether every rank saw the same losses, and the case in words."""
    refs, out = {}, []
    for i, (family, method, kind, name) in enumerate(matrix):
        run = per_rank[0][i]
        assert run.train_batch_size == ROWS, (family, method, name)
        key = (family, method, kind, name.endswith("meta"))
        if key not in refs:
            refs[key] = reference_run(factory(family, method, name, reference=True),
                                      reference_config(run_config(family, method, name, {}), run), RealRows(kind),
                                      STEPS, loss_of=documents_loss, keep_states=method == "moe experts")
            assert all(norm > CLIP for norm in refs[key].grad_norms), (key, refs[key].grad_norms)
        summary = summarize(compare(run, refs[key]))
        if method == "moe experts":
            _every_expert_trained(run.final_state, refs[key].state)
        if name == "zero3 offload":
            for ranks in per_rank:
                _frozen_shards_on_the_host(ranks[i].extra)
        out.append({"case": f"{family} {method} {kind} {name}", "layout": run.case, **summary,
                    "same_on_every_rank": all(other[i].losses == run.losses for other in per_rank[1:]),
                    "seconds": run.extra["seconds"]})
    return out


def _check(per_rank: list[list], matrix: list[tuple[str, str, str, str]]) -> list[str]:
    lines = []
    for row in compared(per_rank, matrix):
        assert row["passed"] and row["same_on_every_rank"], row
        lines.append(f"{row['case']} ({row['layout']}): loss {row['loss_err']:.1e} norm {row['norm_err']:.1e} "
                     f"param {row['param_err']:.1e} ({row['seconds']:.1f}s)")
    return lines


def _every_expert_trained(state: dict, reference: dict) -> None:
    """Each routed expert's adapter got its gradient: its B (zero at the start) moved, and matches one process's
    expert by expert (a whole-stack error could hide one expert left untrained)."""
    stacks = [k for k in reference if ".adapters." in k and ".lora_B." in k]
    assert stacks
    for key in stacks:
        for e, (got, want) in enumerate(zip(state[key], reference[key])):
            assert want.abs().max() > 0 and float((got - want).norm() / want.norm()) <= 1e-5, (key, e)


def test_peft_lora_and_dora_in_every_layout_4_ranks(world4, tmp_path):
    lines = _check(world4.run(_run, MATRIX_4, base_directories(tmp_path)), MATRIX_4)
    print("\n".join(lines))
    assert len(lines) == len(MATRIX_4) == 56


def test_the_peft_section_on_paratrains_llama_and_moe_experts_4_ranks(world4):
    lines = _check(world4.run(_run, SECTION_4, {}), SECTION_4)
    print("\n".join(lines))
    assert len(lines) == len(SECTION_4)


def test_peft_lora_and_dora_dp2_pp2_tp2_8_ranks(world8):
    lines = _check(world8.run(_run, MATRIX_8, {}), MATRIX_8)
    print("\n".join(lines))
