"""Bytes per rank: model states (ZeRO formulas) and activations (Korthikanti et al. 2022).

Model states come from the one estimator, `paratrain.zero.estimate_memory` (equal to what
`engine.memory_stats()` measures, which tests/distributed/test_zero_counts.py asserts). Psi = parameters this
rank's model piece has (after tensor/pipeline sharding), N = the ZeRO shard group (dp x cp), AdamW:
                     fp32 (4+4+8 bytes)        bf16/fp16 mixed precision
  stage 0 (DDP)      16 Psi                    16 Psi          (2 + 2, fp32 master 4, moments 8)
  stage 1            8 Psi + 8 Psi/N           4 Psi + 12 Psi/N
  stage 2            4 Psi + 12 Psi/N          2 Psi + 16 Psi/N (the gradient shard is fp32)
  stage 3            16 Psi/N                  16 Psi/N        (+ the gathered units in flight)
Shards are padded to a multiple of N (a flat buffer split into N equal pieces). Each kind counts its bytes
wherever they live; under optimizer offload `host` says how many of them are in host memory.

Mixture of experts: the routed experts' states are counted apart (`expert_state_bytes`), with the same
formulas for Psi_e = E/ep experts of each MoE block the rank holds and N_e = edp = dp x cp / ep (the ranks
holding the same experts); the totals add both. See paratrain/planner/moe.py.

Activations of one transformer layer for one micro-batch: see `layer_activations`; the classic result
s*b*h*(34 + 5*a*s/h) bytes is the case 16-bit, dropout, non-fused attention, d_ff = 4h.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.planner.adapters import lora_model_states
from paratrain.planner.layout import Layout
from paratrain.planner.model_shape import ModelShape
from paratrain.planner.moe import dense_blocks, moe_blocks, moe_mlp_activations, rank_expert_params
from paratrain.planner.muon import muon_params
from paratrain.planner.states import ModelStates, ceil_div, model_state_bytes


def rank_params(shape: ModelShape, layout: Layout, stage: int) -> int:
    """Parameters held by a rank of pipeline stage `stage` (one tensor-parallel shard), without the routed
    experts of an MoE model (`moe.rank_expert_params`, reduced and sharded over edp instead of dp x cp)."""
    total = dense_blocks(shape, layout, stage) * shape.layer_params(layout.tp)
    if shape.moe:
        total += moe_blocks(shape, layout, stage) * shape.moe_block_params(layout.tp)
    if stage == 0:
        total += shape.embed_params(layout.tp)
    if stage == layout.head_rank:
        total += shape.head_params(layout.tp)
    return total


def zero3_units(shape: ModelShape, layout: Layout, stage: int) -> list[tuple[int, int]]:
    """(parameters, all-gathers per micro-batch) of each ZeRO-3 unit of a rank: its blocks (forward and
    backward) and the root with the embedding / final norm and head its stage holds (once)."""
    root = (shape.embed_params(layout.tp) if stage == 0 else 0) + \
        (shape.head_params(layout.tp) if stage == layout.head_rank else 0)
    moe = moe_blocks(shape, layout, stage)
    blocks = [(shape.layer_params(layout.tp), 2)] * dense_blocks(shape, layout, stage) + \
        [(shape.moe_block_params(layout.tp) + (shape.expert_block_params() if layout.ep == 1 else 0), 2)] * moe
    return blocks + ([(root, 1)] if root else [])


def reference_bytes(shape: ModelShape, layout: Layout, stage: int) -> int:
    """Bytes of the frozen reference copy on a rank of pipeline stage `stage` (`engine.memory_stats()`'s
    `reference_params`; 0 without one): the rank's parameters in the compute dtype, placed as frozen weights
    (`paratrain.zero.estimate_memory`'s frozen term): whole at ZeRO 0-2; at ZeRO-3 ⌈unit/N⌉ of each unit (its
    blocks and the root holding the embedding and head), the routed experts of each MoE block over edp."""
    if shape.reference is None or not shape.reference.copy:
        return 0
    n, edp, stage3 = layout.shard_group, layout.expert_shard_group, layout.zero_stage == 3
    dense = sum(ceil_div(p, n) * n for p, _ in zero3_units(shape, layout, stage)) if stage3 else \
        rank_params(shape, layout, stage) + (rank_expert_params(shape, layout, stage) if layout.ep == 1 else 0)
    experts = 0
    if layout.ep > 1:
        per_block = shape.expert_block_params(layout.ep)
        experts = moe_blocks(shape, layout, stage) * (ceil_div(per_block, edp) * edp if stage3 else per_block)
    args = (layout.zero_stage, layout.precision)
    return model_state_bytes(0, n, *args, frozen_params=dense).params + \
        model_state_bytes(0, edp, *args, frozen_params=experts).params


def rank_model_states(shape: ModelShape, layout: Layout, stage: int) -> ModelStates:
    """`model_state_bytes` of the rank's parameters without the routed experts: AdamW's 8 bytes of state per
    parameter; under Muon its matrices hold one fp32 momentum buffer (4 bytes) and the rest AdamW's two. With
    adapters the rank's parameters are the frozen base and the adapters train (`adapters.lora_model_states`)."""
    if shape.lora is not None:
        return lora_model_states(shape, layout, stage, rank_params(shape, layout, stage))
    muon = muon_params(shape, layout, stage)
    args = (layout.shard_group, layout.zero_stage, layout.precision, layout.offload_optimizer)
    states = model_state_bytes(rank_params(shape, layout, stage) - muon, *args)
    return states + model_state_bytes(muon, *args, optimizer_state_bytes=4) if muon else states


