"""Predicted time of one optimizer step: compute + exposed communication per axis + pipeline bubble.

  t_mb      one micro-batch forward+backward on the slowest stage: micro_batch_overhead +
            FLOPs / (peak * mfu), FLOPs = tokens * (6 * stage parameters + 12 h s per layer) / (tp cp)
            (+ one more forward of the layers under full recompute, of attention under selective, and an
            objective's reference forward: planner/reference.py),
            plus the tensor-parallel collectives (on the critical path), whatever ring-attention
            traffic the attention compute does not hide, and Ulysses' all-to-alls (on the path).
            MoE: a block's matmul FLOPs are those of its active parameters (top_k routed experts); the MoE
            MLP runs whole on every tp rank (tp times over without sequence parallelism); the ep
            all-to-alls (dispatch and combine) are on the critical path, on the ep groups' wires
  pipeline  (m + bubble) * t_mb, bubble = p - 1 (GPipe, 1F1B), (p - 1)/v (interleaved),
            (p - 1)/3 (ZB-H1, Qi et al. 2024: F, B and W each a third of t_mb and only F + B - W idle),
            (p - 1)/6 (ZB-V: the same p - 1 slots, of chunks half a stage), (p - 1)/3 (DualPipeV, DeepSeek's
            (PP/2 - 1)(F&B + B - 3W) with PP = 2p chunks and F&B = F + B: no overlap credited)
            plus 2 (m v + p - 1) point-to-point messages on the critical path
  data par. gradient reductions overlap the backward of the micro-batch that produces them (the last
            one for DDP/ZeRO-1, each for ZeRO-2/3); ZeRO-1/2's parameter all-gather after the step is
            exposed; ZeRO-3's gathers overlap the forward/backward they feed (prefetch); the routed
            experts' reductions run over edp with the same overlap rules
  optimizer AdamW is memory-bound: 28 bytes read+written per updated parameter at memory bandwidth
            (on the host, plus gradients down and parameters up over PCIe, when offloaded)
Collective times are the ring alpha-beta model of `hardware.collective_seconds`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from paratrain.planner.adapters import layer_adapter_params
from paratrain.planner.comm import Transfer, rank_transfers
from paratrain.planner.hardware import Hardware, axis_bandwidth, collective_seconds, measured_seconds
from paratrain.planner.layout import Layout, axis_name
from paratrain.planner.memory import rank_params
from paratrain.planner.model_shape import ModelShape
from paratrain.planner.moe import dense_blocks, moe_blocks, rank_expert_params
from paratrain.planner.reference import reference_forward_flops_per_token
from paratrain.planner.stages import rank_blocks
from paratrain.planner.states import ceil_div

OPTIMIZER_BYTES_PER_PARAM = 28  # AdamW reads p, g, m, v and writes p, m, v (fp32 or 16-bit + fp32 master)


@dataclass(frozen=True)
class TimeEstimate:
    compute: float
    bubble: float
    comm: dict[str, float] = field(default_factory=dict)  # exposed seconds per axis name
    optimizer: float = 0.0
    offload: float = 0.0
    tokens: int = 0
    model_flops: float = 0.0  # 6N + attention per token, times tokens (no recompute)
    world: int = 1

    @property
    def total(self) -> float:
        return step_total(self.compute, self.bubble, self.comm, (self.optimizer, self.offload))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total

    def mfu(self, peak_flops: float) -> float:
        return self.model_flops / (self.total * self.world * peak_flops)


def step_total(compute: float, bubble: float, comm: dict[str, float], update: tuple[float, float]) -> float:
    """`TimeEstimate.total` of its parts (the search ranks by it before it builds the estimates)."""
    return compute + bubble + sum(comm.values()) + update[0] + update[1]


def bubble_factor(layout: Layout) -> float:
    """Idle time of the pipeline in units of one micro-batch forward+backward of a stage."""
    p, v = layout.pp, layout.virtual_stages
    if p == 1:
        return 0.0
    # ZB-V: p - 1 idle chunk slots, a chunk's F, B, W being a sixth of a stage's micro-batch; DualPipeV:
    # DeepSeek's (PP/2 - 1)(F&B + B - 3W) for PP = 2p chunks with no F&B overlap credited, 2(p - 1) slots.
    return {"gpipe": p - 1, "1f1b": p - 1, "interleaved": (p - 1) / v, "zb-h1": (p - 1) / 3, "zb-v": (p - 1) / 6,
            "dualpipev": (p - 1) / 3}[layout.schedule]


def stage_flops_per_token(shape: ModelShape, layout: Layout, stage: int, recompute: str | None = None) -> float:
    """Training FLOPs per token of the whole (unsharded) stage, forward + backward (+ recomputation)."""
    recompute = layout.recompute if recompute is None else recompute
    attention = shape.attention_flops_per_token_per_layer()
    matmul = 4 / 3 if recompute == "full" else 1.0  # full recompute: one more forward of every matmul
    attention *= 4 / 3 if recompute in ("full", "selective") else 1.0
    # a frozen base costs forward and input gradient (4 per parameter), its adapters all three (6)
    per_param = 4 if shape.lora is not None else 6
    adapters = 6 * layer_adapter_params(shape) if shape.lora is not None else 0
    total = dense_blocks(shape, layout, stage) * ((per_param * shape.layer_params() + adapters) * matmul + attention)
    if shape.moe:  # the MoE MLP is whole on every tp rank: each repeats it on all tokens without SP
        repeat = 1 if layout.sequence_parallel else layout.tp
        per_block = 6 * (shape.active_moe_block_params() + (repeat - 1) * shape.moe_mlp_params()) * matmul
        total += moe_blocks(shape, layout, stage) * (per_block + attention)
    if stage == 0:
        total += per_param * shape.embed_params()
    if stage == layout.head_rank:
        total += per_param * shape.head_params()
    if shape.reference is not None and shape.reference.forward:  # the objective's reference forward, no_grad
        total += reference_forward_flops_per_token(shape, dense_blocks(shape, layout, stage),
                                                   moe_blocks(shape, layout, stage), stage == 0,
                                                   stage == layout.head_rank)
    return total


def _seconds(t: Transfer, layout: Layout, hw: Hardware) -> float:
    group = layout.dims.size(t.axes)
    bandwidth = axis_bandwidth(hw, layout.dims, t.axes)
    if group > 1 and t.bytes:
        measured = measured_seconds(hw, t.op, t.bytes, group, t.calls)
        if measured is not None:
            return measured
    return collective_seconds(t.op, t.bytes, group, bandwidth, hw.latency, t.calls)


Timed = tuple[Transfer, str, float]  # a transfer, the axis name its exposed time is reported under, its seconds


def timed(transfers: list[Transfer], layout: Layout, hw: Hardware) -> list[Timed]:
    return [(t, axis_name(layout.dims, t.axes), _seconds(t, layout, hw)) for t in transfers]


def slowest_stage(shape: ModelShape, layout: Layout) -> int:
    """The pipeline stage that sets the pace of the pipeline (the only one when pp = 1)."""
    return max(range(layout.pp), key=lambda s: stage_flops_per_token(shape, layout, s))


def estimate_time(shape: ModelShape, layout: Layout, hw: Hardware) -> TimeEstimate:
    stage = slowest_stage(shape, layout)
    return step_time(shape, layout, hw, stage, micro_batch_seconds(shape, layout, hw, stage),
                     timed(rank_transfers(shape, layout, stage), layout, hw), update_seconds(shape, layout, hw, stage))


def micro_batch_seconds(shape: ModelShape, layout: Layout, hw: Hardware, stage: int) -> tuple[float, float]:
    """(compute, attention) seconds of one micro-batch forward+backward on a rank of `stage`."""
    tokens_mb = layout.micro_batch * shape.seq_len
    rate = hw.peak_flops * hw.mfu
    split = layout.tp * layout.cp
    if layout.world > 1:  # the node's processes compute at once (a CPU's share its caches and memory)
        rate /= hw.shared_host_slowdown
    compute_mb = hw.micro_batch_overhead + tokens_mb * stage_flops_per_token(shape, layout, stage) / split / rate
    attention_mb = tokens_mb * rank_blocks(shape, layout, stage) * \
        shape.attention_flops_per_token_per_layer() / split / rate
    return compute_mb, attention_mb


MODEL_KINDS = ("tp", "cp", "ep", "pp")  # transfers on a micro-batch's path; the rest are data parallelism's


def by_kind(transfers: list[Timed]) -> dict[str, list[Timed]]:
    """The timed transfers grouped by `Transfer.kind`, each group in the given order."""
    out: dict[str, list[Timed]] = defaultdict(list)
    for entry in transfers:
        out[entry[0].kind].append(entry)
    return out


@dataclass(frozen=True)
class PathTime:
    """A micro-batch's path through the model parallelism (`path_time`): one micro-batch's compute seconds, the
    pipeline's bubble, and the exposed seconds of the tp, cp, ep and pp transfers per axis name."""

    compute_mb: float
    bubble: float
    exposed: dict[str, float]


