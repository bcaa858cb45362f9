"""Muon in the planner: which parameters it updates (the blocks' 2-d weights, `paratrain.muon`; norms, biases,
embeddings and the head stay on AdamW). Its state (one fp32 buffer per element, `memory.rank_model_states`) and
collectives (`muon_transfers`) are counted from these."""

from __future__ import annotations

from paratrain.planner.layout import Layout
from paratrain.planner.model_shape import ModelShape, PlannerError
from paratrain.planner.moe import dense_blocks
from paratrain.planner.states import ceil_div
from paratrain.planner.transfer import SHARD, Transfer


def layer_matrix_shapes(shape: ModelShape) -> list[tuple[int, int]]:
    """The whole (rows, columns) of each 2-d weight of a dense block, what Muon orthogonalizes. All are split over
    tp (q, k, v and the MLP's input side by rows, o and the MLP's output side by columns)."""
    h, f = shape.d_model, shape.d_ff
    if shape.llama:
        q, kv = shape.n_head * shape.config.head_dim, shape.n_kv_head * shape.config.head_dim
        return [(q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)]
    return [(h, h)] * 4 + [(f, h), (h, f)]


def layer_matrix_params(shape: ModelShape, tp: int = 1) -> int:
    """The part of `ModelShape.layer_params` Muon takes on one tp rank."""
    return sum(rows * columns for rows, columns in layer_matrix_shapes(shape)) // tp


def muon_params(shape: ModelShape, layout: Layout, stage: int) -> int:
    """Of `memory.rank_params`, the parameters Muon updates under `layout.optimizer == "muon"` (0 otherwise). Muon
    and AdamW parameters are separate param groups, so separate flat buffers (each padded) under ZeRO."""
    if layout.optimizer != "muon":
        return 0
    if shape.moe:
        raise PlannerError("the planner does not model Muon on a mixture-of-experts model yet; plan it with AdamW "
                           "(its Muon state is one fp32 buffer per matrix element instead of AdamW's two)")
    return dense_blocks(shape, layout, stage) * layer_matrix_params(shape, layout.tp)


def muon_transfers(shape: ModelShape, layout: Layout, stage: int) -> list[Transfer]:
    """Muon's collectives (`paratrain.muon.layout`), fp32: under ZeRO each flat buffer of its matrices (per ZeRO-1/2
    group, per ZeRO-3 block) all-gathers the update and reduce-scatters the orthogonalized one over dp x cp; a
    tp-split matrix is all-gathered over tp by who orthogonalizes it (all under DDP; its owner under ZeRO: there,
    with tp > 1, the mean over the dp x cp ranks)."""
    matrices = muon_params(shape, layout, stage)
    if not matrices:
        return []
    out, n, blocks = [], layout.shard_group, dense_blocks(shape, layout, stage)
    if layout.zero_stage >= 1 and n > 1:
        flats = [layer_matrix_params(shape, layout.tp)] * blocks if layout.zero_stage == 3 else [matrices]
        padded = sum(ceil_div(p, n) * n for p in flats)
        out += [Transfer(SHARD, "all_gather", padded, 4, len(flats), "dp_param"),
                Transfer(SHARD, "reduce_scatter", padded, 4, len(flats), "dp_grad")]
    if layout.tp > 1:
        whole = blocks * layer_matrix_params(shape)  # each whole matrix, gathered from its tp slices
        share = n if layout.zero_stage >= 1 else 1
        calls = blocks * len(layer_matrix_shapes(shape)) // share
        out.append(Transfer(("tp",), "all_gather", whole // share, 4, calls, "tp"))
    return out
