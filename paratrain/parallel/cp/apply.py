"""Apply context parallelism to a model in place: attention cores that see the whole sequence (ring
attention, Ulysses' all-to-all, or both: USP) and the split of its inputs.

    applied = context_parallelize(model, mesh, cores, method="ring")  # cores: the model spec's attention cores
    loss = model(idx, targets)                   # idx, targets: the full (b, s) batch, the same on every cp rank

[Note: where the sequence is split]
Every cp rank of a data-parallel group receives the same micro-batch (the data pipeline, the engine and the
data-parallel sampler are unchanged) and keeps its share of the tokens: `split_micro_batch` cuts the token
ids, the targets (already shifted: transformers' labels are shifted before any split) and the positions
(`arange(s)` unless the batch has its own) into this rank's chunks (`sharding.py`). The document ids stay
whole: each attention core knows which tokens it holds and cuts its masks from them. The engine applies it
to each token micro-batch, the pipeline runner to each of a step's; `context_parallelize(...,
split_inputs=True)` also splits the inputs of a direct call to the model, for use without the engine.
Everything after the attention cores is token-wise, so only the cores see the other ranks' tokens.

[Note: the loss and the gradients]
Each cp rank's loss is the mean over the targets in its chunks, and the chunks hold different numbers of
them (a masked prompt, padding, the last position of a row). The engine's token reduction weights each
rank's mean by its count and divides by the global count (`paratrain.engine.token_loss`), so the gradient and the
loss are the single-process ones over the whole sequence. Parameters are replicated over cp and receive
identical averaged gradients, so they stay identical on every cp rank. Without targets the model returns
the logits of this rank's tokens in local order; `merge_sequence` puts gathered pieces back in sequence
order.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from paratrain.config.errors import ConfigError
from paratrain.data.micro_batch import MicroBatch
from paratrain.layout.mesh import Axis, Mesh
from paratrain.layout.origin import Step
from paratrain.model_spec import spec_for
from paratrain.parallel.cp.ring_attention import RingAttentionCore
from paratrain.parallel.cp.sharding import SequenceSplit, SequenceSplitError, check_divisible
from paratrain.parallel.cp.ulysses import UlyssesAttentionCore


@dataclass
class AppliedContextParallel(Step):
    """The context-parallel step: ring attention in place of the attention cores. Parameters stay whole
    and replicated over cp, so nothing needs undoing for checkpoints."""

    axis: Axis
    split: SequenceSplit | None = None  # which tokens this rank holds
    method: str = "ring"
    replaced: dict[int, nn.Module] = field(default_factory=dict)  # id(original core) -> its replacement
    name = "context parallel"

    def split_micro_batch(self, batch: MicroBatch) -> MicroBatch:
        """This rank's tokens of a token micro-batch (ids, targets, positions); its documents stay whole."""
        seq = batch.input_ids.shape[1]
        check_divisible(seq, self.split.size, f"context parallel input of shape {tuple(batch.input_ids.shape)}")
        return batch.map_tokens(lambda t: self.split.split(t, dim=1))

    def refuse_unsplit(self, args: tuple, kwargs: dict) -> None:
        given = [type(a).__name__ for a in args] + sorted(kwargs)
        raise ConfigError(f"context_parallel.size = {self.axis.size}: this forward's inputs ({given}) are not token "
                          f"data that paratrain can split over the sequence; call the engine with (input_ids, "
                          f"targets) tensors of shape (b, s), or input_ids= with labels= / targets= and optionally "
                          f"attention_mask=, position_ids=, cu_seq_lens_q=")

    def note(self) -> str:
        what = {"ring": "ring attention", "ulysses": "Ulysses all-to-all attention",
                "usp": f"USP (Ulysses over {self.split.ulysses if self.split else '?'}, ring across)"}[self.method]
        return f"context parallel over {self.axis.size} ranks: {what} in {len(self.replaced)} layers"


def check_context_parallel(model: nn.Module, cp: int) -> None:
    """Raise a ConfigError if `model` cannot run with context_parallel.size = cp (pure, no collectives). Its
    attention cores and sequence length come from its model spec."""
    if cp == 1:
        return
    spec = spec_for(model)
    cores, seq_len = spec.attention_cores(model), spec.sequence_length(model)
    name = type(model).__name__
    if not cores:
        raise ConfigError(f"context_parallel.size = {cp}: {name} has no replaceable causal attention core "
                          f"(paratrain.attention.CausalAttentionCore, or what its model spec names) for ring "
                          f"attention to replace; build the model's attention with one, or set "
                          f"context_parallel.size to 1")
    paths = {id(m): path for path, m in model.named_modules()}
    dropping = [(paths.get(id(core), "?"), core.dropout) for core in cores if getattr(core, "dropout", 0) > 0]
    if dropping:
        raise ConfigError(f"context_parallel.size = {cp}: attention dropout ({dropping[0][0]}.dropout = "
                          f"{dropping[0][1]}) is not supported by ring attention; set the model's dropout "
                          f"to 0 (trainer.model_overrides.dropout for the built-in job) or context_parallel.size "
                          f"to 1")
    params = inspect.signature(model.forward).parameters
    if "position_ids" not in params:
        raise ConfigError(f"context_parallel.size = {cp}: {name}.forward must accept `position_ids` (the positions "
                          f"of this rank's tokens), as paratrain.models.GPT does")
    if seq_len is not None:
        try:
            check_divisible(seq_len, cp, f"{name} seq_len (trainer.model_overrides.seq_len for the built-in job)")
        except SequenceSplitError as exc:
            raise ConfigError(f"context_parallel.size = {cp}: {exc}") from None


