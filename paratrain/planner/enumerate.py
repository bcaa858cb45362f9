"""Every valid layout for N devices, evaluated and ranked: the planner's search.

A layout is valid when (`invalid_reason` says which rule fails otherwise):
  dp * tp * pp * cp = N and micro_batch * grad_accum * dp = the global batch
  tp divides the heads, d_ff and the vocabulary, and fits in a node (tensor parallelism needs NVLink)
  pp <= layers; interleaving needs layers divisible by pp * v and micro-batches divisible by pp (Megatron)
  cp divides the sequence; Ulysses (and USP's Ulysses part) divides the heads of a tp rank
  the V schedules run two chunks per rank (2 pp <= layers); DualPipeV needs m >= 2 pp
  ZeRO-3 is not combined with pipeline parallelism (every micro-batch would re-gather every stage)
  optimizer offload needs ZeRO >= 1
  ep > 1 only for an MoE model, dividing ZeRO's shard group (it is folded inside) and the number of experts
  HSDP (dp_replicate > 1) needs ZeRO >= 1 and dp_replicate dividing dp; the search tries, for every ZeRO layout
  whose shard group spans nodes, the fewest replicas that keep each shard group inside a node
Variants that cannot differ are enumerated once: ZeRO stages when dp * cp = 1, sequence parallelism when
tp = 1, selective recompute when attention is fused (flash attention keeps no s^2 scores to drop).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from paratrain.planner.adapters import four_bit_cut
from paratrain.planner.hardware import Hardware, spans_nodes
from paratrain.planner.layout import CP_METHODS, RECOMPUTE, SCHEDULES, V_SCHEDULES, Layout
from paratrain.planner.memory import MemoryEstimate, estimate_memory
from paratrain.planner.model_shape import ModelShape, PlannerError
from paratrain.planner.step_time import TimeEstimate, estimate_time


@dataclass(frozen=True)
class SearchSpace:
    precision: str = "bf16"
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    schedules: tuple[str, ...] = SCHEDULES
    virtual_stages: tuple[int, ...] = (2, 4)
    recompute: tuple[str, ...] = RECOMPUTE
    sequence_parallel: tuple[bool, ...] = (False, True)
    offload_optimizer: tuple[bool, ...] = (False,)
    max_micro_batch: int = 16
    flash_attention: bool = True
    cp_methods: tuple[str, ...] = CP_METHODS
    expert_parallel: tuple[int, ...] | None = None  # ep sizes to consider (MoE models); None: every valid one
    optimizer: str = "adamw"  # "muon": Muon on the blocks' matrices (its state and collectives counted)
    hsdp: bool = True  # also try each ZeRO layout with replicas across nodes and shards inside (`hsdp_variants`)


def invalid_reason(shape: ModelShape, layout: Layout, gpus_per_node: int) -> str | None:
    """Why `layout` cannot run `shape` (None when it can)."""
    quantized = shape.lora is not None and shape.lora.quantize is not None
    checks = [
        (shape.n_head % layout.tp == 0, lambda: f"tp={layout.tp} does not divide the {shape.n_head} heads"),
        (shape.d_ff % layout.tp == 0, lambda: f"tp={layout.tp} does not divide d_ff={shape.d_ff}"),
        (shape.n_kv_head % layout.tp == 0, lambda: f"tp={layout.tp} does not divide n_kv_head={shape.n_kv_head}"),
        (shape.vocab_size % layout.tp == 0,
         lambda: f"tp={layout.tp} does not divide the vocabulary {shape.vocab_size}"),
        (layout.tp <= gpus_per_node, lambda: f"tp={layout.tp} is larger than a node ({gpus_per_node} GPUs)"),
        (layout.pp <= shape.n_layer, lambda: f"pp={layout.pp} is more than the {shape.n_layer} layers"),
        (shape.seq_len % layout.cp == 0, lambda: f"cp={layout.cp} does not divide the sequence length {shape.seq_len}"),
        (not (layout.zero_stage == 3 and layout.pp > 1), lambda: "ZeRO-3 with pipeline parallelism is not supported"),
        (not (quantized and four_bit_cut(shape, layout.tp)), lambda: four_bit_cut(shape, layout.tp)),
        (not layout.offload_optimizer or layout.zero_stage >= 1, lambda: "optimizer offload needs ZeRO stage >= 1"),
        (not layout.sequence_parallel or layout.tp > 1, lambda: "sequence parallelism needs tp > 1"),
        ((layout.pp == 1) == (layout.schedule == "none"), lambda: "a pipeline schedule is needed exactly when pp > 1"),
        (layout.virtual_stages == 1 or layout.schedule in ("interleaved", *V_SCHEDULES),
         lambda: "virtual stages need 'interleaved', 'zb-v' or 'dualpipev'"),
        (layout.cp > 1 or layout.cp_method == "ring", lambda: "a context-parallel method needs cp > 1"),
        (layout.ep == 1 or shape.moe, lambda: f"ep={layout.ep} needs a mixture-of-experts model"),
        (layout.dp % layout.dp_replicate == 0,
         lambda: f"dp_replicate={layout.dp_replicate} does not divide dp={layout.dp}"),
        (layout.dp_replicate == 1 or layout.zero_stage >= 1, lambda: "HSDP (dp_replicate > 1) needs ZeRO stage >= 1"),
        (layout.shard_group % layout.ep == 0, lambda: f"ep={layout.ep} does not divide ZeRO's shard group (dp x cp / "
                                                      f"dp_replicate) = {layout.shard_group}"),
        (not shape.moe or shape.num_experts % layout.ep == 0,
         lambda: f"ep={layout.ep} does not divide the {shape.num_experts} experts"),
    ]
    if layout.schedule in V_SCHEDULES:
        checks += [
            (layout.virtual_stages == 2, lambda: f"{layout.schedule} runs two chunks per rank (virtual_stages 2)"),
            (shape.n_layer >= 2 * layout.pp, lambda: f"{layout.schedule} needs 2 pp = {2 * layout.pp} chunks of the "
                                                    f"{shape.n_layer} layers"),
            (layout.schedule == "zb-v" or layout.grad_accum >= 2 * layout.pp,
             lambda: f"dualpipev needs at least 2 pp = {2 * layout.pp} micro-batches ({layout.grad_accum})"),
        ]
    if layout.ulysses_degree > 1:
        u, heads = layout.ulysses_degree, shape.n_head // layout.tp if shape.n_head % layout.tp == 0 else 0
        checks += [(heads % u == 0, lambda: f"Ulysses over {u} ranks does not divide the {heads} heads per tp rank")]
    if layout.cp_method == "usp":
        checks += [(1 < layout.ulysses_size < layout.cp and layout.cp % layout.ulysses_size == 0,
                    lambda: f"usp needs 1 < ulysses_size < cp dividing cp={layout.cp}")]
    if layout.schedule == "interleaved":
        checks += [
            (layout.virtual_stages >= 2, lambda: "the interleaved schedule needs virtual_stages >= 2"),
            (shape.n_layer % (layout.pp * layout.virtual_stages) == 0,
             lambda: f"interleaving needs the {shape.n_layer} layers divisible by pp*v = "
                     f"{layout.pp * layout.virtual_stages}"),
            (layout.grad_accum % layout.pp == 0,
             lambda: f"interleaving needs the micro-batches ({layout.grad_accum}) divisible by pp={layout.pp}"),
        ]
    for ok, reason in checks:  # the reasons are built only for a failing check (a search asks many layouts)
        if not ok:
            return reason()
    return None


def enumerate_layouts(shape: ModelShape, gpus: int, global_batch: int, gpus_per_node: int,
                      space: SearchSpace = SearchSpace()) -> Iterator[Layout]:
    for tp, pp, cp in itertools.product(divisors(gpus), repeat=3):
        if gpus % (tp * pp * cp):
            continue
        dp = gpus // (tp * pp * cp)
        if global_batch % dp:
            continue
        per_rank = global_batch // dp
        recomputes = [r for r in space.recompute if not (r == "selective" and space.flash_attention)]
        choices = mesh_choices(shape, (dp, tp, pp, cp), recomputes, space)
        for mb in divisors(per_rank):
            if mb > space.max_micro_batch:
                continue
            for (schedule, v), (method, u), zero, offload, sp, recompute, ep in choices:
                layout = Layout(dp=dp, micro_batch=mb, grad_accum=per_rank // mb, tp=tp, pp=pp, cp=cp,
                                zero_stage=zero, offload_optimizer=offload, schedule=schedule, virtual_stages=v,
                                recompute=recompute, sequence_parallel=sp, precision=space.precision,
                                cp_method=method, ulysses_size=u, ep=ep, optimizer=space.optimizer)
                for candidate in [layout] + hsdp_variants(layout, gpus_per_node, space):
                    if invalid_reason(shape, candidate, gpus_per_node) is None:
                        yield candidate


def mesh_choices(shape: ModelShape, mesh: tuple, recomputes: list[str], space: SearchSpace) -> list[tuple]:
    """For the mesh (dp, tp, pp, cp), every ((schedule, v), (cp method, ulysses size), zero, offload, sp, recompute,
    ep) the search tries, in its order (validity not yet asked)."""
    dp, tp, pp, cp = mesh
    zero_stages = space.zero_stages if dp * cp > 1 else (0,)
    sps = space.sequence_parallel if tp > 1 else (False,)
    schedules = [("none", 1)] if pp == 1 else \
        [(s, v) for s in space.schedules
         for v in (space.virtual_stages if s == "interleaved" else (2,) if s in V_SCHEDULES else (1,))]
    methods = [("ring", 1)] if cp == 1 else \
        [(meth, u) for meth in space.cp_methods
         for u in ([d for d in divisors(cp) if 1 < d < cp] if meth == "usp" else [1])]
    eps = expert_sizes(shape, dp * cp, space)
    return list(itertools.product(schedules, methods, zero_stages, space.offload_optimizer, sps, recomputes, eps))


def hsdp_variants(layout: Layout, gpus_per_node: int, space: SearchSpace) -> list[Layout]:
    """`layout` as HSDP when its ZeRO shard group spans nodes: with the fewest replicas that keep every shard
    group inside a node (replicas across nodes, shards inside; none when no replica count does)."""
    if not space.hsdp or layout.zero_stage == 0 or layout.dp == 1 or \
            not spans_nodes(layout.dims, ("dp_shard_cp",), gpus_per_node):
        return []
    for replicate in divisors(layout.dp)[1:]:
        candidate = replace(layout, dp_replicate=replicate)
        if candidate.shard_group % layout.ep == 0 and \
                not spans_nodes(candidate.dims, ("dp_shard_cp",), gpus_per_node):
            return [candidate]
    return []


def expert_sizes(shape: ModelShape, folded: int, space: SearchSpace) -> list[int]:
    """The ep sizes to try for a dp x cp of `folded` ranks: 1 for a dense model; for an MoE model the common
    divisors of dp x cp and the number of experts (those of `space.expert_parallel` among them)."""
    if not shape.moe:
        return [1]
    sizes = [d for d in divisors(folded) if shape.num_experts % d == 0]
    return [d for d in sizes if space.expert_parallel is None or d in space.expert_parallel]


@dataclass(frozen=True)
class Evaluation:
    layout: Layout
    memory: MemoryEstimate
    time: TimeEstimate
    fits: bool


def evaluate(shape: ModelShape, layout: Layout, hw: Hardware, flash_attention: bool = True) -> Evaluation:
    memory = estimate_memory(shape, layout, flash_attention)
    return Evaluation(layout, memory, estimate_time(shape, layout, hw), memory.total <= hw.usable_memory)


def complexity(layout: Layout) -> int:
    """How many mechanisms a layout switches on: among equally fast layouts the simplest ranks first."""
    return (sum(n > 1 for n in (layout.tp, layout.pp, layout.cp)) + (layout.zero_stage > 0)
            + (layout.recompute != "none") + layout.sequence_parallel + layout.offload_optimizer
            + (layout.virtual_stages > 1) + (layout.ep > 1))


def rank_key(e: Evaluation) -> tuple:
    """Fastest first; ties (to a millionth of a second) go to the simpler layout, then to less memory."""
    return round(e.time.total, 6), complexity(e.layout), e.memory.total


@dataclass(frozen=True)
class PlanResult:
    ranked: list[Evaluation]  # layouts that fit, fastest first
    considered: int  # valid layouts enumerated
    smallest: Evaluation | None  # the least memory-hungry layout (shown when nothing fits)


def exhaustive_plan(shape: ModelShape, gpus: int, global_batch: int, hw: Hardware,
                    space: SearchSpace = SearchSpace()) -> PlanResult:
    """`search.plan` the slow way, every layout evaluated from scratch: the reference the search must equal
    (tests/unit/test_planner_search.py). Enumerate, keep what fits in `hw.usable_memory`, rank by predicted step
    time (then memory)."""
    check_request(gpus, global_batch)
    fitting, considered, smallest = [], 0, None
    for layout in enumerate_layouts(shape, gpus, global_batch, hw.gpus_per_node, space):
        considered += 1
        memory = estimate_memory(shape, layout, space.flash_attention)
        if memory.total > hw.usable_memory:
            if smallest is None or memory.total < smallest.memory.total:
                smallest = Evaluation(layout, memory, estimate_time(shape, layout, hw), False)
            continue
        fitting.append(Evaluation(layout, memory, estimate_time(shape, layout, hw), True))
    return ranked(fitting, considered, smallest, gpus, global_batch)


def check_request(gpus: int, global_batch: int) -> None:
    if gpus < 1:
        raise PlannerError(f"--gpus must be >= 1, got {gpus}")
    if global_batch < 1:
        raise PlannerError(f"--global-batch must be >= 1, got {global_batch}")


def ranked(fitting: list[Evaluation], considered: int, smallest: Evaluation | None, gpus: int,
           global_batch: int) -> PlanResult:
    """The result from the fitting layouts in enumeration order (ties keep it) and the smallest that does not fit."""
    if considered == 0:
        raise PlannerError(f"no valid layout: {gpus} GPUs cannot split a global batch of {global_batch} sequences "
                        f"(dp must divide it) with the model's constraints; choose a --global-batch that is a "
                        f"multiple of the data-parallel sizes you want")
    fitting.sort(key=rank_key)
    best_small = min(fitting, key=lambda e: e.memory.total) if fitting else smallest
    return PlanResult(fitting, considered, best_small)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
