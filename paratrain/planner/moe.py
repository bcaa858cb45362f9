"""Mixture of experts in the planner: expert parameters per rank, the ep all-to-all, the ep / edp wires.

Expert parallelism is folded inside dp x cp (`paratrain.layout.mesh.ParallelDims.expert_subgroups`): the members of
a dp x cp group, in mesh order, form ep groups of ep consecutive members (they split every MoE block's
experts, E/ep each, and exchange tokens) and edp groups of dp x cp / ep members (the same experts; expert
gradients are reduced, and ZeRO-sharded, over edp). Dense parameters (attention, norms, embeddings,
routers, shared experts) keep the dense treatment over dp x cp.

Token exchange, per MoE block and micro-batch (`paratrain.moe.exchange`): the forward's dispatch sends each
routed row (d_model elements) to the rank holding its expert and the combine sends it back; the backward
does both again. With uniform routing the fraction (ep - 1)/ep of a rank's T k routed rows leaves it each
time, so per optimizer step and rank (`all_to_all_elements`)

    elements = 4 (ep - 1)/ep * tokens_per_rank * top_k * d_model * n_moe_layers(stage)
    tokens_per_rank = micro_batch * seq_len / cp (/ tp under sequence parallelism) * micro-batches

(6 instead of 4 under full recompute: the forward's two exchanges run again). The forward also all-to-alls
each block's (E,) int64 per-expert row counts, (ep - 1)/ep of them leaving the rank (`count_elements`).
"""

from __future__ import annotations

from paratrain.planner.layout import V_SCHEDULES, Layout
from paratrain.planner.model_shape import ModelShape
from paratrain.planner.stages import rank_blocks, stage_layers


def dense_blocks(shape: ModelShape, layout: Layout, rank: int) -> int:
    """Blocks of a pp rank with a dense MLP: all of them for a dense model; for an MoE model those of the first
    n_dense_layers blocks it holds. Exact for the loop placement with one chunk per rank; under interleaving
    and the V schedules the dense blocks are counted from rank 0 on (its first chunk holds the first blocks)."""
    if not shape.moe:
        return rank_blocks(shape, layout, rank)
    n_dense = shape.n_dense_layers
    if layout.schedule not in V_SCHEDULES and layout.virtual_stages == 1:
        sizes = stage_layers(shape.n_layer, layout.pp)
        start = sum(sizes[:rank])
        return max(0, min(n_dense, start + sizes[rank]) - start)
    before = sum(rank_blocks(shape, layout, r) for r in range(rank))
    return max(0, min(n_dense - before, rank_blocks(shape, layout, rank)))


def moe_blocks(shape: ModelShape, layout: Layout, rank: int) -> int:
    """Blocks of a pp rank with an MoE MLP."""
    return rank_blocks(shape, layout, rank) - dense_blocks(shape, layout, rank)


def rank_expert_params(shape: ModelShape, layout: Layout, stage: int) -> int:
    """Routed-expert parameters a rank of pipeline stage `stage` holds: E/ep experts of each of its MoE
    blocks (0 for a dense model)."""
    return moe_blocks(shape, layout, stage) * shape.expert_block_params(layout.ep)


def routed_tokens(shape: ModelShape, layout: Layout) -> int:
    """Tokens of one micro-batch an MoE block routes on a rank: b s / cp, and / tp under sequence parallelism
    (the MoE MLP runs whole on every tp rank, on its s/tp tokens with SP, on all of them without)."""
    tokens = layout.micro_batch * (shape.seq_len // layout.cp)
    return tokens // layout.tp if layout.sequence_parallel else tokens


def exchange_passes(layout: Layout) -> int:
    """All-to-all exchanges (dispatch or combine) of a block per micro-batch: forward 2, backward 2, and the
    forward's 2 again under full recompute."""
    return 6 if layout.recompute == "full" else 4


def all_to_all_elements(shape: ModelShape, layout: Layout, stage: int) -> int:
    """Token-row elements that leave a rank of `stage` over ep per optimizer step (see the module doc):
    exchange_passes * (ep - 1)/ep * tokens_per_rank * top_k * d_model * n_moe_layers."""
    if layout.ep == 1:
        return 0
    rows = routed_tokens(shape, layout) * shape.top_k  # one micro-batch's routed rows of one block
    leaving = rows * (layout.ep - 1) // layout.ep
    return exchange_passes(layout) * layout.grad_accum * moe_blocks(shape, layout, stage) * leaving * shape.d_model


def count_elements(shape: ModelShape, layout: Layout, stage: int) -> int:
    """The int64 per-expert row counts the forward all-to-alls per block and micro-batch (again under full
    recompute): (ep - 1)/ep of E."""
    if layout.ep == 1:
        return 0
    forwards = 2 if layout.recompute == "full" else 1
    leaving = shape.num_experts // layout.ep * (layout.ep - 1)
    return forwards * layout.grad_accum * moe_blocks(shape, layout, stage) * leaving


def moe_mlp_activations(shape: ModelShape, layout: Layout) -> float:
    """Bytes one MoE block's MLP keeps for backward per micro-batch (in place of the dense MLP's term of
    `memory.layer_activations`), on T = `routed_tokens` tokens, activation dtype e:
      e (4 T k d_expert + 4 T shared d_expert)   the SwiGLU intermediates of the routed and shared experts
      e 2 T k h                                  the dispatched input rows and the expert output rows
      8 T E                                      the router's fp32 logits and probabilities
    Not calibrated against measured runs (like the Llama's activations)."""
    if not shape.moe:
        return 0.0
    e, t = layout.activation_bytes, routed_tokens(shape, layout)
    cfg = shape.config
    swiglu = shape.mlp_intermediates * t * (shape.top_k + cfg.shared_experts) * cfg.d_expert
    return e * (swiglu + 2 * t * shape.top_k * shape.d_model) + 8 * t * shape.num_experts

