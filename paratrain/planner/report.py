"""What `paratrain plan` prints: the ranked layouts, their memory and time breakdowns, a ready config."""

from __future__ import annotations

import copy
import json

from paratrain.config import load_config
from paratrain.planner.comm import predict_comm
from paratrain.planner.enumerate import Evaluation, PlanResult
from paratrain.planner.hardware import Hardware
from paratrain.planner.layout import Layout
from paratrain.planner.model_shape import ModelShape
from paratrain.planner.units import format_bytes, format_seconds

DEFAULT_OPTIMIZER = {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}
MUON_OPTIMIZER = {"type": "Muon", "params": {"lr": 0.02, "adamw": DEFAULT_OPTIMIZER["params"]}}
LAYOUT_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16", "fp16",
               "zero_optimization", "data_parallel", "tensor_parallel", "pipeline", "context_parallel",
               "activation_checkpointing", "expert_parallel")


def layout_config(shape: ModelShape, layout: Layout, base: dict | None = None) -> dict:
    """A paratrain JSON config running `shape` in `layout` (it validates with `paratrain.config.load_config`).

    `base` (e.g. the config given as --model) supplies everything that is not layout: optimizer, scheduler,
    clipping, trainer settings; its layout keys are replaced.
    """
    cfg = {k: v for k, v in copy.deepcopy(base or {}).items() if k not in LAYOUT_KEYS}
    cfg.update({
        "train_batch_size": layout.global_batch,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.grad_accum,
    })
    cfg.setdefault("optimizer", copy.deepcopy(DEFAULT_OPTIMIZER))
    if layout.optimizer == "muon" and cfg["optimizer"]["type"].lower() != "muon":
        cfg["optimizer"] = copy.deepcopy(MUON_OPTIMIZER)
    cfg.setdefault("gradient_clipping", 1.0)
    if layout.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif layout.precision == "fp16":
        cfg["fp16"] = {"enabled": True}
    zero: dict = {"stage": layout.zero_stage}
    if layout.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    cfg["zero_optimization"] = zero
    cfg["data_parallel"] = {"size": layout.dp}
    if layout.dp_replicate > 1:
        cfg["data_parallel"]["replicate"] = layout.dp_replicate
    cfg["tensor_parallel"] = {"size": layout.tp, "sequence_parallel": layout.sequence_parallel}
    pipeline: dict = {"stages": layout.pp}
    if layout.pp > 1:
        pipeline.update(schedule=layout.schedule, micro_batches=layout.grad_accum,
                        virtual_stages=layout.virtual_stages, partition="uniform")
    cfg["pipeline"] = pipeline
    cfg["context_parallel"] = {"size": layout.cp}
    if layout.cp > 1 and layout.cp_method != "ring":
        cfg["context_parallel"]["method"] = layout.cp_method
        if layout.cp_method == "usp":
            cfg["context_parallel"]["ulysses_size"] = layout.ulysses_size
    if layout.ep > 1:
        cfg["expert_parallel"] = {"size": layout.ep}
    cfg["activation_checkpointing"] = {"enabled": layout.recompute != "none"}
    if layout.recompute != "none":
        cfg["activation_checkpointing"]["granularity"] = layout.recompute
    trainer = dict(cfg.get("trainer", {}))
    trainer.update(model=shape.name, model_overrides=dict(shape.overrides))
    cfg["trainer"] = trainer
    if shape.lora is not None:  # the adapters the plan costs (its base frozen)
        cfg["peft"] = shape.lora.section()
    if shape.reference is not None:  # the objective the plan costs (its reference model counted)
        cfg["objective"] = dict(shape.reference.objective)
    load_config(cfg)  # the promise: what we print is a valid config
    return cfg


def compact_json(cfg: dict) -> str:
    """One top-level key per line, each value on one line: short enough to read, valid JSON."""
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in cfg.items())
    return "{\n" + body + "\n}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 1 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def memory_unit(evals: list[Evaluation]) -> tuple[str, float]:
    """GiB, or MiB when every layout shown needs less than a GiB (small models)."""
    return ("GiB", 2**30) if max(e.memory.total for e in evals) >= 2**30 else ("MiB", 2**20)


