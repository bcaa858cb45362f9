"""Tensor-parallel plans as data: module-path patterns mapped to styles, matched and validated in one
process (no process group), so a bad plan fails identically on every rank before any collective.

    {"blocks.*.attn.[qkv]": "colwise", "blocks.*.attn.o": "rowwise", ...}

A pattern is a dotted module path; each component is matched with shell wildcards (`*`, `?`, `[qkv]`)
and `**` matches any number of components. Every pattern must match at least one module and every
module gets at most one style. What each style does is in `STYLES`; docs/strategies.md explains how to
write a plan for your own model.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from paratrain.adapters import LoraLinear
from paratrain.layout.patterns import match
from paratrain.model_spec import plan_names, spec_for, spec_named
from paratrain.parallel.tp.layers import PlanError, is_conv1d, linear_features
from paratrain.parallel.tp.lora import check_adapter_style


@dataclass(frozen=True)
class Style:
    module_type: type | None  # the module class the style applies to (None: any module)
    summary: str


STYLES: dict[str, Style] = {
    "colwise": Style(nn.Linear, "output features split; the input enters the tp region here (copy, or all-gather "
                                "of the sequence under sequence parallel) unless a 'region_input' parent did"),
    "colwise_gather": Style(nn.Linear, "colwise, with the output gathered back to all features"),
    "colwise_vocab": Style(nn.Linear, "the output head: colwise over the vocabulary (uneven sizes padded); its "
                                      "logits stay split and go to the 'vocab_loss' module"),
    "rowwise": Style(nn.Linear, "input features split; output summed over tp (all-reduce, or reduce-scatter to "
                                "the sequence shard under sequence parallel)"),
    "vocab": Style(nn.Embedding, "vocabulary split; output all-reduced (replicated)"),
    "vocab_scatter": Style(nn.Embedding, "vocabulary split; under sequence parallel the output is reduce-scattered "
                                         "to s/tp (the sequence-parallel region starts here)"),
    "vocab_loss": Style(None, "replaced by the vocab-parallel cross-entropy, forward(logits, targets)"),
    "region_input": Style(None, "the module's first input enters the tp region once, for all colwise layers "
                                "inside it (q, k, v share one entry)"),
    "in_region": Style(None, "runs inside the tp region on this rank's heads/features: its random numbers "
                             "(dropout) come from the per-tp-rank stream"),
    "sequence": Style(None, "runs on s/tp tokens under sequence parallel (norms, dropout): gradients of its "
                            "parameters are summed over tp, random numbers per tp rank; nothing without it"),
    "sequence_scatter": Style(None, "under sequence parallel, the module's (replicated) output is split to this "
                                    "rank's s/tp tokens (the sequence-parallel region starts here)"),
    "replicate": Style(None, "deliberately not split: the module stays whole on every tp rank"),
}
SHARDING = {"colwise", "colwise_gather", "colwise_vocab", "rowwise", "vocab", "vocab_scatter"}
COLWISE = {"colwise", "colwise_gather"}

def check_plan_syntax(plan, where: str = "tensor_parallel.plan") -> dict[str, str] | None:
    """Validate a plan's form without a model: a built-in name, or {pattern: style}. Returns the dict."""
    if plan is None:
        return None
    if isinstance(plan, str):  # a model family's ready plan, resolved with the model (`ModelSpec.tp_plan`)
        if plan not in plan_names():
            raise PlanError(f"config key '{where}' = {plan!r} is not a built-in plan (a model family with a ready "
                            f"plan); use one of {plan_names()} or a {{module-pattern: style}} mapping")
        return None
    if not isinstance(plan, Mapping) or not plan:
        raise PlanError(f"config key '{where}' must be a built-in plan name or a non-empty {{module-pattern: "
                        f"style}} mapping, got {plan!r}")
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern or not isinstance(style, str):
            raise PlanError(f"config key '{where}': entry {pattern!r}: {style!r} must map a module-path pattern "
                            f"to a style name")
        base, parts = split_style(style, f"{where}.{pattern}")
        if base not in STYLES:
            close = difflib.get_close_matches(style, list(STYLES), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise PlanError(f"config key '{where}.{pattern}' = {style!r} is not a style; {hint}styles: "
                            f"{', '.join(STYLES)}")
    return dict(plan)


def split_style(style: str, where: str = "tensor_parallel.plan") -> tuple[str, tuple[int, ...] | None]:
    """'colwise:256,128,128' -> ('colwise', (256, 128, 128)): a packed projection (q, k, v in one weight) whose
    parts are split over tp each on its own; any other style -> (style, None)."""
    base, _, sizes = style.partition(":")
    if not sizes:
        return style, None
    try:
        parts = tuple(int(v) for v in sizes.split(","))
    except ValueError:
        parts = ()
    if base != "colwise" or not parts or min(parts) <= 0:
        raise PlanError(f"config key '{where}' = {style!r}: only 'colwise' takes part sizes, written "
                        f"'colwise:SIZE,SIZE,...' with positive integers (the output features of each packed part)")
    return base, parts


def packed_parts(model: nn.Module, plan: Mapping[str, str] | str | None) -> dict[str, tuple[int, ...]]:
    """{module path: part sizes} of the plan's packed colwise layers."""
    plan = plan_for(model, plan)
    out = {}
    for pattern, style in plan.items():
        parts = split_style(style)[1]
        if parts:
            out.update({p: parts for p, _ in model.named_modules() if p and match(pattern, p)})
    return out


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _scope(path: str) -> str:
    return f"'{_parent(path)}'" if _parent(path) else "the model"


def _inside(path: str, ancestor: str) -> bool:
    return ancestor == "" or path.startswith(ancestor + ".")


def plan_for(model: nn.Module, plan: Mapping[str, str] | str | None) -> dict[str, str]:
    """The plan as a mapping: `plan` itself, the ready plan of the family it names, or (None) the ready plan of
    `model`'s own spec (`paratrain.model_spec`)."""
    if isinstance(plan, str):
        check_plan_syntax(plan)
        plan = spec_named(plan).tp_plan(model)
    elif plan is None:
        plan = spec_for(model).tp_plan(model)
        if plan is None:
            raise PlanError(f"tensor_parallel.size > 1 needs a plan for {type(model).__name__}: set "
                            f"'tensor_parallel.plan' to a {{module-pattern: style}} mapping (styles: "
                            f"{', '.join(STYLES)}), or register a model spec whose tp_plan() gives one "
                            f"(paratrain.model_spec); the families with a ready plan: {plan_names()}")
    return check_plan_syntax(plan)


def resolve_plan(model: nn.Module, plan: Mapping[str, str] | str | None, tp_size: int,
                 sequence_parallel: bool) -> dict[str, str]:
    """Match `plan` (see `plan_for`) against `model` and check it; returns {module path: style} in module order."""
    plan = plan_for(model, plan)
    modules = dict(model.named_modules())
    paths = [p for p in modules if p]
    assigned: dict[str, tuple[str, str]] = {}  # path -> (style, pattern)
    for pattern, style in plan.items():
        style, parts = split_style(style)
        hits = [p for p in paths if match(pattern, p)]
        if not hits:
            close = difflib.get_close_matches(pattern, paths, n=3, cutoff=0.5)
            hint = f"close module names: {', '.join(close)}" if close else f"module names look like: " \
                f"{', '.join(paths[:6])}"
            raise PlanError(f"tensor-parallel plan pattern '{pattern}' ({style}) matches no module of "
                            f"{type(model).__name__}; {hint}")
        for p in hits:
            if p in assigned and assigned[p][0] != style:
                raise PlanError(f"module '{p}' is matched by '{assigned[p][1]}' ({assigned[p][0]}) and by "
                                f"'{pattern}' ({style}); make the patterns match it once")
            assigned[p] = (style, pattern)
    out = {p: assigned[p][0] for p in paths if p in assigned}
    _check_types_and_sizes(out, modules, tp_size, packed_parts(model, plan))
    _check_consistency(out, modules, sequence_parallel)
    return out


def _check_types_and_sizes(plan: dict[str, str], modules: dict[str, nn.Module], tp: int,
                           packed: dict[str, tuple[int, ...]]) -> None:
    for path, style in plan.items():
        module, want = modules[path], STYLES[style].module_type
        if isinstance(module, LoraLinear):
            check_adapter_style(path, module, style, packed.get(path), tp)
        elif want is not None and not isinstance(module, want) and not (want is nn.Linear and is_conv1d(module)):
            raise PlanError(f"'{path}' is a {type(module).__name__}, but style '{style}' applies to "
                            f"{want.__name__} modules; give it a style for any module (e.g. 'sequence') or "
                            f"remove it from the plan")
        if want is not nn.Linear:
            continue
        in_features, out_features, _ = linear_features(module)
        parts = packed.get(path)
        if parts and (sum(parts) != out_features or any(p % tp for p in parts)):
            raise PlanError(f"'{path}' (colwise:{','.join(map(str, parts))}) packs parts of {list(parts)} features "
                            f"into {out_features}: they must add up to it, and tensor_parallel.size {tp} must "
                            f"divide each")
        if style in COLWISE and out_features % tp:
            raise PlanError(f"'{path}' ({style}) splits out_features {out_features} over tensor_parallel."
                            f"size {tp}, which does not divide it; choose a size that divides {out_features}")
        if style == "rowwise" and in_features % tp:
            raise PlanError(f"'{path}' (rowwise) splits in_features {in_features} over tensor_parallel."
                            f"size {tp}, which does not divide it; choose a size that divides {in_features}")


def _check_consistency(plan: dict[str, str], modules: dict[str, nn.Module], sequence_parallel: bool) -> None:
    by_style: dict[str, list[str]] = {}
    for path, style in plan.items():
        by_style.setdefault(style, []).append(path)
    colwise = by_style.get("colwise", []) + by_style.get("colwise_gather", [])
    for path in by_style.get("rowwise", []):
        if not any(_inside(c, _parent(path)) for c in by_style.get("colwise", [])):
            raise PlanError(f"'{path}' is rowwise but no colwise layer sits beside it in {_scope(path)}: its input "
                            f"would not be split; mark the layers that feed it 'colwise'")
    for path in by_style.get("colwise", []):
        if not any(_inside(r, _parent(path)) for r in by_style.get("rowwise", [])):
            raise PlanError(f"'{path}' is colwise but no rowwise layer sits beside it in {_scope(path)}: its "
                            f"split output would never be summed back; mark the layer that consumes it 'rowwise', "
                            f"or use 'colwise_gather'")
    _check_unplanned_siblings(plan, modules, colwise)
    heads, losses = by_style.get("colwise_vocab", []), by_style.get("vocab_loss", [])
    if len(heads) != len(losses) or len(heads) > 1:
        raise PlanError(f"a 'colwise_vocab' head ({heads or 'none'}) and a 'vocab_loss' module ({losses or 'none'}) "
                        f"go together, one of each: the split logits only make sense to the vocab-parallel loss; "
                        f"use 'colwise_gather' for a head whose full logits you need")
    regions = by_style.get("region_input", [])
    for region in regions:
        if any(_inside(region, other) for other in regions if other != region):
            raise PlanError(f"'region_input' modules are nested ('{region}'); mark only the outer one")
        if not any(_inside(c, region) for c in colwise):
            raise PlanError(f"'{region}' is a 'region_input' but contains no colwise layer to consume the entry")
    for path in by_style.get("sequence", []):
        inner = [p for p in plan if _inside(p, path) and plan[p] in SHARDING]
        if inner:
            raise PlanError(f"'{path}' ({plan[path]}) contains tensor-parallel layers {inner}; give the style to "
                            f"the modules around them instead")
    _check_shared_parameters(plan, modules)
    if sequence_parallel and not (by_style.get("sequence_scatter") or by_style.get("vocab_scatter")):
        raise PlanError("tensor_parallel.sequence_parallel is on but the plan says nowhere where the sequence is "
                        "split: mark the module that starts the sequence-parallel region 'sequence_scatter' (e.g. the "
                        "embedding) or the token embedding 'vocab_scatter'")


def _check_unplanned_siblings(plan: dict[str, str], modules: dict[str, nn.Module], colwise: list[str]) -> None:
    """An unplanned Linear shaped like a colwise sibling (a forgotten `v` beside `q` and `k`) would produce
    all heads where its siblings produce this rank's share; name it instead of failing deep in attention."""
    for path in colwise:
        shape = linear_features(modules[path])[:2]
        for other, module in modules.items():
            if other in plan or _parent(other) != _parent(path) or not isinstance(module, nn.Linear):
                continue
            if linear_features(module)[:2] == shape:
                raise PlanError(f"'{other}' is a Linear shaped like its colwise sibling '{path}' but is not in the "
                                f"plan, so its output would not be split like its sibling's; mark it 'colwise' too, "
                                f"or 'replicate' if it is meant to stay whole")


def _check_shared_parameters(plan: dict[str, str], modules: dict[str, nn.Module]) -> None:
    """A parameter used by a split layer and by another module (tied weights) cannot be split for one only."""
    owners: dict[int, list[str]] = {}
    for path, module in modules.items():
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(f"{path}.{name}" if path else name)
    for path, style in plan.items():
        if style not in SHARDING:
            continue
        for param in modules[path].parameters(recurse=False):
            if len(owners[id(param)]) > 1:
                raise PlanError(f"'{path}' ({style}) shares a parameter with {owners[id(param)]} (tied weights); "
                                f"tensor parallelism splits it for one module only. Untie the weights first")
