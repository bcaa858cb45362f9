"""Adapters in the plan: LoRA (or DoRA) on the blocks' projections, over a frozen base (`paratrain plan --lora-r`).

Per block and tensor-parallel rank, an adapted projection of `in` inputs and `out` outputs adds (tp/lora.py):

    column-parallel (q, k, v, fc / gate, up)   A r·in whole, B r·out/tp (+ DoRA's m out/tp)
    row-parallel (o, proj / o, down)            A r·in/tp, B r·out whole (+ m out whole)

The adapters are the trainable parameters Ψ_a: their gradients, masters and optimizer state follow the ZeRO
stage's formulas (`paratrain.zero.estimate_memory`); the whole base is frozen, F parameters, held in the compute
dtype whole (stages 0-2) or sharded per ZeRO-3 unit (each unit's frozen and trainable buffers padded apart); with
a 4-bit base (QLoRA, `--quantize-base`, bitsandbytes' or torchao's NF4 by `--quantize-backend`) the adapted
projections' weights are `four_bit_bytes` each: whole, or under
tp this rank's 1/tp of the packed bytes with the whole quantization state (`quantized_bytes`), or under ZeRO-3 one
shard of each block's 4-bit buffers (`four_bit_buffers`), gathered with the block.
Communication: the data-parallel reductions move Ψ_a; ZeRO-3 gathers each unit's frozen and trainable buffers
(twice for a block, once for the root) and reduce-scatters the trainable ones. Over tp, per adapted block and
micro-batch: the column-parallel A's gradient summed (r·in, an all-reduce in every backward), the row-parallel A's
output reduced like the base's (b·s·r, all-reduced forward, or reduce-scattered forward and all-gathered backward
under SP), under SP the row-parallel B's and m's gradients summed, and DoRA's row norms of a row-parallel layer
all-reduced (out per forward). Compute: the base costs forward and input gradient only (4 per parameter and token),
the adapters all three (6). tests/distributed/test_planner_calibration.py holds these equal to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.planner.layout import Layout
from paratrain.planner.stages import rank_blocks
from paratrain.planner.states import ModelStates, ceil_div, model_state_bytes
from paratrain.planner.transfer import Transfer

GPT_TARGETS = ("q", "k", "v", "o", "fc", "proj")
NF4_WHOLE = 4 + 16 * 4  # torchao's NF4: the fp32 mean and code book, kept whole on every rank
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraPlan:
    r: int
    targets: tuple[str, ...]  # the family's projection names (GPT_TARGETS, LLAMA_TARGETS)
    dora: bool = False
    quantize: str | None = None  # QLoRA: the adapted bases in 4 bits (peft.quantize_base: nf4 | fp4)
    double_quant: bool = False
    backend: str = "bitsandbytes"  # peft.quantize_backend: "bitsandbytes" or "torchao" (its NF4, scales in int8)

    def section(self) -> dict:
        """The config's `peft` section putting these adapters in."""
        quantized = {"quantize_base": self.quantize, "double_quant": self.double_quant,
                     **({"quantize_backend": self.backend} if self.backend != "bitsandbytes" else {})} \
            if self.quantize else {}
        return {"method": "dora" if self.dora else "lora", "r": self.r, "alpha": 2 * self.r,
                "target_modules": list(self.targets), **quantized}


def four_bit_bytes(n: int, double: bool, backend: str = "bitsandbytes") -> int:
    """Bytes of a weight of n values in 4 bits (blocks of 64). bitsandbytes: n/2 packed, each block's fp32 scale and a
    16-entry fp32 code book; with double quantization the scales in uint8 plus one fp32 scale per 256 blocks, a
    256-entry fp32 code book and an fp32 offset. torchao's NF4: n/2 packed, each block's int8 scale, an fp32 factor
    per 256 blocks, the fp32 mean and the 16-entry fp32 code book (`NF4_WHOLE` bytes: 68)."""
    blocks = ceil_div(n, 64)
    if backend == "torchao":
        return ceil_div(n, 2) + blocks + 4 * ceil_div(blocks, 256) + NF4_WHOLE
    scales = blocks + 4 * ceil_div(blocks, 256) + 4 * 256 + 4 if double else 4 * blocks
    return ceil_div(n, 2) + scales + 4 * 16