def expert_state_bytes(shape: ModelShape, layout: Layout, stage: int) -> ModelStates:
    """Model-state bytes of the routed experts on a rank of `stage`: `model_state_bytes` of
    Psi_e = n_moe_blocks(stage) * E/ep * 3 d_model d_expert over the edp group (dp x cp / ep) — e.g. ZeRO-1,
    bf16: 4 Psi_e + 12 Psi_e / edp. Compare with the expert part of `engine.memory_stats()`. All 0 for a
    dense model or a stage without MoE blocks."""
    return model_state_bytes(rank_expert_params(shape, layout, stage), layout.expert_shard_group,
                             layout.zero_stage, layout.precision, layout.offload_optimizer)


# ---- activations ------------------------------------------------------------------------------------
def layer_activations(shape: ModelShape, layout: Layout, recompute: str | None = None,
                      flash_attention: bool = True, regather_sequence: bool = False,
                      moe: bool = False) -> dict[str, float]:
    """Bytes one transformer layer keeps for backward, for one micro-batch on one rank, by component.

    In elements of the activation dtype (e bytes), per micro-batch of b sequences of s/cp local tokens:
      inputs            4 s b h    the two layer-norm inputs, the q/k/v input and the fc input
                                   (replicated over tp; under sequence parallelism the norm inputs are
                                   sharded, and the column-parallel inputs too with `regather_sequence`)
      tensor_parallel   4 s b h + 2 s b f    q, k, v, the o input, the GELU input and the proj input (/tp)
      attention_core    fused (flash): the softmax log-sum-exp, 4 a s b bytes (/tp)
                        unfused: the softmax output a s^2 b, plus with dropout its output and a 1-byte mask
                        ring attention (cp > 1): the log-sum-exp, fp32 copies of q, k, v (in place of the
                        e-byte ones counted above) and its fp32 output, which the o input copies
                        Ulysses (and USP): also the head-sharded q, k, v and output, 4 s b h (/tp)
      masks             with dropout: two 1-byte masks of s b h (after attention and after the MLP)
      norm_stats        mean and rstd of both layer norms, fp32: 16 s b bytes
    Recompute: "selective" drops attention_core (recomputed in backward, Korthikanti et al. section 5);
    "full" keeps only the layer input, e s b h (/tp with sequence parallelism).
    With e = 2, dropout, unfused attention and f = 4h the sum (without norm_stats) is the paper's
    s b h (10 + 24/t + 5 a s/(h t)), and s b h (34 + 5 a s / h)/t with sequence parallelism and
    `regather_sequence` — Megatron keeps the sequence shard of a column-parallel layer's input and all-gathers
    it again in backward; paratrain keeps the gathered input, 2 s b h (1 - 1/t) more per layer.
    An MoE block (`moe`) keeps `moe.moe_mlp_activations` in place of the MLP's 2 s b f (/tp) share.
    """
    recompute = layout.recompute if recompute is None else recompute
    e = layout.activation_bytes
    t = layout.tp
    sp = t if layout.sequence_parallel else 1
    b, s_local, s = layout.micro_batch, shape.seq_len // layout.cp, shape.seq_len
    h, f, a = shape.d_model, shape.d_ff, shape.n_head
    sbh = s_local * b * h
    dropout = shape.dropout > 0
    if recompute == "full":
        return {"inputs": e * sbh / sp}
    out = {
        "inputs": e * (2 * sbh / sp + 2 * sbh / (sp if regather_sequence else 1)),
        "tensor_parallel": e * (4 * sbh + (0 if moe else shape.mlp_intermediates * s_local * b * f)) / t,
        "masks": (2 * sbh / sp) if dropout else 0.0,
        "norm_stats": 16 * s_local * b / sp,
    }
    if moe:
        out["moe_mlp"] = moe_mlp_activations(shape, layout)
    if recompute != "selective":
        if layout.ring_degree > 1:
            out["attention_core"] = 4 * a * s_local * b / t + (3 * (4 - e) + 4) * sbh / t
        elif flash_attention:
            out["attention_core"] = 4 * a * s_local * b / t
        else:  # queries are local, keys span the whole sequence (ring attention visits every block)
            scores = a * s_local * s * b / t
            out["attention_core"] = scores * (2 * e + 1 if dropout else e)
        if layout.ulysses_degree > 1:  # the head-sharded q, k, v and output the all-to-alls made, kept
            out["attention_core"] += 4 * e * sbh / t
    return out


