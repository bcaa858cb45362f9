"""Objectives beyond next-token loss, exact in every layout: DPO and GRPO's policy loss against one process.

DPO (sigmoid, ipo, hinge) trains full fine-tuning with the initial model as the reference (a frozen copy placed like
the model) and LoRA with the adapters off as the reference; GRPO's loss (dapo, grpo, dr_grpo; beta 0 and 0.04 with
the initial model as the reference) trains three updates on the same rollouts, so the ratio leaves 1 and the clip
acts (asserted on the reference). fp32, clipping active, pairs and completions of different lengths padded to 16
positions. Per step the loss and the global gradient norm, and at the end every tensor, must be within 1e-5 of the
one-process reference of `tests/objective_cases.py`, which runs every row's real tokens alone with TRL's formulas.
Layouts: DDP, ZeRO-1/2/3, tp2 with and without SP, pp2 (1F1B, ZB-H1), cp2 (ring, Ulysses), dp2·tp2 ZeRO-3 and ep2
on an MoE on 4 ranks; dp2·pp2·tp2 on 8. `engine.evaluate` on held-out pairs (the ranks' shares padded) gives one
process's DPO loss and metrics in DDP, pp2 and cp2.
"""

from __future__ import annotations

import functools

import torch.distributed as dist

from paratrain.testing.parity import compare, reference_config, run_layout, summarize
from paratrain.testing.reference import reference_run
from tests.cases import tiny_llama
from tests.distributed.test_real_data import STEPS, real_layout
from tests.objective_cases import (
    Completions,
    PreferencePairs,
    SequenceMeanNLL,
    completion_collator,
    dpo_loss,
    dpo_metrics,
    frozen,
    grpo_loss,
    preference_collator,
    sequence_mean_nll,
)
from tests.real_data import RealRows

# below every reference step's gradient norm (asserted): clipping acts
CLIP = {"dpo": 0.05, "grpo": 0.005, "custom": 0.05}
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"]}
LAYOUTS_4 = {"ddp": real_layout(1, 4), "zero1": real_layout(1, 4, zero=1), "zero2": real_layout(1, 4, zero=2),
             "zero3": real_layout(1, 4, zero=3), "tp2": real_layout(2, 2, tp=2),
             "tp2 sp": real_layout(2, 2, tp=2, sp=True), "pp2 1f1b": real_layout(2, 2, pp=2),
             "pp2 zb-h1": real_layout(2, 2, pp=2, schedule="zb-h1"), "cp2 ring": real_layout(2, 2, cp=2),
             "cp2 ulysses": real_layout(2, 2, cp=2, cp_method="ulysses"),
             "dp2·tp2 zero3": real_layout(2, 2, tp=2, zero=3)}
LAYOUTS_EP = {"ep2": real_layout(1, 4, ep=2), "ep2 zero3": real_layout(1, 4, ep=2, zero=3)}  # on the MoE
LAYOUTS_8 = {"dp2·pp2·tp2": real_layout(2, 2, pp=2, tp=2)}
DPO_TYPES = ("sigmoid", "ipo", "hinge")


def dpo_matrix(layouts) -> list[tuple]:
    """(objective, mode, loss type, layout): each layout with full fine-tuning and LoRA, the loss types in turn."""
    out = []
    for i, name in enumerate(layouts):
        out.append(("dpo", "full", DPO_TYPES[i % 3], 0.0, name))
        out.append(("dpo", "lora", DPO_TYPES[(i + 1) % 3], 0.0, name))
    return out


def grpo_matrix(layouts) -> list[tuple]:
    kinds = [("dapo", 0.0), ("grpo", 0.04), ("dr_grpo", 0.0), ("dapo", 0.04), ("grpo", 0.0), ("dr_grpo", 0.04)]
    return [("grpo", "full", *kinds[i % len(kinds)], name) for i, name in enumerate(layouts)]


# a user's own objective (initialize(objective=...)): a per-sequence mean, on rows with masked prompts
# the reference's log-probs precomputed (in one process) and carried by the batch: the same run as in the step
PRECOMPUTED = [("dpo", "precomputed", "sigmoid", 0.0, name) for name in ("tp2", "cp2 ulysses")]
CUSTOM = [("custom", "full", "masked", 0.0, name) for name in ("zero3", "tp2 sp", "pp2 zb-h1", "cp2 ring")]
MATRIX_4 = dpo_matrix(LAYOUTS_4) + grpo_matrix(LAYOUTS_4) + CUSTOM + PRECOMPUTED + \
    [("dpo", "full", "sigmoid", 0.0, "ep2"), ("grpo", "full", "grpo", 0.04, "ep2 zero3")]
MATRIX_8 = dpo_matrix(LAYOUTS_8) + grpo_matrix(LAYOUTS_8)