def memory_table(evals: list[Evaluation]) -> str:
    unit, size = memory_unit(evals)
    rows = []
    moe = any(e.memory.experts for e in evals)  # a column of the routed experts' share of the model states
    for i, e in enumerate(evals):
        m = e.memory
        amounts = (m.total, m.params, m.grads, m.optimizer_state, *((m.experts,) if moe else ()), m.activations,
                   m.transient, m.host)
        rows.append([str(i + 1), e.layout.describe(), *(f"{x / size:.1f}" for x in amounts), str(m.stage)])
    return _table(["#", "layout", f"{unit}/rank", "params", "grads", "optim", *(["experts"] if moe else []),
                   "activ", "transient", "host", "stage"], rows)


def time_table(evals: list[Evaluation], hw: Hardware) -> str:
    axes = sorted({a for e in evals for a in e.time.comm})
    rows = []
    for i, e in enumerate(evals):
        t = e.time
        rows.append([str(i + 1), e.layout.describe(), f"{t.total:.3f}", f"{t.tokens_per_s / e.layout.world:,.0f}",
                     f"{100 * t.mfu(hw.peak_flops):.1f}%", f"{t.compute:.3f}", f"{t.bubble:.3f}",
                     *(f"{t.comm.get(a, 0.0):.3f}" for a in axes), f"{t.optimizer + t.offload:.3f}"])
    return _table(["#", "layout", "step s", "tok/s/GPU", "MFU", "compute", "bubble",
                   *(f"comm:{a}" for a in axes), "optim"], rows)


def comm_summary(shape: ModelShape, layout: Layout) -> str:
    """Bytes per step per axis and collective for a rank of the first stage (what comm_stats would show)."""
    lines = []
    for axis, ops in sorted(predict_comm(shape, layout, 0).items()):
        parts = ", ".join(f"{op} {format_bytes(c['bytes'])}" for op, c in sorted(ops.items()))
        lines.append(f"  {axis}: {parts}")
    return "\n".join(lines) or "  (none)"


def render(shape: ModelShape, gpus: int, global_batch: int, hw: Hardware, result: PlanResult, top: int,
           precision: str, base: dict | None = None) -> tuple[str, dict | None]:
    """The text report and the config of the best layout (None when nothing fits)."""
    head = [f"model: {shape.describe()}",
            f"hardware: {gpus} GPUs, {hw.gpus_per_node} per node, {format_bytes(hw.gpu_memory)} each "
            f"({format_bytes(hw.usable_memory)} usable), {hw.peak_flops / 1e12:.0f} TFLOP/s peak at MFU "
            f"{hw.mfu:.2f}, links {hw.intra_node_bandwidth / 1e9:.0f} GB/s in a node / "
            f"{hw.inter_node_bandwidth / 1e9:.0f} GB/s between nodes, latency {format_seconds(hw.latency)}",
            f"batch: {global_batch} sequences x {shape.seq_len} tokens, {precision}, AdamW",
            *([shape.reference.describe()] if shape.reference is not None else []),
            f"layouts: {result.considered} valid, {len(result.ranked)} fit in memory"]
    if not result.ranked:
        s = result.smallest
        head.append(f"nothing fits; the smallest layout ({s.layout.describe()}) needs "
                    f"{format_bytes(s.memory.total)} per GPU. Add GPUs, allow --offload, or use a larger "
                    f"--gpu-memory.")
        return "\n".join(head), None
    best = result.ranked[:top]
    config = layout_config(shape, best[0].layout, base)
    text = "\n".join(head + [
        "", f"Top {len(best)} by predicted step time — memory per GPU ({memory_unit(best)[0]}; the peak pipeline "
            f"stage):",
        memory_table(best), "", "Time per optimizer step (seconds; comm = exposed, not hidden by compute):",
        time_table(best, hw), "", "Communication per step of #1 (a first-stage rank, paratrain.comm payload):",
        comm_summary(shape, best[0].layout), "", "Config for #1:", compact_json(config)])
    return text, config