def head_activations(shape: ModelShape, layout: Layout, regather_sequence: bool = False) -> float:
    """Bytes the last stage keeps for one micro-batch after the blocks: the final norm's input and stats,
    the head's input (gathered under sequence parallelism, see `layer_activations`), the fp32 log-softmax of
    the (vocab-parallel) logits, the int64 targets, the loss's fp32 total weight and the int64 count of targets
    it divides by — or, vocab-parallel, two 1-byte token masks and an int64 token count."""
    e, t = layout.activation_bytes, layout.tp
    sp = t if layout.sequence_parallel else 1
    b, s = layout.micro_batch, shape.seq_len // layout.cp
    norm_and_head_inputs = e * s * b * shape.d_model * (1 / sp + 1 / (sp if regather_sequence else 1))
    loss = 4 * s * b * shape.vocab_size / t + 8 * s * b + (2 * s * b + 8 if t > 1 else 4 + 8)
    return norm_and_head_inputs + 8 * s * b / sp + loss


def embed_activations(shape: ModelShape, layout: Layout) -> float:
    """Bytes the first stage keeps for one micro-batch before the blocks: int64 token and position ids (and
    the embedding dropout mask; vocab-parallel, the 1-byte mask of the tokens outside this rank's rows)."""
    b, s = layout.micro_batch, shape.seq_len // layout.cp
    mask = s * b * shape.d_model / (layout.tp if layout.sequence_parallel else 1) if shape.dropout else 0
    outside = s * b if layout.tp > 1 else 0
    return 8 * s * b + 8 * s + mask + outside


def in_flight(layout: Layout, stage: int) -> float:
    """Micro-batches whose activations a rank of `stage` holds at its peak, in units of its whole stage.

    GPipe runs every forward first: m. 1F1B (and ZB-H1, which keeps 1F1B's peak) starts p - stage
    forwards before the first backward. Interleaved 1F1B with v chunks per rank warms up
    2 (p - stage - 1) + (v - 1) p + 1 chunk-micro-batches (Megatron), each 1/v of the stage; for stage 0
    that is p (1 + (p - 1)/(p v)), Korthikanti et al.'s factor. ZB-V holds at most 2p chunks (p stages, as
    the validator shows); DualPipeV 2p + 1 chunks (DeepSeek's PP + 1).
    """
    m, p, v = layout.grad_accum, layout.pp, layout.virtual_stages
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "interleaved":
        return min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1) / v
    if layout.schedule == "zb-v":  # at most 2p chunk activations (p stages), on every rank alike
        return float(min(m, p))
    if layout.schedule == "dualpipev":  # DeepSeek's PP + 1 chunks, PP = 2p
        return (2 * p + 1) / 2
    return float(min(m, p - stage))