def path_time(layout: Layout, hw: Hardware, micro_batch: tuple[float, float], kinds: dict[str, list[Timed]]
              ) -> PathTime:
    """The part of a step that the data parallelism does not change: it reads the micro-batch's (compute,
    attention) seconds, the `MODEL_KINDS` transfers, the micro-batches per step and the pipeline's schedule."""
    m, p = layout.grad_accum, layout.pp
    compute_mb, attention_mb = micro_batch
    exposed: dict[str, float] = defaultdict(float)
    tp, cp, ep = kinds.get("tp", ()), kinds.get("cp", ()), kinds.get("ep", ())
    tp_mb = sum(s for _, _, s in tp) / m
    cp_mb = max(0.0, sum(s for t, _, s in cp if t.op == "send") / m - hw.overlap * attention_mb)
    cp_mb += sum(s for t, _, s in cp if t.op == "all_to_all") / m  # Ulysses: on the path
    ep_mb = sum(s for _, _, s in ep) / m  # dispatch and combine: on the critical path
    t_mb = compute_mb + tp_mb + cp_mb + ep_mb
    bubble = bubble_factor(layout) * t_mb
    for _, name, s in tp:  # the bubble (in units of t_mb) already holds the idle share of these
        exposed[name] += s
    if cp:
        exposed["cp"] += m * cp_mb
    if ep:
        exposed["ep"] += m * ep_mb

    if p > 1:  # one message per forward and backward slot on the critical path
        message = next(t for t, _, _ in kinds["pp"] if t.op == "send")
        one = collective_seconds("send", message.bytes / message.calls, p,
                                 axis_bandwidth(hw, layout.dims, ("pp",)), hw.latency)
        exposed["pp"] += 2 * (m * layout.virtual_stages + p - 1) * one
    return PathTime(compute_mb, bubble, dict(exposed))