def objective_section(kind: str, loss_type: str, beta: float) -> dict:
    if kind == "custom":
        return {}
    if kind == "dpo":
        return {"type": "dpo", "loss_type": loss_type, "beta": 0.1}
    return {"type": "grpo", "loss_type": loss_type, "beta": beta, "epsilon": 0.2, "epsilon_high": 0.28,
            "max_completion_length": 8}


def case_config(case: tuple) -> dict:
    kind, mode, loss_type, beta, name = case
    cfg = {**{**LAYOUTS_4, **LAYOUTS_EP, **LAYOUTS_8}[name], "gradient_clipping": CLIP[kind],
           "objective": objective_section(kind, loss_type, beta)}
    if mode == "lora":
        cfg["peft"] = LORA
    if mode == "precomputed":
        cfg["objective"]["reference"] = "batch"
    return cfg


def model_of(name: str):
    """The built-in Llama (grouped-query attention), or for the ep layouts its Mixtral-like MoE (router losses
    off: the reference's objective is the policy loss alone)."""
    if not name.startswith("ep"):
        return tiny_llama
    return tiny_moe


def tiny_moe():
    import torch

    from paratrain.models.registry import build_model

    torch.manual_seed(1)
    return build_model("mixtral-tiny", seq_len=16, vocab_size=256, aux_loss_coef=0.0, z_loss_coef=0.0)


def dataset_of(kind: str, name: str, mode: str = "full"):
    if kind == "custom":
        return RealRows("masked")
    if kind == "dpo":
        return PreferencePairs(reference=frozen(model_of(name)()) if mode == "precomputed" else None)
    return Completions(model_of(name)())


def collator_of(kind: str):
    return {"dpo": preference_collator, "grpo": completion_collator}.get(kind, lambda: None)()


def _run(matrix: list[tuple]) -> list:
    runs = []
    for case in matrix:
        kind = case[0]
        runs.append(run_layout(case_config(case), model_of(case[4]), dataset_of(kind, case[4], case[1]), STEPS,
                               keep_state=dist.get_rank() == 0, collate_fn=collator_of(kind),
                               objective=SequenceMeanNLL() if kind == "custom" else None))
    return runs


def reference_of(case: tuple, run):
    kind, mode, loss_type, beta, name = case
    initial = frozen(model_of(name)())
    if kind == "dpo":
        loss = functools.partial(_dpo_reference, initial=initial, loss_type=loss_type)
    elif kind == "grpo":
        loss = functools.partial(grpo_loss, loss_type=loss_type, beta=beta, epsilon=(0.2, 0.28),
                                 reference=initial if beta else None)
    else:
        loss = sequence_mean_nll
    make = functools.partial(_lora_llama, LORA) if mode == "lora" else model_of(name)
    cfg = reference_config({k: v for k, v in case_config(case).items() if k not in ("objective", "peft")}, run)
    return reference_run(make, cfg, dataset_of(kind, name, mode), STEPS, loss_of=loss, collate_fn=collator_of(kind))


def _dpo_reference(model, batch, initial, loss_type):
    return dpo_loss(model, initial, batch, loss_type)


def _lora_llama(section: dict):
    """The built-in Llama with the section's adapters put in as the engine puts them in (same seed)."""
    from tests.peft_cases import section_model

    assert section == LORA
    return section_model("llama lora", reference=True)


def _check(per_rank: list[list], matrix: list[tuple]) -> list[str]:
    lines = []
    for i, case in enumerate(matrix):
        run = per_rank[0][i]
        ref = reference_of(case, run)
        assert all(norm > CLIP[case[0]] for norm in ref.grad_norms), (case, ref.grad_norms)
        summary = summarize(compare(run, ref))
        same = all(other[i].losses == run.losses for other in per_rank[1:])
        assert summary["passed"] and same, (case, run.case, summary, run.losses, ref.losses)
        lines.append(f"{' '.join(map(str, case))} ({run.case}): loss {summary['loss_err']:.1e} norm "
                     f"{summary['norm_err']:.1e} param {summary['param_err']:.1e}")
    return lines


def test_dpo_and_grpo_in_every_layout_4_ranks(world4):
    lines = _check(world4.run(_run, MATRIX_4), MATRIX_4)
    print("\n".join(lines))
    assert len(lines) == len(MATRIX_4)


def test_dpo_and_grpo_dp2_pp2_tp2_8_ranks(world8):
    lines = _check(world8.run(_run, MATRIX_8), MATRIX_8)
    print("\n".join(lines))
    assert len(lines) == len(MATRIX_8)