@dataclass(frozen=True)
class ActivationParts:
    """Bytes of one micro-batch that do not depend on the pipeline stage (`activation_parts`): one dense layer's
    and one MoE layer's `layer_activations`, what the embedding and the head keep."""

    layer: float
    moe_layer: float
    embed: float
    head: float


def activation_parts(shape: ModelShape, layout: Layout, flash_attention: bool = True,
                     recompute: str | None = None) -> ActivationParts:
    """The micro-batch's parts; they read the micro-batch, its split (tp, sp, cp and its method), the precision
    and the recompute policy, never the pipeline."""
    def layer(moe: bool) -> float:
        return sum(layer_activations(shape, layout, recompute, flash_attention, moe=moe).values())
    return ActivationParts(layer(False), layer(True) if shape.moe else 0.0, embed_activations(shape, layout),
                           head_activations(shape, layout))


@dataclass(frozen=True)
class StageCounts:
    """How many of each part a rank of a pipeline stage holds at its peak (`stage_counts`): micro-batches in
    flight, its dense and MoE blocks, and the head's micro-batches (None: the stage has no head, likewise
    `first` for the embedding)."""

    flights: float
    dense: int
    moe: int
    first: bool
    head_flights: int | None


def stage_counts(shape: ModelShape, layout: Layout, stage: int) -> StageCounts:
    """They read the pipeline (pp, schedule, v, the micro-batches of a step when pp > 1), never the micro-batch."""
    head = (layout.grad_accum if layout.schedule == "gpipe" else 1) if stage == layout.head_rank else None
    return StageCounts(in_flight(layout, stage), dense_blocks(shape, layout, stage), moe_blocks(shape, layout, stage),
                       stage == 0, head)


def stage_activation_bytes(counts: StageCounts, parts: ActivationParts) -> float:
    """Activation bytes of a stage from its counts and the micro-batch's parts."""
    total = 0.0
    if counts.dense:
        total += counts.flights * counts.dense * parts.layer
    if counts.moe:
        total += counts.flights * counts.moe * parts.moe_layer
    if counts.first:
        total += counts.flights * parts.embed
    if counts.head_flights is not None:
        total += counts.head_flights * parts.head
    return total


def activation_bytes(shape: ModelShape, layout: Layout, stage: int, flash_attention: bool = True) -> float:
    """Activation bytes a rank of `stage` holds at its peak."""
    return stage_activation_bytes(stage_counts(shape, layout, stage), activation_parts(shape, layout, flash_attention))


def zero3_gathered_bytes(shape: ModelShape, layout: Layout, prefetch: int = 1) -> float:
    """ZeRO-3's working set: the gathered 16-bit (or fp32) parameters of the unit in use and of `prefetch`
    units fetched ahead, plus one unit's full gradient before its reduce-scatter. A unit is a block (or the
    embedding, or the head), the granularity paratrain's stage 3 wraps."""
    unit = max(shape.layer_params(layout.tp), shape.embed_params(layout.tp), shape.head_params(layout.tp),
               shape.moe_block_params(layout.tp) + shape.expert_block_params(layout.ep) if shape.moe else 0)
    return (prefetch + 2) * unit * layout.param_bytes


def unsharded_gradient_bytes(shape: ModelShape, layout: Layout, stage: int) -> float:
    """ZeRO-2 under partial backwards: a rank's whole gradient, kept until the step's one reduce-scatter."""
    return (rank_params(shape, layout, stage) + rank_expert_params(shape, layout, stage)) * layout.param_bytes


def recompute_bytes(shape: ModelShape, parts: ActivationParts) -> float:
    """Full recompute's working memory: the larger layer rebuilt during its backward, from the micro-batch's parts
    without recompute."""
    return max(parts.layer, parts.moe_layer) if shape.moe else parts.layer


