"""Communication per optimizer step for one rank, per mesh axis and collective, in paratrain.comm's units.

The payload of each entry is counted exactly as `paratrain.comm.CommStats` counts it — the full tensor of
an all-reduce, the gathered output of an all-gather, the unreduced input of a reduce-scatter, the message
of a send or a recv — and keyed by the axis names `build_mesh` gives, so `by_axis(...)` can be compared
with `engine.comm_stats()` for equality. Size-1 groups are skipped, as paratrain.comm skips them.

Per optimizer step (Psi = parameters of this rank's model piece, padded to a multiple of N = dp x cp for
ZeRO's flat shards; m = micro-batches per step; b s h = one micro-batch's activation, s local to cp):
  DDP          all-reduce Psi                                    (dp x cp)
  ZeRO-1       reduce-scatter Psi + all-gather Psi               (dp x cp)
  ZeRO-2       reduce-scatter Psi per micro-batch + all-gather Psi
  ZeRO-3       per micro-batch: each block's unit all-gathered twice (forward, backward), the root unit
               (embedding, final norm, head) once (it stays gathered from its forward through its backward),
               and every unit reduce-scattered; each unit's flat buffer padded to a multiple of N. Small
               parameters kept whole (stage3_param_persistence_threshold) are counted in their unit.
  TP           per layer per micro-batch: 2 all-reduces of b s h forward + 2 backward (+2 forward again
               under full recompute); with SP 4 all-gathers + 4 reduce-scatters of b s h instead (the same
               bytes on the wire), and the layer norms' gradients all-reduced in every backward; the
               vocab-parallel embedding all-reduces its b s h output (with SP the split to s/tp follows, its
               gradient all-gathered), the column-parallel head's input gradient is one more b s h (an
               all-gather and a reduce-scatter with SP), the vocab-parallel loss three fp32 b s vectors (max,
               sum of exponentials, target logit)
  PP           per micro-batch and boundary the rank touches: b s h (/tp with SP) sent forward and its
               gradient sent backward, as send and recv
  CP (ring)    per layer per micro-batch: (cp - 1) exchanges of this rank's K and V blocks forward, and of
               K, V, dK, dV backward (send and recv each); the forward exchanges again under full and
               selective recompute (ring attention is the recomputed attention core)
  CP (Ulysses) per layer per micro-batch: four all-to-alls forward (q, k, v to head shards, the output back)
               and four backward, each moving (u - 1)/u of the local tensor (`ulysses_elements`); the forward
               ones again under recompute. USP: ring over cp / u ranks and Ulysses over u, on the sub-axes
               cp_ring and cp_ulysses
  EP           per MoE block per micro-batch: the routed token rows to their experts' ranks and back, forward
               and backward, (ep - 1)/ep of the T k rows leaving the rank each time (`moe.all_to_all_elements`),
               and the forward's int64 per-expert counts, as all-to-alls on the ep sub-axis of dp x cp
  experts      the routed experts' gradients reduced (and ZeRO-sharded / gathered) over the edp sub-axis
               (dp x cp / ep ranks holding the same experts) with the formulas above; DDP/ZeRO over dp x cp
               covers the other (dense) parameters only
Bookkeeping scalars are listed too (the global mean loss of `train_batch`, the grad-norm sums), so a
prediction can equal a measurement exactly.
"""

from __future__ import annotations

from collections import defaultdict

from paratrain.layout.dims import ParallelDims
from paratrain.planner.adapters import adapter_tp_transfers, four_bit_buffers, lora_units
from paratrain.planner.layout import Layout, axis_name
from paratrain.planner.memory import rank_params, zero3_units
from paratrain.planner.model_shape import ModelShape
from paratrain.planner.moe import all_to_all_elements, count_elements, dense_blocks, moe_blocks, rank_expert_params
from paratrain.planner.muon import layer_matrix_params, muon_params, muon_transfers
from paratrain.planner.stages import rank_blocks
from paratrain.planner.states import ceil_div
from paratrain.planner.transfer import DP_CP, SHARD, Transfer


