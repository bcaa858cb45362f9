"""Activation checkpointing: recompute parts of the forward in backward instead of keeping their activations.

    applied = checkpoint_activations(model, "full", blocks=transformer_blocks(model), rng_streams=[tracker])

- `full`: every transformer block keeps only its input; its whole forward runs again in its backward
  (one more forward of the model per step, the block's forward communication included).
- `selective`: only the attention cores are recomputed (Korthikanti et al. 2022, section 5): the part whose
  activations grow with s² (softmax scores, dropout mask) in unfused attention but costs few FLOPs. A fused
  (flash) kernel keeps no scores, so there selective saves only the core's softmax statistics and output.
  Under context parallelism the core is ring attention: its recompute sends the K/V blocks around again.

[Note: the checkpoint wraps `forward`, inside the module's call]
Hooks on the module itself (ZeRO-3 gathers the unit before its forward and frees it after; tensor
parallelism's region entries) run once, in the real forward, outside the recomputed region. In backward,
ZeRO-3 regathers a unit before its backward starts, which is before the recompute reads the parameters.
Hooks on modules *inside* the region (a nested ZeRO-3 unit, a 'region_input' attention) run again during the
recompute; ZeRO-3 keeps a unit gathered when its forward runs inside a backward (see fsdp.py), because its
backward follows at once.

[Note: random numbers are replayed]
`torch.utils.checkpoint` saves and restores the default generator (dropout outside the tensor-parallel
regions). Tensor parallelism's per-rank streams (`rng_streams`, anything with get_state/set_state) are
invisible to it: `_stream_contexts` snapshots each stream when the region's forward starts and, for the
recompute, swaps that snapshot in and the stream's current state back afterwards. The recompute therefore
draws exactly the masks of the forward, and the streams continue as if no recompute had happened.

[Note: no early stop]
torch stops a recompute as soon as the last tensor backward needs has been rebuilt, which would skip a
block's closing collective (the row-parallel all-reduce) or not, depending on whether a dropout mask follows
it. Every rank of a group would still skip alike, but the communication of a step would depend on the model's
dropout; recomputing the whole region keeps it one more forward, exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.errors import InvalidValueError
from paratrain.layout.origin import Step

GRANULARITIES = ("full", "selective")


class RNGStream(Protocol):
    def get_state(self): ...

    def set_state(self, state) -> None: ...


@dataclass
class AppliedCheckpointing(Step):
    granularity: str
    modules: list[str] = field(default_factory=list)  # module paths whose forward is recomputed
    name = "activation checkpointing"

    def note(self) -> str:
        return f"activation checkpointing ({self.granularity}): {len(self.modules)} modules recomputed"


@contextmanager
def _swapped_in(streams: Sequence[RNGStream], states: list):
    current = [s.get_state() for s in streams]
    for stream, state in zip(streams, states):
        stream.set_state(state)
    try:
        yield
    finally:
        for stream, state in zip(streams, current):
            stream.set_state(state)


def _stream_contexts(streams: Sequence[RNGStream]):
    """(forward context, recompute context): called by the checkpoint when the region's forward starts."""
    snapshot = [s.get_state() for s in streams]
    return nullcontext(), _swapped_in(streams, snapshot)


def _checkpointed_forward(inner, streams: Sequence[RNGStream]):
    context_fn = functools.partial(_stream_contexts, tuple(streams))

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation keeps nothing for backward anyway
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, early_stop=False, **kwargs)

    return forward


def checkpoint_activations(model: nn.Module, granularity: str, *, blocks: Iterable[nn.Module] = (),
                           cores: Iterable[nn.Module] = (), rng_streams: Sequence[RNGStream] = ()
                           ) -> AppliedCheckpointing:
    """Recompute the forward of `blocks` (full) or of `cores` (selective) in backward. In place: each chosen
    module's `forward` is wrapped; modules of `blocks`/`cores` that `model` does not hold (another pipeline
    stage's) are skipped."""
    if granularity not in GRANULARITIES:
        raise InvalidValueError(f"activation checkpointing granularity {granularity!r}: use one of {GRANULARITIES}")
    chosen = {id(m) for m in (blocks if granularity == "full" else cores)}
    applied = AppliedCheckpointing(granularity)
    for name, module in model.named_modules():
        if id(module) in chosen:
            module.forward = _checkpointed_forward(module.forward, rng_streams)
            applied.modules.append(name)
            chosen.discard(id(module))  # a module reachable twice is wrapped once
    return applied