def logits_bytes(shape: ModelShape, layout: Layout) -> float:
    """The last stage's logits and their fp32 gradient during the loss."""
    return layout.micro_batch * (shape.seq_len // layout.cp) * shape.vocab_size / layout.tp * \
        (layout.activation_bytes + 4)


def transient_bytes(shape: ModelShape, layout: Layout, stage: int, flash_attention: bool = True,
                    prefetch: int = 1) -> float:
    """Peak working memory beyond states and stored activations on a rank of `stage`:
    - ZeRO-2 in a pipeline with partial backwards: the whole unsharded gradient, staged through the step
      until its one reduce-scatter (`Layout.partial_backwards`, `unsharded_gradient_bytes`);
    - full recompute: one layer's activations rebuilt during its backward (`recompute_bytes`); the same for the
      reference forward of an objective (`rebuilds_a_layer`);
    - ZeRO-3: the gathered parameters of (1 + prefetch) units and one unit's unreduced gradient;
    - the last stage: the logits and their gradient during the loss (fp32 for the gradient)."""
    full = recompute_bytes(shape, activation_parts(shape, layout, flash_attention, "none")) \
        if rebuilds_a_layer(shape, layout) else None
    return sum_transient(unsharded_gradient_bytes(shape, layout, stage) if uses_unsharded_gradient(layout) else None,
                         full, zero3_gathered_bytes(shape, layout, prefetch) if layout.zero_stage == 3 else None,
                         logits_bytes(shape, layout) if stage == layout.head_rank else None)


def rebuilds_a_layer(shape: ModelShape, layout: Layout) -> bool:
    """Whether a layer's activations are built outside the kept ones: full recompute's backward, or an objective's
    reference forward (no_grad; planner/reference.py), never both at once."""
    return layout.recompute == "full" or (shape.reference is not None and shape.reference.forward)


def uses_unsharded_gradient(layout: Layout) -> bool:
    """Whether `unsharded_gradient_bytes` is part of the layout's transient memory."""
    return layout.zero_stage == 2 and layout.partial_backwards


def sum_transient(gradient: float | None, full: float | None, gathered: float | None, logits: float | None) -> float:
    """The terms of `transient_bytes` that apply (None: not this layout's), added in one order."""
    out = 0.0
    for term in (gradient, full, gathered, logits):
        if term is not None:
            out += term
    return out


@dataclass(frozen=True)
class MemoryEstimate:
    """The peak rank's bytes, by kind; `stage` is the pipeline stage that peaks. Model states count their bytes
    wherever they live, as `engine.memory_stats()` does: `host` of them are in host memory (optimizer
    offload), and `total` is the device's part plus activations and transient buffers."""

    params: float
    grads: float
    optimizer_state: float
    activations: float
    transient: float
    host: float
    stage: int
    experts: float = 0.0  # of params + grads + optimizer_state: the routed experts' (`expert_state_bytes`)
    reference: float = 0.0  # of params: an objective's frozen reference copy (`reference_bytes`)

    @property
    def states(self) -> float:
        """Model-state bytes on the device."""
        return self.params + self.grads + self.optimizer_state - self.host

    @property
    def total(self) -> float:
        return self.states + self.activations + self.transient


def estimate_memory(shape: ModelShape, layout: Layout, flash_attention: bool = True) -> MemoryEstimate:
    """Per-rank memory of `layout`: the worst of the first and the last pipeline stage."""
    worst = None
    for stage in memory_stages(layout):
        est = with_states(stage_states(shape, layout, stage), activation_bytes(shape, layout, stage, flash_attention),
                          transient_bytes(shape, layout, stage, flash_attention), stage)
        if worst is None or est.total > worst.total:
            worst = est
    return worst


def memory_stages(layout: Layout) -> list[int]:
    """The pipeline stages whose memory `estimate_memory` weighs: the first, the head's and the last."""
    return sorted({0, layout.head_rank, layout.pp - 1})


def stage_states(shape: ModelShape, layout: Layout, stage: int) -> MemoryEstimate:
    """The model states of a rank of `stage` (dense and routed experts), as a `MemoryEstimate` without
    activations or transient buffers."""
    states = rank_model_states(shape, layout, stage)
    experts = expert_state_bytes(shape, layout, stage)
    params = states.params + experts.params
    reference = reference_bytes(shape, layout, stage) if shape.reference is not None else 0
    return MemoryEstimate(params + reference if reference else params, states.grads + experts.grads,
                          states.optimizer_state + experts.optimizer_state, 0.0, 0.0, states.host + experts.host,
                          stage, experts.total, reference)


def with_states(states: MemoryEstimate, activations: float, transient: float, stage: int) -> MemoryEstimate:
    return MemoryEstimate(states.params, states.grads, states.optimizer_state, activations, transient, states.host,
                          stage, states.experts, states.reference)
