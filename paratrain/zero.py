"""ZeRO's memory arithmetic: the model-state bytes per rank each stage holds, from the parameter count.

    paratrain.zero.estimate_memory(model, dp=8, stage=3, offload="optimizer", precision="bf16")

The formulas are what `engine.memory_stats()` measures (tests assert equality), so they count exactly the
persistent buffers the strategies keep (Ψ = trainable parameters, N = dp size, p = bytes of the compute
dtype, K = optimizer-state bytes per parameter, 8 for Adam/AdamW):

| stage | params                        | grads        | optimizer |
|-------|-------------------------------|--------------|-----------|
| 0     | pΨ (+ 4Ψ fp32 master if mixed) | pΨ           | KΨ        |
| 1     | pΨ + 4Ψ/N if the master is a copy | pΨ        | KΨ/N      |
| 2     | pΨ + 4Ψ/N if the master is a copy | 4Ψ/N (fp32) | KΨ/N     |
| 3     | 4Ψ/N (+ pΨ/N device shard under optimizer offload) + p·Ψ_persistent | 4Ψ/N | KΨ/N |

Frozen parameters (a LoRA base; F of them) add pF to params at stages 0-2, where every rank holds them whole in
the compute dtype, and pF/N at stage 3, which shards them like the rest (its own padded flat buffers: pass that
padded count, `grad_sync.padded_frozen_numel()`, for the byte); they have no master, gradient or optimizer state.
The master is a copy under mixed precision or optimizer offload; in fp32 without offload it is the model's
own slice (stages 1-2). fp32 AdamW gives DeepSpeed's figures: 16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N. Offloaded
states (master, its gradient at stages 2-3, optimizer state) are counted under "host". Pass the padded
count (`grad_sync.padded_numel()`) to get a strategy's figure to the byte; with the raw count the
difference is the padding (< N elements per flat buffer). Transient buffers (buckets in flight, a gathered
unit, the fp32 gradient copy at stages 0-1 under mixed precision) are not model state and are not counted.
With `free_grad_buckets` (stages 0-1, `zero_optimization.free_grad_buckets`) the gradient buckets exist only
from a backward to the update, so between steps, where `memory_stats()` measures, the grads term is 0: pΨ less
(4Ψ in fp32) during every forward. At stages 2-3 the fp32 gradient shard is made by the first backward's
reduction and kept from then on: the grads term holds from the first step, and before any backward (at init)
`memory_stats()` counts 0 grads.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from paratrain.compat.names import DeepSpeedNotSupported
from paratrain.errors import InvalidValueError
from paratrain.precision import compute_dtype

OFFLOAD = ("none", "optimizer", "optimizer+param")


def estimate_memory(model: nn.Module | int, dp: int, stage: int, offload: str = "none", precision: str = "fp32",
                    optimizer_state_bytes: int = 8, persistent_params: int = 0,
                    free_grad_buckets: bool = False, frozen_params: int | None = None) -> dict[str, int]:
    """Per-rank model-state bytes: params (frozen_params of them for frozen weights), grads, optimizer_state,
    total, and the host/device split. `model`: the module, or its trainable parameter count (then
    `frozen_params` gives the frozen count; a module's own frozen parameters are counted otherwise)."""
    psi = model if isinstance(model, int) else sum(p.numel() for p in model.parameters() if p.requires_grad)
    if frozen_params is None:
        frozen_params = 0 if isinstance(model, int) else sum(p.numel() for p in model.parameters()
                                                             if not p.requires_grad)
    if stage not in (0, 1, 2, 3):
        raise InvalidValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if offload not in OFFLOAD:
        raise InvalidValueError(f"offload must be one of {', '.join(OFFLOAD)}, got {offload!r}")
    if offload != "none" and stage == 0 or offload == "optimizer+param" and stage != 3:
        raise InvalidValueError(f"offload={offload!r} is not available at stage {stage} (optimizer offload needs stage "
                                f">= 1, parameter offload stage 3)")
    p = compute_dtype(precision).itemsize
    mixed = precision != "fp32"
    off = offload != "none"
    k = optimizer_state_bytes
    n = 1 if stage == 0 else dp
    shard = -(-psi // n)
    if stage == 0:
        params, grads = p * psi + (4 * psi if mixed else 0), p * psi
    elif stage in (1, 2):
        params = p * psi + (4 * shard if mixed or off else 0)
        grads = p * psi if stage == 1 else 4 * shard
    else:
        device_shard = p * shard if offload == "optimizer" else 0
        params = 4 * shard + device_shard + p * persistent_params
        grads = 4 * shard
    if free_grad_buckets and stage <= 1:
        grads = 0  # the buckets (and, mixed, the fp32 gradient copy) exist from a backward to the update only
    optim = k * shard
    frozen = p * (frozen_params if stage < 3 else -(-frozen_params // dp))
    params += frozen
    host = 0
    if off:
        host = 4 * shard + optim + (4 * shard if stage >= 2 else 0) + (frozen if offload == "optimizer+param" else 0)
    total = params + grads + optim
    return {"params": params, "grads": grads, "optimizer_state": optim, "total": total, "host": host,
            "device": total - host, "frozen_params": frozen}


def Init(module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None, pin_memory=False,  # noqa: N802 - DeepSpeed's name
         config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None, **unsupported):
    """DeepSpeed's `zero.Init` context: `paratrain.init_empty()` under DeepSpeed's name. The model is built on
    the meta device and `initialize()` materializes each rank's part of it, in any layout (not only stage 3).
    The group and config arguments are accepted and unused (the engine's config and mesh decide); arguments
    that would change the meaning are refused by name."""
    from paratrain.init.empty import init_empty

    refused = {"module": module is not None, "remote_device": remote_device not in (None, "cpu", "none"),
               "mpu": mpu is not None, "dtype": dtype not in (None, torch.float32),
               **{k: v not in (None, False) for k, v in unsupported.items()}}
    named = [k for k, bad in refused.items() if bad]
    if named:
        raise DeepSpeedNotSupported(f"deepspeed.zero.Init({named[0]}=...) is not supported by paratrain: build the "
                                    f"model inside `with paratrain.zero.Init():` (or paratrain.init_empty()) and set "
                                    f"precision and offload in the config (bf16, zero_optimization.offload_param)")
    return init_empty() if enabled else contextlib.nullcontext()


def __getattr__(name: str):
    """deepspeed.zero.<name> that paratrain does not provide (GatheredParameters, ...)."""
    from paratrain.compat.names import ZERO, refuse

    refuse(ZERO, "paratrain.zero (deepspeed.zero)", name)
