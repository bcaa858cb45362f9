"""Apply a tensor-parallel plan to a model in place; the returned step undoes itself for one tensor.

    applied = parallelize(model, mesh, plan, sequence_parallel=True, seed=cfg.seed)
    ...
    origin = applied.origin(local)   # which box of the unsplit tensor this rank's tensor is (from its placement)

[Note: in place, names kept]
Split layers replace the dense ones under the same attribute, with parameters under the same names
(`weight`, `bias`), so optimizer construction, the data-parallel strategy (which sees only the local,
sharded module) and state-dict names are unchanged. Region transitions that are not layers (a parent
whose input enters the region once, a module whose output starts the sequence-parallel region) are
forward hooks. Per-rank random numbers (`in_region`, `sequence`) wrap the module's `forward`, so activation
checkpointing's recompute, which reruns `forward`, draws the same masks.

[Note: summing a replicated parameter's gradient over tp]
Under sequence parallelism a replicated parameter (a norm's weight) sees only this rank's s/tp tokens, so
its gradient must be summed over tp. A hook on the parameter does it, before the gradient accumulates (the
data-parallel strategies act after accumulation, so they see the sum). This step hooks the parameters it
finds (`AppliedPlan.sum_replicated_gradients`), and paratrain's `parallelize` asks again once every later
step has run, because a later step may replace a parameter object (expert parallelism makes new expert
parameters): whatever parameter the module then holds gets the hook, a parameter already hooked is skipped.
Allocating a meta parameter in place keeps its hooks (`paratrain.parallel.dp.flat.set_data`).

[Note: building the same model everywhere]
Every rank builds the full model from the same seed and keeps its slice, so the sharded model starts
exactly where the single-process model starts; DDP's start-up broadcast runs over the dp axis only and
leaves the tp shards distinct.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from paratrain.adapters import LoraLinear
from paratrain.comm import all_reduce
from paratrain.comm.autograd import copy_to_region, gather_from_sequence, scatter_to_region
from paratrain.layout.mesh import Axis, Mesh
from paratrain.layout.origin import Origin, Step
from paratrain.layout.placement import Placements, Replicate, Shard
from paratrain.parallel.tp.layers import (
    ACTIVATION_TAG,
    GRAD_TAG,
    SEQ_DIM,
    ColumnParallelLinear,
    PlanError,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from paratrain.parallel.tp.lora import SplitMagnitude, split_adapter_layer
from paratrain.parallel.tp.loss import VocabParallelCrossEntropy
from paratrain.parallel.tp.plan import SHARDING, match, packed_parts, plan_for, resolve_plan
from paratrain.parallel.tp.quantized import Split4bitLinear, SplitNF4Linear
from paratrain.parallel.tp.random import RNGTracker

SPLIT_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, SplitMagnitude, Split4bitLinear,
                SplitNF4Linear)
SCATTER_TAG = "tp_scatter"  # a 'sequence_scatter' module's split of the sequence (all-gather in backward)


@dataclass
class AppliedPlan(Step):
    """The tensor-parallel step: the style of each module (and the plan that gave it). How each parameter
    was split (`Shard(dim, full)` or `Replicate()` over tp) is recorded in `placements`, the parallel model's."""

    styles: dict[str, str]
    axis: Axis
    sequence_parallel: bool
    plan: dict[str, str] = field(default_factory=dict)
    tracker: RNGTracker | None = None  # per-tp-rank stream: checkpoints save it, recomputation replays it
    packed: dict[str, str] = field(default_factory=dict)  # a packed layer's part parameter -> its original tensor
    placements: Placements = field(default_factory=Placements)
    summed: list[tuple[nn.Module, str]] = field(default_factory=list)  # SP: (module, name) of replicated params
    name = "tensor parallel"

    def sum_replicated_gradients(self) -> None:
        """Hook every parameter in `summed` (as the module now holds it) to sum its gradient over tp, once per
        parameter object: one that already has the hook is skipped (see the note above)."""
        for module, name in self.summed:
            param = module._parameters.get(name)
            if param is None or not param.requires_grad:
                continue
            if not any(isinstance(hook, SumOverTp) for hook in (param._backward_hooks or {}).values()):
                param.register_hook(SumOverTp(self.axis))

    def origin(self, local: Origin) -> Origin:
        """Where a tensor of this rank's module sits in the unsplit tensor: a slice of the dimension its
        placement says is split (the last rank's slice may reach into an uneven vocabulary's padding), or the
        whole tensor, held identically by every tp rank."""
        kind = local.placement.get("tp")
        if isinstance(kind, Shard):
            found = local.split(kind.dim, kind.full, self.axis.rank)
            if kind.packed:  # one part of a packed tensor: its box sits at the part's offset
                found = found.within(kind.dim, kind.packed[0], kind.packed[1]).renamed(self.packed[local.name])
            return found
        return local.replicated_over("tp")

    def explain(self, name: str) -> str:
        path = name.rpartition(".")[0]
        style = self.styles.get(path)
        if style is not None:
            pattern = next((p for p, s in self.plan.items() if s == style and match(p, path)), "?")
            return f"the tensor-parallel plan gave module '{path}' the style '{style}' (pattern '{pattern}')"
        splitting = [p for p, s in self.plan.items() if s in SHARDING]
        hint = (" Under sequence parallelism every module with parameters that runs on s/tp tokens must be marked "
                "'sequence' in the plan (its gradients are then summed over tp)") if self.sequence_parallel else ""
        return (f"no pattern of the tensor-parallel plan matched module '{path}', so the tensor-parallel step "
                f"kept it whole on every tp rank (splitting patterns: {splitting}).{hint}")

    def note(self) -> str:
        split = sum(1 for s in self.styles.values() if s in SHARDING)
        return (f"tensor parallel over {self.axis.size} ranks: {split} modules split"
                f"{', sequence parallel' if self.sequence_parallel else ''}")


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def _wrap_forward(module: nn.Module, around) -> None:
    """Make `module.forward(*a, **k)` call `around(original_forward, *a, **k)`."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return around(inner, *args, **kwargs)

    module.forward = forward


def _forked(tracker: RNGTracker, inner, *args, **kwargs):
    with tracker.fork():
        return inner(*args, **kwargs)


class SumOverTp:
    """A parameter hook: the gradient this rank computed from its s/tp tokens only, summed over tp before it
    accumulates (the backward of `copy_to_region`, for a parameter). A class, so a parameter can be asked
    whether it has one already; it holds the axis only, so it keeps no engine alive."""

    def __init__(self, axis: Axis):
        self.axis = axis

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone(memory_format=torch.contiguous_format)  # a hook must not change its argument
        all_reduce(grad, self.axis, tag=GRAD_TAG)
        return grad


def _region_input_hook(path: str, axis: Axis, sequence_parallel: bool):
    """The module's input (b, s, h) enters the tp region: its first positional argument, or, for modules
    called with keywords only (transformers' `self_attn(hidden_states=...)`), its first forward parameter."""
    def enter(x: torch.Tensor) -> torch.Tensor:
        return gather_from_sequence(x, axis, SEQ_DIM, ACTIVATION_TAG) if sequence_parallel \
            else copy_to_region(x, axis, ACTIVATION_TAG)

    first_parameter: list[str | None] = []  # forward's first parameter name, looked up on the first keyword call

    def hook(module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            return (enter(args[0]), *args[1:]), kwargs
        if not first_parameter:
            first_parameter.append(next(iter(inspect.signature(module.forward).parameters), None))
        first = first_parameter[0]
        if not args and isinstance(kwargs.get(first), torch.Tensor):
            return args, {**kwargs, first: enter(kwargs[first])}
        raise PlanError(f"'{path}' (region_input) must receive a tensor as its first argument (positional, or "
                        f"by the name of forward's first parameter)")

    return hook


def _sequence_scatter_hook(path: str, axis: Axis):
    def hook(module, args, output):
        if not isinstance(output, torch.Tensor):
            raise PlanError(f"'{path}' (sequence_scatter) must return one tensor (b, s, h), got {type(output)}")
        return scatter_to_region(output, axis, SEQ_DIM, SCATTER_TAG)  # (b, s, h) -> (b, s/tp, h)

    return hook


def _vocab_loss(old: nn.Module, head: ColumnParallelLinear, axis: Axis, path: str) -> VocabParallelCrossEntropy:
    if isinstance(old, nn.CrossEntropyLoss) and (old.reduction != "mean" or old.label_smoothing or
                                                 old.weight is not None):
        raise PlanError(f"'{path}' (vocab_loss): the vocab-parallel loss is the mean cross-entropy without class "
                        f"weights or label smoothing; set reduction='mean' and drop the others")
    if any(True for _ in old.parameters()):
        raise PlanError(f"'{path}' (vocab_loss) has parameters; the vocab-parallel loss replaces it entirely")
    return VocabParallelCrossEntropy(axis, head.out_features, head.vocab_start, head.local_out_features,
                                     ignore_index=getattr(old, "ignore_index", -100), name=path)


def parallelize(model: nn.Module, mesh: Mesh | Axis, plan: dict[str, str] | str | None = None,
                sequence_parallel: bool = False, seed: int = 0, placements: Placements | None = None) -> AppliedPlan:
    """Split `model` over the tp axis as `plan` says ({module-path pattern: style}, a model family's name, or
    None for the model spec's ready plan). In place.

    `mesh` is the paratrain Mesh (its "tp" axis is used) or the tp Axis itself. `seed` seeds the
    per-tp-rank random stream. What each parameter became over tp is recorded in `placements` (the parallel
    model's; a new one when None), which the returned step keeps.
    """
    axis = mesh.axis("tp") if isinstance(mesh, Mesh) else mesh
    sp = sequence_parallel and axis.size > 1
    styles = resolve_plan(model, plan, axis.size, sp)  # pure: raises before anything changes
    tracker = RNGTracker(seed, axis.rank)
    placements = Placements() if placements is None else placements
    applied = AppliedPlan(styles, axis, sp, plan=plan_for(model, plan), tracker=tracker, placements=placements)
    regions = [p for p, s in styles.items() if s == "region_input"]
    packed = packed_parts(model, plan)
    head = None
    for path, style in styles.items():  # split layers first: the loss needs the head's vocabulary range
        if style not in SHARDING:
            continue
        old = model.get_submodule(path)
        if isinstance(old, LoraLinear):  # split in place: its base and adapters each get their style (tp/lora.py)
            applied.summed += split_adapter_layer(old, path, style, axis, sp)
            if style == "colwise" and not any(path.startswith(r + ".") for r in regions):
                old.register_forward_pre_hook(_region_input_hook(path, axis, sp), with_kwargs=True)
            continue
        if style == "rowwise":
            new = RowParallelLinear(old, axis, name=path, sequence_parallel=sp)
        elif style in ("vocab", "vocab_scatter"):
            new = VocabParallelEmbedding(old, axis, name=path, scatter_sequence=sp and style == "vocab_scatter")
        else:
            entered = any(path.startswith(r + ".") for r in regions)
            new = ColumnParallelLinear(old, axis, name=path, gather_output=style == "colwise_gather",
                                       enter_region=not entered, sequence_parallel=sp,
                                       pad_output=style == "colwise_vocab", parts=packed.get(path))
            applied.packed.update({f"{path}.{attr}_{i}": f"{path}.{attr}" for i in range(len(packed.get(path, ())))
                                   for attr in ("weight", "bias")})
            head = new if style == "colwise_vocab" else head
        _set_submodule(model, path, new)
    for path, style in styles.items():
        module = model.get_submodule(path)
        if style == "vocab_loss":
            _set_submodule(model, path, _vocab_loss(module, head, axis, path))
        elif style == "region_input":
            module.register_forward_pre_hook(_region_input_hook(path, axis, sp), with_kwargs=True)
        elif style == "in_region":
            _wrap_forward(module, functools.partial(_forked, tracker))
        elif style == "sequence" and sp:
            if hasattr(module, "split_tokens_over"):  # a module whose outputs include means over its tokens
                module.split_tokens_over(axis)
            applied.summed += [(sub, n) for sub in module.modules() for n, p in sub._parameters.items()
                               if p is not None and p.requires_grad]
            _wrap_forward(module, functools.partial(_forked, tracker))
        elif style == "sequence_scatter" and sp:
            module.register_forward_hook(_sequence_scatter_hook(path, axis))
    _record_placements(model, placements)
    applied.sum_replicated_gradients()
    return applied


def _record_placements(model: nn.Module, placements: Placements) -> None:
    """What each split layer declares it holds; every other parameter is whole on every tp rank."""
    for layer in model.modules():
        if isinstance(layer, SPLIT_LAYERS):
            for name, kind in layer.placements.items():
                placements.record(getattr(layer, name), "tp", kind)
    for param in model.parameters():
        if placements.of(param).get("tp") is None:
            placements.record(param, "tp", Replicate())