def step_time(shape: ModelShape, layout: Layout, hw: Hardware, stage: int, micro_batch: tuple[float, float],
              transfers: list[Timed], update: tuple[float, float]) -> TimeEstimate:
    """The step of a rank of the slowest `stage` from its micro-batch's (compute, attention) seconds, its timed
    transfers and its (optimizer, offload) seconds."""
    kinds = by_kind(transfers)
    return time_from_path(shape, layout, hw, path_time(layout, hw, micro_batch, kinds), kinds, update)


def time_from_path(shape: ModelShape, layout: Layout, hw: Hardware, path: PathTime, kinds: dict[str, list[Timed]],
                   update: tuple[float, float]) -> TimeEstimate:
    """The step from its path (`path_time`), the data-parallel transfers of `kinds` and the update's seconds."""
    compute, comm = step_parts(layout.grad_accum, hw, path, kinds)
    return time_estimate(shape, layout, compute, path.bubble, comm, update)


def step_parts(m: int, hw: Hardware, path: PathTime, kinds: dict[str, list[Timed]]) -> tuple[float, dict[str, float]]:
    """(compute seconds, exposed seconds per axis name) of a step of `m` micro-batches."""
    exposed: dict[str, float] = defaultdict(float, path.exposed)
    _add_data_parallel_exposure(exposed, kinds, m, hw, path.compute_mb)
    return m * path.compute_mb, {k: v for k, v in exposed.items() if v > 0}


def time_estimate(shape: ModelShape, layout: Layout, compute: float, bubble: float, comm: dict[str, float],
                  update: tuple[float, float]) -> TimeEstimate:
    optimizer, offload = update
    tokens = layout.global_batch * shape.seq_len
    return TimeEstimate(compute=compute, bubble=bubble, comm=comm, optimizer=optimizer, offload=offload,
                        tokens=tokens, model_flops=float(shape.flops_per_token) * tokens, world=layout.world)


def _add_data_parallel_exposure(exposed: dict[str, float], kinds: dict[str, list[Timed]], m: int, hw: Hardware,
                                compute_mb: float) -> None:
    """The exposed seconds of the gradient reductions, parameter gathers and scalar collectives: each hides
    behind the backward (reductions) or forward and backward (ZeRO-3 gathers) of a micro-batch, up to
    `hw.overlap` of it."""
    backward_mb, forward_mb = compute_mb * 2 / 3, compute_mb / 3
    for t, name, s in kinds.get("dp_grad", ()):  # one reduction per step (DDP, ZeRO-1) or per micro-batch (ZeRO-2/3)
        each = s / t.calls
        exposed[name] += t.calls * max(0.0, each - hw.overlap * backward_mb)
    # parameter gathers after the update; HSDP's replica sums after the backward
    for _, name, s in [*kinds.get("dp_param", ()), *kinds.get("dp_replicate", ())]:
        exposed[name] += s
    for _, name, s in kinds.get("zero3_param", ()):  # about half the gathered bytes feed forwards, half backwards
        each = s / (2 * m)
        hidden = max(0.0, each - hw.overlap * forward_mb) + max(0.0, each - hw.overlap * backward_mb)
        exposed[name] += m * hidden
    for _, name, s in kinds.get("scalar", ()):
        exposed[name] += s


def update_seconds(shape: ModelShape, layout: Layout, hw: Hardware, stage: int) -> tuple[float, float]:
    """(optimizer, offload) seconds of one update of this rank's parameters (its shard under ZeRO)."""
    updated, experts = rank_params(shape, layout, stage), rank_expert_params(shape, layout, stage)
    if layout.zero_stage >= 1:
        updated = ceil_div(updated, layout.shard_group) + ceil_div(experts, layout.expert_shard_group)
    else:
        updated += experts
    optimizer = offload = 0.0
    if layout.offload_optimizer:
        optimizer = OPTIMIZER_BYTES_PER_PARAM * updated / hw.host_memory_bandwidth
        offload = 2 * updated * layout.param_bytes / hw.pcie_bandwidth
    else:
        optimizer = OPTIMIZER_BYTES_PER_PARAM * updated / hw.memory_bandwidth
    return optimizer, offload