def _forward_outputs() -> dict:
    """engine(input_ids=...) without targets: the whole vocabulary under tp2 (equal to one process's logits, the
    gradient of a loss over them equal too); refused by name under cp2."""
    import torch

    from paratrain.api import initialize
    from paratrain.errors import RunError

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    one = tiny_llama()
    want = one(ids)
    want.logsumexp(-1).sum().backward()
    engine, *_ = initialize(model=tiny_llama(), config={**real_layout(2, 2, tp=2), "train_batch_size": 8})
    got = engine(input_ids=ids)
    got.logsumexp(-1).sum().backward()
    head = engine.module.lm_head.weight  # this rank's rows of the vocabulary
    rows = want.shape[-1] // 2
    start = engine.mesh.local_rank("tp") * rows
    out = {"shape": tuple(got.shape), "logits": float((got - want).detach().abs().max()),
           "head_grad": float((head.grad - one.lm_head.weight.grad[start:start + rows]).abs().max())}
    engine.destroy()
    engine, *_ = initialize(model=tiny_llama(), config={**real_layout(2, 2, cp=2), "train_batch_size": 8})
    try:
        engine(input_ids=ids)
        out["cp"] = "returned"
    except RunError as exc:
        out["cp"] = str(exc)
    engine.destroy()
    return out


def test_forward_without_targets_returns_whole_logits_or_refuses_4_ranks(world4):
    for out in world4.run(_forward_outputs):
        assert out["shape"] == (2, 16, 256) and out["logits"] < 1e-5 and out["head_grad"] < 1e-5, out
        assert "under context parallelism would return this rank's chunk of the sequence" in out["cp"], out


def _reference_memory() -> dict:
    """memory_stats() of a DPO engine: the initial reference under ZeRO-3 holds this rank's shard of every weight,
    as the policy's own parameters do; with the adapters off it holds nothing. Next to each, the planner's
    `reference_bytes` for the same layout and this rank's pipeline stage (ZeRO-1 whole, tp-split, pipeline
    stages too)."""
    from paratrain.api import initialize

    out = {}
    for mode, name in (("full", "zero3"), ("lora", "zero3"), ("full", "zero1"), ("full", "dp2·tp2 zero3"),
                       ("full", "pp2 1f1b")):
        cfg = case_config(("dpo", mode, "sigmoid", 0.0, name))
        engine, *_ = initialize(model=tiny_llama(), config=cfg, training_data=PreferencePairs(),
                                collate_fn=preference_collator())
        if name == "zero3":
            engine.train_batch()
        stats = engine.memory_stats()
        out[(mode, name)] = {"reference": stats["reference_params"],
                             "policy": stats["params"] - stats["reference_params"],
                             "planner": _planned_reference(cfg, engine.mesh.local_rank("pp"))}
        engine.destroy()
    out["psi"] = sum(p.numel() for p in tiny_llama().parameters())
    return out


def _planned_reference(cfg: dict, stage: int) -> int:
    """The planner's bytes of the reference copy on a rank of `stage` of the layout `cfg` runs (fp32)."""
    from paratrain.models.registry import preset_config
    from paratrain.planner.layout import Layout
    from paratrain.planner.memory import reference_bytes
    from paratrain.planner.model_shape import shape_from_config, with_adapters, with_reference
    from paratrain.planner.reference import resolve_reference
    from tests.cases import TINY_LLAMA

    shape = shape_from_config(preset_config("llama-tiny", **TINY_LLAMA), "llama-tiny")
    if "peft" in cfg:
        from paratrain.planner.adapters import LoraPlan

        shape = with_adapters(shape, LoraPlan(cfg["peft"]["r"], tuple(cfg["peft"]["target_modules"])))
    shape = with_reference(shape, resolve_reference(cfg["objective"], "peft" in cfg, "objective"))
    pipeline = cfg["pipeline"]
    layout = Layout(dp=cfg["data_parallel"]["size"], micro_batch=cfg["train_micro_batch_size_per_gpu"],
                    grad_accum=cfg["gradient_accumulation_steps"], tp=cfg["tensor_parallel"]["size"],
                    pp=pipeline["stages"], zero_stage=cfg["zero_optimization"]["stage"],
                    schedule=pipeline["schedule"] if pipeline["stages"] > 1 else "none", precision="fp32")
    return reference_bytes(shape, layout, stage)


def test_the_reference_is_placed_like_the_policy_and_adapters_off_cost_nothing_4_ranks(world4):
    for out in world4.run(_reference_memory):
        psi = out["psi"]
        assert out[("lora", "zero3")]["reference"] == 0, out
        full = out[("full", "zero3")]
        assert full["reference"] == full["policy"], out  # the same shards as the policy's weights
        assert 4 * psi / 4 <= full["reference"] <= 4 * psi / 4 * 1.01, out  # 4 bytes x psi / N, padding < 1%
        assert out[("full", "zero1")]["reference"] == 4 * psi, out  # whole on every rank
        for case, got in out.items():  # the planner counts what memory_stats() measures, to the byte
            if case != "psi":
                assert got["planner"] == got["reference"], (case, got)