def data_parallel_transfers(layout: Layout, params: int, units: list[tuple[int, int]] | None = None,
                            dim: str | None = None) -> list[Transfer]:
    """Gradient reductions (and ZeRO's gathers) of `params`: DDP over dp x cp, ZeRO over its shard group
    (`SHARD`) and, under HSDP, each gradient shard summed over the replicas once a step (`replica_sums`); the
    routed experts over `dim` = edp."""
    dim = dim or (DP_CP[0] if layout.zero_stage == 0 else SHARD[0])
    n, m, size, on = layout.dims.size(dim), layout.grad_accum, layout.param_bytes, (dim,)
    if params == 0:
        return []
    if layout.zero_stage == 0:
        return [Transfer(on, "all_reduce", params, size, 1, "dp_grad")] if n > 1 else []
    padded = ceil_div(params, n) * n
    if layout.zero_stage == 1:  # the reduced slice of the gradient bucket, in the compute dtype
        return [Transfer(on, "reduce_scatter", padded, size, 1, "dp_grad"),
                Transfer(on, "all_gather", padded, size, 1, "dp_param")] + replica_sums(layout, [padded // n], size)
    if layout.zero_stage == 2:
        m = 1 if layout.partial_backwards else m  # then once per step (Layout.partial_backwards)
        return [Transfer(on, "reduce_scatter", m * padded, size, m, "dp_grad"),
                Transfer(on, "all_gather", padded, size, 1, "dp_param")] + replica_sums(layout, [padded // n])
    units = units if units is not None else [(params, 2)]
    gathered = sum(ceil_div(p, n) * n * times for p, times in units)
    reduced = sum(ceil_div(p, n) * n for p, _ in units)
    gathers = sum(times for _, times in units)
    return [Transfer(on, "all_gather", m * gathered, size, m * gathers, "zero3_param"),
            Transfer(on, "reduce_scatter", m * reduced, size, m * len(units), "dp_grad")] + \
        replica_sums(layout, [ceil_div(p, n) for p, _ in units])


def replica_sums(layout: Layout, shards: list[int], element_size: int = 4) -> list[Transfer]:
    """HSDP: each gradient shard (fp32 masters' gradients; ZeRO-1: the reduced bucket slice) all-reduced over the
    replicas once a step, after the backward (exposed)."""
    if layout.dp_replicate == 1 or not shards:
        return []
    return [Transfer(("dp_replicate",), "all_reduce", sum(shards), element_size, len(shards), "dp_replicate")]


def four_bit_gathers(shape: ModelShape, layout: Layout, block_gathers: list[int]) -> list[Transfer]:
    """ZeRO-3 over a 4-bit base: each block's 4-bit buffers (`four_bit_buffers`), gathered with the block."""
    if not (shape.lora and shape.lora.quantize):
        return []
    n, (buffers, _) = layout.shard_group, four_bit_buffers(shape, layout.tp)
    return [Transfer(SHARD, "all_gather", sum(block_gathers) * ceil_div(count, n) * n, size, sum(block_gathers),
                     "zero3_param") for count, size in buffers]


def lora_data_transfers(shape: ModelShape, layout: Layout, stage: int) -> list[Transfer]:
    """With adapters (planner/adapters.py) the reductions move the trainable adapters only. ZeRO-3 gathers each
    unit's frozen and trainable buffers (padded apart) and reduce-scatters the trainable ones; a root holding only
    frozen tensors is never freed by a backward, so it is gathered once per step, not per micro-batch."""
    units = lora_units(shape, layout, stage, rank_params(shape, layout, stage))
    n, m, size = layout.shard_group, layout.grad_accum, layout.param_bytes
    if layout.zero_stage < 3 or n == 1:
        return data_parallel_transfers(layout, sum(t for t, _, _ in units))
    padded = [((ceil_div(t, n) + ceil_div(f, n)) * n, times, t) for t, f, times in units]
    gathered = sum(p * times * (m if t else 1) for p, times, t in padded)
    reduced = [ceil_div(t, n) * n for t, _, _ in units if t]
    return [Transfer(SHARD, "all_gather", gathered, size, sum(times * (m if t else 1) for _, times, t in padded),
                     "zero3_param"), *four_bit_gathers(shape, layout, [times * m for t, _, times in units if t]),
            Transfer(SHARD, "reduce_scatter", m * sum(reduced), size, m * len(reduced), "dp_grad")] + \
        replica_sums(layout, [r // n for r in reduced])


def expert_parallel_transfers(shape: ModelShape, layout: Layout, stage: int) -> list[Transfer]:
    """The ep all-to-alls (token rows, and the forward's per-expert counts) and the routed experts' gradient
    reduction over edp (under ZeRO-3 one unit per MoE block: E/ep experts, gathered forward and backward)."""
    if not shape.moe:
        return []
    blocks, m = moe_blocks(shape, layout, stage), layout.grad_accum
    forwards = 2 if layout.recompute == "full" else 1
    out = [Transfer(("ep",), "all_to_all", all_to_all_elements(shape, layout, stage), layout.activation_bytes,
                    2 * (forwards + 1) * m * blocks, "ep"),
           Transfer(("ep",), "all_to_all", count_elements(shape, layout, stage), 8, forwards * m * blocks, "ep")]
    if layout.ep == 1:  # edp is dp x cp: the experts are reduced with the dense parameters
        return out
    units = [(shape.expert_block_params(layout.ep), 2)] * blocks if layout.zero_stage == 3 else None
    return out + data_parallel_transfers(layout, rank_expert_params(shape, layout, stage), units, "edp")


def tensor_parallel_transfers(shape: ModelShape, layout: Layout, stage: int) -> list[Transfer]:
    if layout.tp == 1:
        return []
    m, e = layout.grad_accum, layout.activation_bytes
    layers = rank_blocks(shape, layout, stage)
    s_local = shape.seq_len // layout.cp
    bsh = layout.micro_batch * s_local * shape.d_model
    per_layer = 6 if layout.recompute == "full" else 4  # collectives of b s h per layer (see module doc)
    first, last = stage == 0, stage == layout.head_rank
    # Through adapters the embedding is frozen: its output needs no gradient, so the first block's region entry
    # (and, with SP, the embedding's split to s/tp) skips its backward collective; the norms, frozen, sum none.
    frozen_input = int(shape.lora is not None and first)
    out = []
    if layout.sequence_parallel:
        # Each all-reduce becomes an all-gather + a reduce-scatter; the embedding's all-reduced output is
        # split to s/tp (its gradient gathered), the head's input gathered (its gradient scattered).
        gathers = layers * per_layer + int(first) + int(last) - frozen_input
        scatters = layers * per_layer + int(last) - frozen_input
        out += [Transfer(("tp",), "all_gather", m * gathers * bsh, e, m * gathers, "tp"),
                Transfer(("tp",), "reduce_scatter", m * scatters * bsh, e, m * scatters, "tp")]
        if first:
            out.append(Transfer(("tp",), "all_reduce", m * bsh, e, m, "tp"))
        # Layer norms are replicated but see different tokens under SP: their gradients are summed over tp,
        # in every backward (the sum is an autograd op on the parameter).
        norm_grads = layers * shape.layernorm_params_per_layer() + (shape.final_norm_params() if last else 0)
        calls = layers * 4 + (2 if last else 0)
        if shape.lora is None:
            out.append(Transfer(("tp",), "all_reduce", m * norm_grads, layout.param_bytes, m * calls, "tp"))
    else:
        # A MoE block's MLP stays whole on every tp rank (its plan marks it 'sequence'): only its attention's
        # half of a layer's all-reduces. (Under sequence parallelism that block is not calibrated.)
        moe = moe_blocks(shape, layout, stage) if shape.moe else 0
        reduces = (layers - moe) * per_layer + moe * per_layer // 2 + int(first) + int(last) - frozen_input
        out.append(Transfer(("tp",), "all_reduce", m * reduces * bsh, e, m * reduces, "tp"))
    if last:  # vocab-parallel cross-entropy: max, sum of exponentials, target logit, per token, fp32
        out.append(Transfer(("tp",), "all_reduce", m * 3 * layout.micro_batch * s_local, 4, 3 * m, "tp"))
    return out


def pipeline_transfers(shape: ModelShape, layout: Layout, stage: int) -> list[Transfer]:
    """Sends and receives of rank `stage`: it holds virtual stages stage, stage + p, ... (v of them), or
    stage and 2p - 1 - stage under a V schedule."""
    p, v, m = layout.pp, layout.virtual_stages, layout.grad_accum
    if p == 1:
        return []
    message = layout.micro_batch * (shape.seq_len // layout.cp) * shape.d_model
    if layout.sequence_parallel:
        message //= layout.tp
    held = layout.stages_held(stage)
    last = p * v - 1
    # activations forward, gradients back, over every boundary that is not inside this rank (a V's bottom)
    sends = sum(k < last and k + 1 not in held for k in held) + sum(k > 0 and k - 1 not in held for k in held)
    recvs = sends
    e = layout.activation_bytes
    return [Transfer(("pp",), "send", m * sends * message, e, m * sends, "pp"),
            Transfer(("pp",), "recv", m * recvs * message, e, m * recvs, "pp")]


def context_parallel_transfers(shape: ModelShape, layout: Layout, stage: int) -> list[Transfer]:
    """Ring attention over the ring degree, Ulysses' all-to-alls over the Ulysses degree (USP: both, on the
    cp_ring and cp_ulysses sub-axes; ring or ulysses alone: on cp)."""
    if layout.cp == 1:
        return []
    usp = layout.cp_method == "usp"
    c, u = layout.ring_degree, layout.ulysses_degree
    m, e = layout.grad_accum, layout.activation_bytes
    layers = rank_blocks(shape, layout, stage)
    forward_passes = 1 if layout.recompute == "none" else 2  # full and selective both recompute the core
    out = []
    if c > 1:
        block = layout.micro_batch * (shape.seq_len // layout.cp) * shape.d_model // layout.tp  # one K (or V) block
        per_layer = (c - 1) * block * (2 * forward_passes + 4)  # K, V per forward; K, V, dK, dV backward
        calls = (c - 1) * (2 * forward_passes + 4)
        ring = ("cp_ring",) if usp else ("cp",)
        out += [Transfer(ring, "send", m * layers * per_layer, e, m * layers * calls, "cp"),
                Transfer(ring, "recv", m * layers * per_layer, e, m * layers * calls, "cp")]
    if u > 1:
        out.append(Transfer(("cp_ulysses",) if usp else ("cp",), "all_to_all",
                            m * layers * (forward_passes + 1) * ulysses_elements(shape, layout),
                            e, m * layers * 4 * (forward_passes + 1), "cp"))
    return out


def ulysses_elements(shape: ModelShape, layout: Layout) -> int:
    """Elements that leave a rank in one pass of Ulysses' four all-to-alls (q, k, v in, the output back; the
    backward's transposes move as much): each local (b, heads, s/cp, head_dim) tensor but the 1/u it keeps.
    k and v carry their own heads, or q's when the size does not divide them (expanded first)."""
    u = layout.ulysses_degree
    heads, kv = shape.n_head // layout.tp, shape.n_kv_head // layout.tp
    kv = kv if kv % u == 0 else heads
    local = layout.micro_batch * (shape.seq_len // layout.cp) * (shape.d_model // shape.n_head)
    return local * (2 * heads + 2 * kv) * (u - 1) // u


def scalar_transfers(shape: ModelShape, layout: Layout, stage: int = 0) -> list[Transfer]:
    """The scalars of a step: the token-weighted loss's sum and target count over dp x cp (two fp64; from the
    last pipeline stage to every pp rank first: sum, weight and two flags, four fp64), the squared grad norm
    summed over the world (one fp32; fp16's overflow shows in that norm, so it adds nothing; none for DDP on a
    world of data parallelism only, where every rank holds the whole gradient). A step that
    reports MoE routing (a monitor on, a steps_per_print step) adds `routing_transfer`; the others do not
    reduce it."""
    out = [Transfer(DP_CP, "all_reduce", 2, 8, 1, "scalar")]
    shards = layout.zero_stage == 3 or (layout.zero_stage > 0 and layout.shard_group > 1)  # GradSync's
    if shards or layout.world > layout.dp * layout.cp or layout.ep > 1:
        out.append(Transfer(("world",), "all_reduce", 1, 4, 1, "scalar"))
    if layout.pp > 1:
        out.append(Transfer(("pp",), "all_reduce", 4, 8, 1, "scalar"))
    return out


def routing_transfer(shape: ModelShape, layout: Layout, stage: int = 0) -> Transfer:
    """The MoE blocks' routing totals over dp x cp on a reporting step (per block: the E expert counts, the two
    router losses, dropped choices and forwards, in fp64)."""
    blocks = moe_blocks(shape, layout, stage)
    return Transfer(DP_CP, "all_reduce", blocks * (shape.num_experts + 4), 8, 1, "scalar")


def data_transfers(shape: ModelShape, layout: Layout, stage: int = 0) -> list[Transfer]:
    """Gradient reductions and ZeRO's gathers of the dense parameters (of the adapters when they train)."""
    if shape.lora is not None:  # adapters train, the base is frozen
        return lora_data_transfers(shape, layout, stage) + \
            adapter_tp_transfers(shape, layout, rank_blocks(shape, layout, stage))
    units = zero3_units(shape, layout, stage) if layout.zero_stage == 3 else None
    dense = rank_params(shape, layout, stage) + (rank_expert_params(shape, layout, stage) if layout.ep == 1 else 0)
    matrices = muon_params(shape, layout, stage)  # Muon's group and AdamW's rest: flat buffers padded apart
    block, blocks = layer_matrix_params(shape, layout.tp) if matrices else 0, dense_blocks(shape, layout, stage)
    rest_units = [(p - block, t) if t == 2 else (p, t) for p, t in units] if units is not None else None
    return data_parallel_transfers(layout, dense - matrices, rest_units) + muon_transfers(shape, layout, stage) + \
        data_parallel_transfers(layout, matrices, [(block, 2)] * blocks if units is not None else None)


TRANSFER_SOURCES = (data_transfers, tensor_parallel_transfers, pipeline_transfers, context_parallel_transfers,
                    expert_parallel_transfers, scalar_transfers)


def rank_transfers(shape: ModelShape, layout: Layout, stage: int = 0) -> list[Transfer]:
    """Everything a rank of pipeline stage `stage` communicates in one optimizer step (`train_batch`)."""
    return [t for source in TRANSFER_SOURCES for t in source(shape, layout, stage)  # each source costed apart by
            if axis_name(layout.dims, t.axes) is not None and t.elements > 0]  # the search (search.py), same order


def by_axis(transfers: list[Transfer], dims: ParallelDims) -> dict[str, dict[str, dict[str, int]]]:
    """{axis name: {op: {elements, bytes}}}: `engine.comm_stats()` without the call counts."""
    out: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)
    for t in transfers:
        name = dims.axis_name(t.axes)
        if name is None:
            continue
        entry = out[name].setdefault(t.op, {"elements": 0, "bytes": 0})
        entry["elements"] += t.elements
        entry["bytes"] += t.bytes
    return dict(out)


def predict_comm(shape: ModelShape, layout: Layout, stage: int = 0) -> dict[str, dict[str, dict[str, int]]]:
    return by_axis(rank_transfers(shape, layout, stage), layout.dims)


def measured_without_calls(snapshot: dict) -> dict[str, dict[str, dict[str, int]]]:
    """Drop the call counts of an `engine.comm_stats()` snapshot (bucketing changes calls, not bytes)."""
    return {axis: {op: {"elements": c["elements"], "bytes": c["bytes"]} for op, c in ops.items()}
            for axis, ops in snapshot.items()}