def _split_inputs_hook(split: SequenceSplit, signature: inspect.Signature):
    tokens_name = next(iter(signature.parameters))

    def hook(module, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        values = bound.arguments
        tokens = values[tokens_name]  # (b, s)
        seq = tokens.shape[1]
        check_divisible(seq, split.size, f"context parallel input '{tokens_name}' of shape {tuple(tokens.shape)}")
        positions = values.get("position_ids")
        if positions is None:
            positions = torch.arange(seq, device=tokens.device)
        values[tokens_name] = split.split(tokens, dim=1)  # (b, s/cp)
        values["position_ids"] = split.split(positions, dim=-1)  # (s/cp,) or (b, s/cp)
        if values.get("targets") is not None:
            values["targets"] = split.split(values["targets"], dim=1)
        return bound.args, bound.kwargs

    return hook


def _core_factory(mesh: Mesh | Axis, method: str) -> tuple[Axis, Callable[[], nn.Module], SequenceSplit]:
    """The cp axis, the core that replaces each attention core, and this rank's tokens, for `method`."""
    if isinstance(mesh, Axis):  # the cp axis alone: ring attention or Ulysses over all of it
        axis = mesh
        sub = None
    else:
        axis = mesh.axis("cp")
        sub = {n: mesh.axis(n) for n in ("cp_ring", "cp_ulysses") if 1 < mesh.size(n) < axis.size}
    if method == "ring":
        return axis, lambda: RingAttentionCore(axis), SequenceSplit.for_method("ring", axis.size, axis.rank)
    if method == "ulysses":
        return axis, lambda: UlyssesAttentionCore(axis), SequenceSplit.for_method("ulysses", axis.size, axis.rank)
    if not sub or "cp_ulysses" not in sub:
        raise ConfigError("context_parallel.method 'usp' needs the mesh's cp_ring and cp_ulysses dims: build "
                          "the mesh from a config with method 'usp' and its ulysses_size")
    ring, uly = sub["cp_ring"], sub["cp_ulysses"]
    split = SequenceSplit.for_method("usp", axis.size, axis.rank, uly.size)
    return axis, lambda: UlyssesAttentionCore(uly, RingAttentionCore(ring)), split


def _swap_cores(model: nn.Module, cores: list[nn.Module], applied: AppliedContextParallel,
                make: Callable[[], nn.Module]) -> None:
    """Put a new core (`make()`) wherever `model` holds one of `cores` (by identity: a pipeline stage holds
    the same layer objects as the model under other names)."""
    wanted = {id(c) for c in cores}
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            if id(child) in wanted:
                ring = applied.replaced.get(id(child)) or make()
                ring.train(child.training)
                setattr(parent, attr, ring)
                applied.replaced[id(child)] = ring


def context_parallelize(model: nn.Module, mesh: Mesh | Axis, cores: list[nn.Module] | None = None,
                        method: str = "ring", split_inputs: bool = True) -> AppliedContextParallel:
    """Swap each of the model's attention `cores` (default: its model spec's) for `method`'s core (ring
    attention, Ulysses, or USP on the mesh's cp sub-axes); with `split_inputs`, a pre-hook also splits the
    inputs of every call to the model (the engine splits micro-batches itself instead). In place."""
    axis, make, split = _core_factory(mesh, method)
    applied = AppliedContextParallel(axis, split, method)
    if axis.size == 1:
        return applied
    check_context_parallel(model, axis.size)
    _swap_cores(model, spec_for(model).attention_cores(model) if cores is None else cores, applied, make)
    if split_inputs:
        model.register_forward_pre_hook(_split_inputs_hook(split, inspect.signature(model.forward)), with_kwargs=True)
    return applied


def context_parallelize_stages(stages: nn.Module, mesh: Mesh | Axis, cores: list[nn.Module],
                               first_layer: nn.Module | None, method: str = "ring") -> AppliedContextParallel:
    """Context parallelism inside a pipeline, where no stage calls the model's forward. In place.

    [Note: where a pipeline splits the sequence]
    The runner applies `split_micro_batch` to every micro-batch before its schedule runs: the first stage then
    embeds this rank's tokens, given their positions, and the last stage's loss sees the matching targets; the
    activations sent between stages are (b, s/cp, h).
    """
    axis, make, split = _core_factory(mesh, method)
    applied = AppliedContextParallel(axis, split, method)
    if axis.size == 1:
        return applied
    _swap_cores(stages, cores, applied, make)
    if first_layer is not None and "position_ids" not in inspect.signature(first_layer.forward).parameters:
        raise ConfigError(f"context_parallel.size = {axis.size} with a pipeline: the first layer "
                          f"({type(first_layer).__name__}) must accept `position_ids` (the positions of this "
                          f"rank's tokens), as the GPT's embedding does")
    return applied
