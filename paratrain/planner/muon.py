"""Muon in the planner: which parameters it updates (the blocks' 2-d weights, `paratrain.muon`; norms, biases,
embeddings and the head stay on AdamW). Its state (one fp32 buffer per element, `memory.rank_model_states`) and
collectives (`comm.muon_transfers`) are counted from these."""

from __future__ import annotations

from paratrain.planner.layout import Layout
from paratrain.planner.model_specs import ModelSpec, PlannerError
from paratrain.planner.moe import dense_blocks


def layer_matrix_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """The whole (rows, columns) of each 2-d weight of a dense block, what Muon orthogonalizes. All are split over
    tp (q, k, v and the MLP's input side by rows, o and the MLP's output side by columns)."""
    h, f = spec.d_model, spec.d_ff
    if spec.llama:
        q, kv = spec.n_head * spec.config.head_dim, spec.n_kv_head * spec.config.head_dim
        return [(q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)]
    return [(h, h)] * 4 + [(f, h), (h, f)]


def layer_matrix_params(spec: ModelSpec, tp: int = 1) -> int:
    """The part of `ModelSpec.layer_params` Muon takes on one tp rank."""
    return sum(rows * columns for rows, columns in layer_matrix_shapes(spec)) // tp


def muon_params(spec: ModelSpec, layout: Layout, stage: int) -> int:
    """Of `memory.rank_params`, the parameters Muon updates under `layout.optimizer == "muon"` (0 otherwise). Muon
    and AdamW parameters are separate param groups, so separate flat buffers (each padded) under ZeRO."""
    if layout.optimizer != "muon":
        return 0
    if spec.moe:
        raise PlannerError("the planner does not model Muon on a mixture-of-experts model yet; plan it with AdamW "
                           "(its Muon state is one fp32 buffer per matrix element instead of AdamW's two)")
    return dense_blocks(spec, layout, stage) * layer_matrix_params(spec, layout.tp)