def _from_directories(root: str) -> dict:
    """DPO on a model given as a Hugging Face directory (built on the meta device, its weights loaded by each rank):
    the frozen initial reference is filled from the same weights, so the first step's loss is log 2 (the policy
    is its reference); `objective.reference_model` fills it from another directory of the same architecture
    (another seed: the first step's loss then differs from log 2), and one of another architecture is refused by
    name on every rank."""
    import math

    from paratrain.api import initialize
    from paratrain.errors import Error

    out = {}
    cfg = {**case_config(("dpo", "full", "sigmoid", 0.0, "zero3")), "train_micro_batch_size_per_gpu": 2,
           "gradient_accumulation_steps": 1}
    for name, extra in (("same", {}), ("other", {"reference_model": f"{root}/other"})):
        run = {**cfg, "objective": {**cfg["objective"], **extra}}
        engine, *_ = initialize(model=f"{root}/policy", config=run, training_data=PreferencePairs(),
                                collate_fn=preference_collator())
        loss = float(engine.train_batch())
        out[name] = {"loss": loss, "log2": math.log(2), "metrics": engine.objective_metrics()}
        engine.destroy()
    bad = {**cfg, "objective": {**cfg["objective"], "reference_model": f"{root}/wider"}}
    try:
        initialize(model=f"{root}/policy", config=bad, training_data=PreferencePairs(),
                   collate_fn=preference_collator())
        out["wider"] = "accepted"
    except Error as exc:
        out["wider"] = str(exc)
    return out


def test_references_from_model_directories_4_ranks(world4, tmp_path):
    from tests.cases import tiny_hf

    tiny_hf("llama", seed=1).save_pretrained(tmp_path / "policy")
    tiny_hf("llama", seed=2).save_pretrained(tmp_path / "other")
    tiny_hf("llama", seed=1, hidden_size=64).save_pretrained(tmp_path / "wider")
    for out in world4.run(_from_directories, str(tmp_path)):
        assert abs(out["same"]["loss"] - out["same"]["log2"]) < 1e-6, out
        assert abs(out["same"]["metrics"]["rewards/margins"]) < 1e-6, out
        assert abs(out["other"]["loss"] - out["other"]["log2"]) > 1e-3, out
        assert "objective.reference_model must hold the policy's architecture" in out["wider"], out


EVALUATED = ("ddp", "pp2 1f1b", "cp2 ring")  # 7 held-out pairs: every layout pads the ranks' shares


def _evaluated() -> dict:
    """engine.evaluate on held-out pairs after one DPO step: the loss and the objective's metrics (the shares padded
    with pairs of empty completions, which count nothing), and the trained weights for the reference."""
    from paratrain.api import initialize

    out = {}
    for name in EVALUATED:
        engine, *_ = initialize(model=tiny_llama(), config=case_config(("dpo", "full", "sigmoid", 0.0, name)),
                                training_data=PreferencePairs(), collate_fn=preference_collator())
        engine.train_batch()
        loss = float(engine.evaluate(PreferencePairs(count=7, seed=5)))  # collated by the training loader's collator
        out[name] = {"loss": loss, "metrics": engine.evaluation_metrics(), "state": engine.full_state_dict()}
        engine.destroy()
    return out


def test_evaluation_on_held_out_pairs_is_one_processs_4_ranks(world4):
    import pytest

    per_rank = world4.run(_evaluated)
    pairs = PreferencePairs(count=7, seed=5)  # a padding pair counted would make every mean over 8
    batch = preference_collator()([pairs[i] for i in range(len(pairs))])
    for name in EVALUATED:
        got = per_rank[0][name]
        model = tiny_llama()
        model.load_state_dict(got["state"])
        initial = frozen(tiny_llama())
        want = float(dpo_loss(model, initial, batch).detach())
        metrics = dpo_metrics(model, initial, batch)
        assert got["loss"] == pytest.approx(want, rel=1e-5), (name, got["loss"], want)
        assert sorted(got["metrics"]) == sorted(metrics), (name, got["metrics"])
        # rewards/* are beta x (log p - reference log p): a difference of sums of tens of log-probs, so their error is
        # measured on the scale of those sums (beta 0.1 x |logps/*|), not relative to the small difference left
        terms = 0.1 * max(abs(v) for k, v in metrics.items() if k.startswith("logps/"))
        for key, value in metrics.items():
            floor = 1e-5 * terms if key.startswith("rewards/") else 1e-7
            assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=floor), \
                (name, key, got["metrics"], metrics)
        assert all(other[name]["metrics"] == got["metrics"] for other in per_rank[1:]), name