def quantized_bytes(n: int, tp: int, double: bool, backend: str = "bitsandbytes") -> int:
    """A tp rank's bytes of a 4-bit weight of n values: 1/tp of its packed bytes (whole blocks), all of its
    quantization state (tp/quantized.py)."""
    return four_bit_bytes(n, double, backend) - ceil_div(n, 2) + ceil_div(n, 2 * tp)


def four_bit_buffers(shape, tp: int) -> tuple[list[tuple[int, int]], int]:
    """One adapted block's 4-bit base as ZeRO-3 shards it (parallel/dp/frozen.py): the buffers, as (elements,
    element size): the packed bytes (1/tp of them), and the quantization state per dtype (each block's scale, fp32 or
    with double quantization uint8; the 16-entry code books and the scales' scales, fp32); and the bytes kept whole
    (with double quantization each layer's 256-entry code book of the scales and its offset)."""
    sizes = [n_in * n_out for n_in, n_out, _ in adapted(shape)]
    blocks = [ceil_div(size, 64) for size in sizes]
    packed = sum(ceil_div(size, 2 * tp) for size in sizes)
    if shape.lora.backend == "torchao":  # int8 scales and fp32 factors sharded; a tp slice keeps its scales whole
        if tp > 1:
            return [(packed, 1)], sum(quantized_bytes(size, tp, True, "torchao") - ceil_div(size, 2 * tp)
                                      for size in sizes)
        return [(packed, 1), (sum(blocks), 1), (sum(ceil_div(b, 256) for b in blocks), 4)], NF4_WHOLE * len(sizes)
    if not shape.lora.double_quant:
        return [(packed, 1), (sum(blocks) + 16 * len(sizes), 4)], 0
    nested = sum(16 + ceil_div(b, 256) for b in blocks)
    return [(packed, 1), (sum(blocks), 1), (nested, 4)], (4 * 256 + 4) * len(sizes)


