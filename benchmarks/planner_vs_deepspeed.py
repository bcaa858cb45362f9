"""The planner's ZeRO model-state bytes next to DeepSpeed's estimators, for the same models and GPU counts.

    DS_ACCELERATOR=cpu PYTHONPATH=. /work/dsenv/bin/python -m benchmarks.planner_vs_deepspeed

DeepSpeed's `estimate_zero2_model_states_mem_needs_all_cold` and `estimate_zero3_model_states_mem_needs_all_cold`
print one row per offload option by calling `estimate_zero2_model_states_mem_needs` /
`estimate_zero3_model_states_mem_needs`; this script calls those (pure arithmetic, no GPU) with the exact
parameter count and largest-module size of paratrain's GPT presets, and prints a markdown table for
docs/planner.md next to `paratrain.planner.model_state_bytes` (bf16 mixed precision, AdamW, ZeRO over all
GPUs, no tensor/pipeline parallelism). The planner's ZeRO-3 column adds its gathered-unit transient.
"""

from __future__ import annotations

import contextlib
import io
import sys

from paratrain.planner import Layout, model_shape, model_state_bytes
from paratrain.planner.memory import zero3_gathered_bytes

CASES = [("gpt-1.3b", 8, 1), ("gpt-7b", 8, 8), ("gpt-13b", 8, 8), ("gpt-70b", 8, 64)]  # model, GPUs/node, nodes


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def rows() -> list[str]:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as ds_zero3
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as ds_zero2

    out = []
    for name, per_node, nodes in CASES:
        spec = model_shape(name)
        psi, largest, n = spec.params, spec.largest_module_params(), per_node * nodes
        for offload in (False, True):
            _, ds2 = ds_zero2(psi, per_node, nodes, cpu_offload=offload)
            ours2 = model_state_bytes(psi, n, 2, "bf16", offload)
            out.append(f"| {name} | {n} | ZeRO-2{' + offload_optimizer' if offload else ''} | {_gib(ds2)} | "
                       f"{_gib(ours2.device)} | {_gib(ours2.device - ds2)} |")
        for offload in (False, True):
            _, ds3, _ = ds_zero3(psi, largest, per_node, nodes, cpu_offload=offload, cpu_offload_params=False)
            ours3 = model_state_bytes(psi, n, 3, "bf16", offload)
            layout = Layout(dp=n, micro_batch=1, grad_accum=1, zero_stage=3, precision="bf16")
            gathered = zero3_gathered_bytes(spec, layout)
            out.append(f"| {name} | {n} | ZeRO-3{' + offload_optimizer' if offload else ''} | {_gib(ds3)} | "
                       f"{_gib(ours3.device)} + {_gib(gathered)} | {_gib(ours3.device + gathered - ds3)} |")
    return out


def table() -> str:
    head = ["| model | GPUs | option | DeepSpeed GiB/GPU | planner GiB/GPU (states + transient) | planner - DS |",
            "|---|---:|---|---:|---:|---:|"]
    return "\n".join(head + rows())


def deepspeed_printout(name: str = "gpt-7b", per_node: int = 8, nodes: int = 8) -> str:
    """What DeepSpeed's own `_all_cold` estimators print for one model (for the docs, verbatim)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold

    spec = model_shape(name)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        estimate_zero2_model_states_mem_needs_all_cold(spec.params, per_node, nodes)
        estimate_zero3_model_states_mem_needs_all_cold(spec.params, spec.largest_module_params(), per_node, nodes)
    return buffer.getvalue()


if __name__ == "__main__":
    print(table())
    print("\nDeepSpeed's own printout (`..._all_cold`) for gpt-7b on 8 nodes x 8 GPUs (its \"GB\" are GiB):\n")
    print("```\n" + deepspeed_printout().rstrip() + "\n```")
    sys.exit(0)
