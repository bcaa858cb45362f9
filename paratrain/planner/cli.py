"""`paratrain plan`: the ranked layouts for a model on N GPUs, with breakdowns and a ready config."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from paratrain.planner.adapters import LoraPlan, four_bit_cut, projections
from paratrain.planner.enumerate import SearchSpace
from paratrain.planner.hardware import Hardware
from paratrain.planner.layout import CP_METHODS, RECOMPUTE, SCHEDULES
from paratrain.planner.model_shape import PlannerError, config_batch_size, model_shape, with_adapters, with_reference
from paratrain.planner.reference import config_objective, resolve_reference
from paratrain.planner.report import compact_json, render
from paratrain.planner.search import plan
from paratrain.planner.units import parse_bytes, parse_rate, parse_seconds

DEFAULT_GLOBAL_BATCH = 1024


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip().lower() for x in text.split(",") if x.strip())


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="a GPT, Llama or Llama MoE preset (gpt-7b, llama3-70b, mixtral-8x7b, ...) or a "
                             "paratrain JSON config naming one")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs (processes)")
    parser.add_argument("--gpu-memory", default="80GiB", help="memory per GPU, e.g. 80GiB, 141GB")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help=f"sequences per optimizer step (default: the config's train_batch_size, else "
                             f"{DEFAULT_GLOBAL_BATCH})")
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--intra-node-bandwidth", default="300GB/s", help="achieved busbw per GPU in a node")
    parser.add_argument("--inter-node-bandwidth", default="40GB/s", help="achieved busbw per GPU between nodes")
    parser.add_argument("--latency", default="10us", help="seconds per ring step")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="dense peak per GPU in the training precision (H100/H200: 989 bf16/fp16, ~495 tf32)")
    parser.add_argument("--mfu", type=float, default=0.5, help="fraction of peak the kernels reach")
    parser.add_argument("--memory-bandwidth", default="3.35TB/s", help="device memory bandwidth")
    parser.add_argument("--headroom", type=float, default=0.1, help="fraction of GPU memory kept free")
    parser.add_argument("--offload", action="store_true", help="also consider ZeRO optimizer offload to CPU")
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                        help="muon: Muon on the blocks' matrices, AdamW on the rest (dense models)")
    parser.add_argument("--lora-r", type=int, default=None,
                        help="train LoRA adapters of this rank over a frozen base (the config's peft section)")
    parser.add_argument("--lora-targets", type=_names, default=None,
                        help="the projections to adapt (default: all of a block's), e.g. q_proj,v_proj or q,v")
    parser.add_argument("--dora", action="store_true", help="DoRA adapters (with --lora-r)")
    parser.add_argument("--quantize-base", choices=["nf4", "fp4"], default=None,
                        help="QLoRA: the adapted bases in 4 bits (with --lora-r; the peft section's quantize_base)")
    parser.add_argument("--double-quant", action="store_true", help="with --quantize-base: double quantization")
    parser.add_argument("--quantize-backend", choices=["bitsandbytes", "torchao"], default="bitsandbytes",
                        help="with --quantize-base: who quantizes (peft.quantize_backend; torchao: nf4 with double "
                             "quantization)")
    parser.add_argument("--objective", choices=["sft", "dpo", "grpo"], default=None,
                        help="what the step trains (default: the config's objective section, else sft): dpo and grpo "
                             "with beta > 0 read a reference model, costed by --reference")
    parser.add_argument("--reference", choices=["initial", "adapters_off", "batch"], default=None,
                        help="the objective's reference (objective.reference): initial, a frozen copy placed like "
                             "the model; adapters_off, no copy (the default with --lora-r); batch, precomputed")
    parser.add_argument("--beta", type=float, default=None,
                        help="objective.beta (grpo: a reference only when > 0)")
    parser.add_argument("--zero", type=_ints, default=(0, 1, 2, 3), help="ZeRO stages to consider, e.g. 1,2")
    parser.add_argument("--schedules", type=_names, default=SCHEDULES, help="pipeline schedules to consider")
    parser.add_argument("--recompute", type=_names, default=RECOMPUTE, help="none,selective,full")
    parser.add_argument("--cp-methods", type=_names, default=CP_METHODS, help="sequence methods: ring,ulysses,usp")
    parser.add_argument("--ep", type=_ints, default=None,
                        help="expert-parallel sizes to consider for an MoE model, e.g. 1,8 (default: every divisor "
                             "of dp x cp and of the number of experts)")
    parser.add_argument("--unfused-attention", action="store_true",
                        help="attention keeps its s^2 scores (no flash attention): Korthikanti's 5as/h term")
    parser.add_argument("--max-micro-batch", type=int, default=16)
    parser.add_argument("--top", type=int, default=5, help="how many layouts to show")
    parser.add_argument("--config-out", default=None, help="write the best layout's config to this file")
    parser.add_argument("--json", action="store_true", help="print the ranked layouts as JSON instead")


def hardware_from_args(args: argparse.Namespace) -> Hardware:
    checks = [(args.gpus_per_node >= 1, "--gpus-per-node must be >= 1"),
              (0 < args.mfu <= 1, "--mfu must be in (0, 1]"),
              (0 <= args.headroom < 1, "--headroom must be in [0, 1)"),
              (args.peak_tflops > 0, "--peak-tflops must be > 0")]
    for ok, message in checks:
        if not ok:
            raise PlannerError(message)
    return Hardware(gpu_memory=parse_bytes(args.gpu_memory, "--gpu-memory"), gpus_per_node=args.gpus_per_node,
                    intra_node_bandwidth=parse_rate(args.intra_node_bandwidth, "--intra-node-bandwidth"),
                    inter_node_bandwidth=parse_rate(args.inter_node_bandwidth, "--inter-node-bandwidth"),
                    latency=parse_seconds(args.latency, "--latency"), peak_flops=args.peak_tflops * 1e12,
                    mfu=args.mfu, memory_bandwidth=parse_rate(args.memory_bandwidth, "--memory-bandwidth"),
                    memory_headroom=args.headroom)


def adapted_shape(shape, args: argparse.Namespace):
    """The model trained through adapters (--lora-r), or as it is."""
    if args.lora_r is None:
        if args.lora_targets or args.dora or args.quantize_base:
            raise PlannerError("--lora-targets / --dora / --quantize-base need --lora-r, the adapters' rank")
        return shape
    if args.double_quant and not args.quantize_base:
        raise PlannerError("--double-quant needs --quantize-base nf4 or fp4")
    if args.quantize_backend == "torchao" and (args.quantize_base != "nf4" or not args.double_quant):
        raise PlannerError("--quantize-backend torchao needs --quantize-base nf4 --double-quant (torchao's NF4 has "
                           "that one form)")
    if args.lora_r < 1:
        raise PlannerError(f"--lora-r {args.lora_r}: the rank must be >= 1")
    targets = args.lora_targets or tuple(projections(shape))
    adapted = with_adapters(shape, LoraPlan(args.lora_r, targets, args.dora, args.quantize_base, args.double_quant,
                                            args.quantize_backend))
    cut = four_bit_cut(adapted, 1) if args.quantize_base else None  # torchao: what no layout can quantize
    if cut:
        raise PlannerError(f"--quantize-backend torchao: {cut}; leave those projections out with --lora-targets, or "
                           f"use --quantize-backend bitsandbytes")
    return adapted


def objective_shape(shape, args: argparse.Namespace):
    """The model trained by the objective of the config given as --model, with --objective, --reference and --beta
    put over it; as it is for next-token cross-entropy."""
    section = dict(config_objective(args.model) or {})
    flags = [("--objective", "type", args.objective), ("--reference", "reference", args.reference),
             ("--beta", "beta", args.beta)]
    given = [flag for flag, _, value in flags if value is not None]
    section.update({key: value for _, key, value in flags if value is not None})
    if not section:
        return shape
    source = "/".join(given) if given else f"the objective section of {args.model}"
    return with_reference(shape, resolve_reference(section, shape.lora is not None, source))


def space_from_args(args: argparse.Namespace) -> SearchSpace:
    bad = [s for s in args.schedules if s not in SCHEDULES] + [r for r in args.recompute if r not in RECOMPUTE] + \
        [m for m in args.cp_methods if m not in CP_METHODS]
    if args.ep is not None and (not args.ep or min(args.ep) < 1):
        raise PlannerError(f"--ep {','.join(map(str, args.ep))}: expert-parallel sizes must be >= 1, e.g. 1,2,8")
    if bad or not set(args.zero) <= {0, 1, 2, 3}:
        raise PlannerError(f"unknown choice(s) {bad or list(args.zero)}: --schedules takes {','.join(SCHEDULES)}, "
                        f"--recompute {','.join(RECOMPUTE)}, --cp-methods {','.join(CP_METHODS)}, --zero stages 0-3")
    return SearchSpace(precision=args.precision, zero_stages=args.zero, schedules=args.schedules,
                       recompute=args.recompute, offload_optimizer=(False, True) if args.offload else (False,),
                       max_micro_batch=args.max_micro_batch, flash_attention=not args.unfused_attention,
                       cp_methods=args.cp_methods, expert_parallel=args.ep, optimizer=args.optimizer)


def run_plan(args: argparse.Namespace) -> int:
    try:
        shape = objective_shape(adapted_shape(model_shape(args.model, args.seq), args), args)
        hw = hardware_from_args(args)
        global_batch = args.global_batch or config_batch_size(args.model) or DEFAULT_GLOBAL_BATCH
        result = plan(shape, args.gpus, global_batch, hw, space_from_args(args))
    except PlannerError as exc:
        print(f"paratrain plan: {exc}", file=sys.stderr)
        return 2
    base = json.loads(Path(args.model).read_text()) if Path(args.model).is_file() else None
    text, config = render(shape, args.gpus, global_batch, hw, result, args.top, args.precision, base)
    if args.json:
        print(json.dumps(as_json(result, args.top, hw, config, shape.reference is not None), indent=1))
    else:
        print(text)
    if config is not None and args.config_out:
        Path(args.config_out).write_text(compact_json(config) + "\n")
        print(f"\nwrote {args.config_out}", file=sys.stderr)
    return 0 if config is not None else 1


def as_json(result, top: int, hw: Hardware, config: dict | None, reference: bool = False) -> dict:
    """The ranked layouts; `reference`: with the bytes of an objective's frozen reference (of params)."""
    rows = []
    for e in result.ranked[:top]:
        m, t = e.memory, e.time
        rows.append({"layout": e.layout.describe(), "ep": e.layout.ep, "step_s": t.total,
                     "tokens_per_s": t.tokens_per_s,
                     "mfu": t.mfu(hw.peak_flops),
                     "memory": {"total": m.total, "params": m.params, "grads": m.grads,
                                "optimizer_state": m.optimizer_state, "activations": m.activations,
                                "transient": m.transient, "host": m.host, "stage": m.stage,
                                "experts": m.experts, **({"reference": m.reference} if reference else {})},
                     "time": {"compute": t.compute, "bubble": t.bubble, "comm": t.comm, "optimizer": t.optimizer,
                              "offload": t.offload}})
    return {"considered": result.considered, "fit": len(result.ranked), "ranked": rows, "config": config}