def four_bit_cut(shape, tp: int) -> str | None:
    """Why tp would cut a 4-bit block (64 values) of an adapted projection (None: every slice is whole blocks); with
    torchao's NF4 also why a projection cannot be quantized (a multiple of 16384 values), at any tp."""
    for n_in, n_out, _ in adapted(shape) if shape.lora.backend == "torchao" else ():
        if n_in * n_out % (64 * 256):
            return f"torchao's NF4 needs a multiple of 16384 values, and a projection has {n_in} x {n_out}"
    if tp == 1:
        return None
    for n_in, n_out, style in adapted(shape):
        whole = (n_out // tp * n_in) % 64 == 0 if style == "colwise" else (n_in // tp) % 64 == 0
        if not whole:
            return (f"tp={tp} cuts the 4-bit blocks of 64 values of a {style} projection ({n_in} in, {n_out} out)")
    return None


def projections(shape) -> dict[str, tuple[int, int, str]]:
    """{name: (in, out, "colwise" | "rowwise")} of one block's projections (TP plans of the families)."""
    h, f = shape.d_model, shape.d_ff
    if not shape.llama:
        return {"q": (h, h, "colwise"), "k": (h, h, "colwise"), "v": (h, h, "colwise"), "o": (h, h, "rowwise"),
                "fc": (h, f, "colwise"), "proj": (f, h, "rowwise")}
    hd = shape.config.head_dim
    q, kv = shape.n_head * hd, shape.n_kv_head * hd
    return {"q_proj": (h, q, "colwise"), "k_proj": (h, kv, "colwise"), "v_proj": (h, kv, "colwise"),
            "o_proj": (q, h, "rowwise"), "gate_proj": (h, f, "colwise"), "up_proj": (h, f, "colwise"),
            "down_proj": (f, h, "rowwise")}


def adapted(shape) -> list[tuple[int, int, str]]:
    """(in, out, style) of every adapted projection of one block."""
    shapes = projections(shape)
    return [shapes[name] for name in shape.lora.targets] if shape.lora else []


def layer_adapter_params(shape, tp: int = 1) -> int:
    """Adapter parameters of one block on one tp rank (the module note)."""
    r, dora, total = shape.lora.r, shape.lora.dora, 0
    for n_in, n_out, style in adapted(shape):
        if style == "colwise":
            total += r * n_in + r * n_out // tp + (n_out // tp if dora else 0)
        else:
            total += r * n_in // tp + r * n_out + (n_out if dora else 0)
    return total


def adapter_tp_transfers(shape, layout: Layout, blocks: int) -> list:
    """The adapters' tensor-parallel collectives of `blocks` adapted blocks per optimizer step (the module note)."""
    if layout.tp == 1 or not shape.lora or not blocks:
        return []
    m, e, p, r = layout.grad_accum, layout.activation_bytes, layout.param_bytes, shape.lora.r
    forwards = 2 if layout.recompute == "full" else 1
    bsr = layout.micro_batch * (shape.seq_len // layout.cp) * r
    col = [(n_in, n_out) for n_in, n_out, style in adapted(shape) if style == "colwise"]
    row = [(n_in, n_out) for n_in, n_out, style in adapted(shape) if style == "rowwise"]
    grads = sum(r * n_in for n_in, _ in col)  # column-parallel A, summed in every backward
    calls = len(col)
    out = []
    if layout.sequence_parallel:
        grads += sum(r * n_out + (n_out if shape.lora.dora else 0) for _, n_out in row)  # B and m on s/tp tokens
        calls += len(row) * (2 if shape.lora.dora else 1)
        out += [Transfer(("tp",), "reduce_scatter", m * blocks * len(row) * forwards * bsr, e,
                         m * blocks * len(row) * forwards, "tp"),
                Transfer(("tp",), "all_gather", m * blocks * len(row) * bsr, e, m * blocks * len(row), "tp")]
    else:
        out.append(Transfer(("tp",), "all_reduce", m * blocks * len(row) * forwards * bsr, e,
                            m * blocks * len(row) * forwards, "tp"))
    out.append(Transfer(("tp",), "all_reduce", m * blocks * grads, p, m * blocks * calls, "tp"))
    if shape.lora.dora and row:  # each forward's row norms of a row-parallel layer (the compute dtype)
        norms = sum(n_out for _, n_out in row)
        out.append(Transfer(("tp",), "all_reduce", m * blocks * forwards * norms, p,
                            m * blocks * forwards * len(row), "tp"))
    return out


def lora_units(shape, layout: Layout, stage: int, base: int) -> list[tuple[int, int, int]]:
    """(trainable, frozen, all-gathers per micro-batch) of each ZeRO-3 unit of a rank: its blocks (their adapters
    and base, gathered forward and backward) and the root (the rest of the base: embedding, final norm, head,
    gathered once)."""
    blocks = rank_blocks(shape, layout, stage)
    trainable, frozen = layer_adapter_params(shape, layout.tp), shape.layer_params(layout.tp)
    root = base - blocks * frozen
    if shape.lora.quantize:  # a block's 4-bit weights are buffers of their own (`four_bit_buffers`)
        frozen -= sum(n_in * n_out // layout.tp for n_in, n_out, _ in adapted(shape))
    return [(trainable, frozen, 2)] * blocks + ([(0, root, 1)] if root else [])


def lora_model_states(shape, layout: Layout, stage: int, base: int) -> ModelStates:
    """Model-state bytes of a rank with adapters: the adapters' states by the ZeRO stage's formula and the frozen
    `base` (this rank's parameters of the model) in the compute dtype, whole or, under ZeRO-3, one shard of each
    unit's padded frozen buffer."""
    n = layout.shard_group
    blocks = rank_blocks(shape, layout, stage)
    quantized, held = 0, 0
    if layout.zero_stage == 3:
        units = lora_units(shape, layout, stage, base)
        trainable = sum(ceil_div(t, n) * n for t, _, _ in units)
        frozen = sum(ceil_div(f, n) * n for _, f, _ in units)
        if shape.lora.quantize:  # each block's 4-bit buffers sharded beside its other frozen tensors
            buffers, whole = four_bit_buffers(shape, layout.tp)
            held = blocks * (sum(ceil_div(count, n) * size for count, size in buffers) + whole)
    else:
        trainable, frozen = blocks * layer_adapter_params(shape, layout.tp), base
        if shape.lora.quantize:  # the adapted bases in 4 bits, on the rank whole or split over tp
            sizes = [n_in * n_out for n_in, n_out, _ in adapted(shape)]
            quantized = blocks * sum(size // layout.tp for size in sizes)
            held = blocks * sum(quantized_bytes(size, layout.tp, shape.lora.double_quant, shape.lora.backend)
                                for size in sizes)
    states = model_state_bytes(trainable, n, layout.zero_stage, layout.precision, layout.offload_optimizer,
                               frozen_params=frozen - quantized)
    return states + ModelStates(held, 0, 0)
