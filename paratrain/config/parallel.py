"""Config sections of the layout: data, tensor, pipeline and context parallelism, activation checkpointing."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from paratrain.config.section import Section
from paratrain.errors import InvalidValueError

# The pipeline schedules, named once: the config's choices, the runtime's builders (parallel/pp/actions.py) and
# the planner's layouts all read these.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")
V_SCHEDULES: tuple[str, ...] = ("zb-v", "dualpipev")  # two chunks per rank in a V: stages r and 2p - 1 - r
ScheduleName = Literal[SCHEDULES]  # type: ignore[valid-type] (a Literal of the tuple's strings)


class DataParallelConfig(Section):
    """paratrain's own DDP knobs. `size=-1` means world / (pp*cp*tp)."""

    size: int = -1
    replicate: int = Field(1, ge=1)
    """HSDP: of the data-parallel ranks, groups of `replicate` hold the same ZeRO shards (ZeRO shards over the
    other dp / replicate, and dp x cp with context parallelism); gradients are reduce-scattered inside a shard
    group and the shards all-reduced across the replicas. Needs zero_optimization.stage >= 1 (DeepSpeed's
    zero_optimization.mics_shard_size sets it too)."""
    bucket_cap_mb: float = Field(25.0, gt=0.0)
    """DDP gradient bucket size; a bucket's all-reduce starts as soon as it is full."""
    allow_unused_parameters: bool = False
    """Treat parameters that get no gradient as zero instead of raising."""
    broadcast_buffers: bool = True
    """Broadcast buffers from dp rank 0 at start (parameters always are)."""

    @field_validator("size")
    @classmethod
    def _size(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise InvalidValueError("must be a positive integer, or -1 for 'the rest of the world'")
        return value


class TensorParallelConfig(Section):
    """Megatron-style tensor parallelism over the tp axis (see docs/strategies.md)."""

    size: int = Field(1, ge=1)
    """Ranks that split each layer's weight matrices (consecutive ranks of the mesh)."""
    sequence_parallel: bool = False
    """Norm/dropout/residual regions hold s/tp tokens; all-gathers and reduce-scatters replace the all-reduces."""
    plan: dict[str, str] | str | None = None
    """{module-path pattern: style}, or a built-in plan name ("gpt"); None uses the model's ready plan (GPT)."""


class PipelineConfig(Section):
    """Pipeline parallelism: the model's layers cut into stages over the pp axis (see docs/strategies.md)."""

    stages: int = Field(1, ge=1)
    """Pipeline ranks (p); 1 disables pipelining."""
    schedule: ScheduleName = "1f1b"
    """Order of forwards and backwards: gpipe, 1f1b, interleaved (virtual_stages chunks per rank), zb-h1 (split
    backward), zb-v and dualpipev (two chunks per rank in a V, split backward; dualpipev needs m >= 2p)."""
    micro_batches: int | None = Field(None, ge=1)
    """Micro-batches per optimizer step (m): the same number as gradient_accumulation_steps, which it sets."""
    virtual_stages: int = Field(1, ge=1)
    """Stages (chunks) per rank (v): the interleaved schedule's; zb-v and dualpipev run a V of 2 chunks per rank,
    which is also their default (only 2 works for them)."""
    partition: Literal["uniform", "parameters", "balanced"] | list[int] = "parameters"
    """How layers are cut: uniform (count), parameters, balanced (profiled time), or boundaries [0, ..., L]."""

    @field_validator("schedule", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _a_v_has_two_chunks(self) -> PipelineConfig:
        if "virtual_stages" not in self.model_fields_set and self.schedule in ("zb-v", "dualpipev"):
            object.__setattr__(self, "virtual_stages", 2)
        return self


class ContextParallelConfig(Section):
    """The sequence split over the cp axis, attention exact over the whole of it (docs/strategies.md)."""

    size: int = Field(1, ge=1)
    """Ranks that split each sequence (the model's seq_len must be divisible by 2 x size)."""
    method: Literal["ring", "ulysses", "usp"] = "ring"
    """ring: K/V blocks travel around the cp ranks (each holds 2 mirrored chunks); ulysses: an all-to-all gives
    each rank every token of heads/size heads (size must divide the heads of each tp rank); usp: Ulysses over
    ulysses_size ranks inside, ring attention across size/ulysses_size groups."""
    ulysses_size: int | None = Field(None, ge=1)
    """usp: ranks of the Ulysses sub-axis (a divisor of size, between 1 and size); ulysses: size (the default)."""

    @model_validator(mode="after")
    def _sizes(self) -> ContextParallelConfig:
        u = self.ulysses_size
        if self.method == "usp" and (u is None or not 1 < u < self.size or self.size % u):
            works = [d for d in range(2, self.size) if self.size % d == 0]
            raise InvalidValueError(f"context_parallel.method 'usp' needs context_parallel.ulysses_size, a divisor "
                                    f"of context_parallel.size ({self.size}) strictly between 1 and it: one of "
                                    f"{works or 'none (use a size with a proper divisor, e.g. 4)'}; got {u}")
        if self.method == "ulysses" and u not in (None, self.size):
            raise InvalidValueError(f"context_parallel.method 'ulysses' runs Ulysses over all {self.size} cp ranks: "
                                    f"drop context_parallel.ulysses_size ({u}), or use method 'usp' for Ulysses "
                                    f"inside ring attention")
        if self.method == "ring" and u is not None:
            raise InvalidValueError("context_parallel.ulysses_size is for methods 'ulysses' and 'usp'; drop it or "
                                    "set context_parallel.method")
        return self

    @property
    def cp_ulysses(self) -> int:
        """The Ulysses sub-axis size of the mesh (1 unless usp)."""
        return self.ulysses_size if self.method == "usp" else 1


class ExpertParallelConfig(Section):
    """Mixture-of-experts layers' experts split over ep ranks, folded inside dp x cp (docs/strategies.md)."""

    size: int = Field(1, ge=1)
    """Ranks that split each MoE layer's experts (a divisor of dp x cp and of the number of experts); tokens
    reach their experts by all-to-all. Ranks holding the same experts reduce (and ZeRO-shard) them."""


class ActivationCheckpointingConfig(Section):
    """Recompute activations in backward instead of keeping them (in every layout; see docs/strategies.md)."""

    enabled: bool = False
    """Turn recomputation on."""
    granularity: Literal["full", "selective"] = "full"
    """full: each transformer block keeps only its input (children of an nn.ModuleList; a PipelineModule's
    layers); selective: only the attention cores are recomputed (Korthikanti et al.)."""
    # DeepSpeed's keys: DeepSpeed's engine ignores them too (only deepspeed.checkpointing.configure reads them,
    # and paratrain refuses deepspeed.checkpointing by name), so a tutorial config loads unchanged.
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
