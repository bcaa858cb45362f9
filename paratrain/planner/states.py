"""Model-state bytes of a number of parameters: `paratrain.zero.estimate_memory`'s figures, as the planner adds them."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.zero import estimate_memory as estimate_model_states


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ModelStates:
    """Bytes per kind wherever they live (`engine.memory_stats()`'s meaning); `host` of them in host memory."""

    params: int
    grads: int
    optimizer_state: int
    host: int = 0  # bytes kept in host memory (optimizer offload)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state

    @property
    def device(self) -> int:
        return self.total - self.host

    def as_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer_state": self.optimizer_state,
                "total": self.total}

    def __add__(self, other: ModelStates) -> ModelStates:
        return ModelStates(self.params + other.params, self.grads + other.grads,
                           self.optimizer_state + other.optimizer_state, self.host + other.host)


def model_state_bytes(params: int, shard_group: int, stage: int, precision: str = "fp32",
                      offload_optimizer: bool = False, optimizer_state_bytes: int = 8,
                      frozen_params: int = 0) -> ModelStates:
    """Bytes of parameters, gradients and AdamW state for `params` parameters: `paratrain.zero.estimate_memory`'s
    figures, the ones the engine measures (see the module doc).

    With `offload_optimizer` the fp32 master, its gradient (stages 2-3) and the optimizer state live in host
    memory (`host`); `device` is what stays on the accelerator.
    """
    states = estimate_model_states(params, shard_group, stage, "optimizer" if offload_optimizer else "none",
                                   precision, optimizer_state_bytes, frozen_params=frozen_params)
    return ModelStates(states["params"], states["grads"], states["optimizer_state"], states["host"])
