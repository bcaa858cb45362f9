"""Building a model with no memory: its tensors on the meta device, to be materialized shard by shard.

    with paratrain.init_empty():        # DeepSpeed: with deepspeed.zero.Init(): (paratrain.zero.Init)
        model = Llama("llama3-70b")

`initialize()` then splits the model, allocates only this rank's part and fills it (`paratrain.init.replay`).
This module depends on torch alone, so `paratrain.zero` (DeepSpeed's `zero.Init`) can use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

RNG_ATTRIBUTE = "_paratrain_init_rng"  # on every tensor registered under init_empty: the state it started from


@contextmanager
def init_empty():
    """Build modules on the meta device, remembering the random state construction starts from (on each
    tensor registered inside), so `initialize` can give them the values eager construction would have.

    The state is read when a tensor is registered, not when the context opens: a model whose constructor (or
    the code before it, inside the context) seeds the generator starts from that seed, as it would eagerly.
    Meta construction draws nothing from the CPU generator, so one model's tensors all see the same state;
    they share one recorded tensor (5 KiB each would be 1 MiB for a 200-parameter model)."""
    last: list[torch.Tensor] = []

    def tag(module, name, tensor):
        if tensor is None:
            return
        state = torch.get_rng_state()
        if not last or not torch.equal(state, last[0]):
            last[:] = [state]
        setattr(tensor, RNG_ATTRIBUTE, last[0])

    hooks = [register_module_parameter_registration_hook(tag), register_module_buffer_registration_hook(tag)]
    try:
        with torch.device("meta"):
            yield
    finally:
        for hook in hooks:
            hook.remove()


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in model_tensors(model))


def model_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()
