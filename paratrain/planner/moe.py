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
from paratrain.planner.model_specs import ModelSpec
from paratrain.planner.stages import rank_blocks, stage_layers


def dense_blocks(spec: ModelSpec, layout: Layout, rank: int) -> int:
    """Blocks of a pp rank with a dense MLP: all of them for a dense model; for an MoE model those of the first
    n_dense_layers blocks it holds. Exact for the loop placement with one chunk per rank; under interleaving
    and the V schedules the dense blocks are counted from rank 0 on (its first chunk holds the first blocks)."""
    if not spec.moe:
        return rank_blocks(spec, layout, rank)
    n_dense = spec.n_dense_layers
    if layout.schedule not in V_SCHEDULES and layout.virtual_stages == 1:
        sizes = stage_layers(spec.n_layer, layout.pp)
        start = sum(sizes[:rank])
        return max(0, min(n_dense, start + sizes[rank]) - start)
    before = sum(rank_blocks(spec, layout, r) for r in range(rank))
    return max(0, min(n_dense - before, rank_blocks(spec, layout, rank)))


def moe_blocks(spec: ModelSpec, layout: Layout, rank: int) -> int:
    """Blocks of a pp rank with an MoE MLP."""
    return rank_blocks(spec, layout, rank) - dense_blocks(spec, layout, rank)


def rank_expert_params(spec: ModelSpec, layout: Layout, stage: int) -> int:
    """Routed-expert parameters a rank of pipeline stage `stage` holds: E/ep experts of each of its MoE
    blocks (0 for a dense model)."""
    return moe_blocks(spec, layout, stage) * spec.expert_block_params(layout.ep)


def routed_tokens(spec: ModelSpec, layout: Layout) -> int:
    """Tokens of one micro-batch an MoE block routes on a rank: b s / cp, and / tp under sequence parallelism
    (the MoE MLP runs whole on every tp rank, on its s/tp tokens with SP, on all of them without)."""
    tokens = layout.micro_batch * (spec.seq_len // layout.cp)
    return tokens // layout.tp if layout.sequence_parallel else tokens


def exchange_passes(layout: Layout) -> int:
    """All-to-all exchanges (dispatch or combine) of a block per micro-batch: forward 2, backward 2, and the
    forward's 2 again under full recompute."""
    return 6 if layout.recompute == "full" else 4


def all_to_all_elements(spec: ModelSpec, layout: Layout, stage: int) -> int:
    """Token-row elements that leave a rank of `stage` over ep per optimizer step (see the module doc):
    exchange_passes * (ep - 1)/ep * tokens_per_rank * top_k * d_model * n_moe_layers."""
    if layout.ep == 1:
        return 0
    rows = routed_tokens(spec, layout) * spec.top_k  # one micro-batch's routed rows of one block
    leaving = rows * (layout.ep - 1) // layout.ep
    return exchange_passes(layout) * layout.grad_accum * moe_blocks(spec, layout, stage) * leaving * spec.d_model


def count_elements(spec: ModelSpec, layout: Layout, stage: int) -> int:
    """The int64 per-expert row counts the forward all-to-alls per block and micro-batch (again under full
    recompute): (ep - 1)/ep of E."""
    if layout.ep == 1:
        return 0
    forwards = 2 if layout.recompute == "full" else 1
    leaving = spec.num_experts // layout.ep * (layout.ep - 1)
    return forwards * layout.grad_accum * moe_blocks(spec, layout, stage) * leaving


def moe_mlp_activations(spec: ModelSpec, layout: Layout) -> float:
    """Bytes one MoE block's MLP keeps for backward per micro-batch (in place of the dense MLP's term of
    `memory.layer_activations`), on T = `routed_tokens` tokens, activation dtype e:
      e (4 T k d_expert + 4 T shared d_expert)   the SwiGLU intermediates of the routed and shared experts
      e 2 T k h                                  the dispatched input rows and the expert output rows
      8 T E                                      the router's fp32 logits and probabilities
    Not calibrated against measured runs (like the Llama's activations)."""
    if not spec.moe:
        return 0.0
    e, t = layout.activation_bytes, routed_tokens(spec, layout)
    cfg = spec.config
    swiglu = spec.mlp_intermediates * t * (spec.top_k + cfg.shared_experts) * cfg.d_expert
    return e * (swiglu + 2 * t * spec.top_k * spec.d_model) + 8 * t * spec.num_experts

