"""Reading, checking and resolving a config, with errors that name the key, the value and the fix.

Validation is pure (no collectives), so every rank reading the same file raises the same error before
any process group is touched: a bad config can never hang a job.
"""

from __future__ import annotations

import difflib
import json
import os
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, BaseModel, ValidationError

from paratrain.config.auto import refuse_auto_values
from paratrain.config.errors import ConfigError
from paratrain.config.params import check_optimizer_params, check_scheduler_params
from paratrain.config.schema import Config

# DeepSpeed sections we know and do not implement. Present with enabled=false they are harmless;
# anything else is an error, so nobody gets a silent difference from DeepSpeed.
DEEPSPEED_UNSUPPORTED = {
    "amp", "flops_profiler", "comms_logger", "autotuning", "elasticity", "compression_training",
    "sparse_attention", "data_efficiency", "curriculum_learning", "aio", "nebula",
    "comet", "quantize_training", "eigenvalue", "progressive_layer_drop", "hybrid_engine",
    "data_types", "communication_data_type", "seq_parallel_communication_data_type",
    "sparse_gradients", "dump_state", "memory_breakdown", "disable_allgather", "zero_force_ds_cpu_optimizer",
    "graph_harvesting", "use_data_before_expert_parallelism", "pipeline_parallel",
}


# Keys that moved: a config still using the old place gets told the new one.
MOVED_KEYS = {"trainer.save_every": "checkpoint.save_every"}


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation such as `Foo`, `Foo | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_of(arg)
            if found is not None:
                return found
    return None


def _field_names(model: type[BaseModel]) -> dict[str, str]:
    """Every key a section accepts (its fields' names and their other accepted names) -> the field's name."""
    names = {name: name for name in model.model_fields}
    for name, field in model.model_fields.items():
        choices = field.validation_alias.choices if isinstance(field.validation_alias, AliasChoices) else []
        names.update({choice: name for choice in choices if isinstance(choice, str)})
    return names


def _check_keys(raw: dict, model: type[BaseModel], prefix: str) -> None:
    names = _field_names(model)
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if key not in names:
            if path in MOVED_KEYS:
                raise ConfigError(f"config key '{path}' moved to '{MOVED_KEYS[path]}'; set it there")
            if not prefix and key in DEEPSPEED_UNSUPPORTED:
                if isinstance(value, dict) and value.get("enabled", True) is False:
                    continue
                raise ConfigError(f"config key '{key}' is a DeepSpeed feature paratrain does not support; "
                                  f"remove it (or set {key}.enabled to false) — see docs/deepspeed-compat.md")
            close = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.6)
            hint = f"did you mean '{prefix}{close[0]}'?" if close else \
                f"known keys here: {', '.join(sorted(names))}"
            raise ConfigError(f"unknown config key '{path}'; {hint}")
        sub = _model_of(model.model_fields[names[key]].annotation)
        if sub is not None and isinstance(value, dict):
            _check_keys(value, sub, f"{path}.")


def _explain(error: ValidationError) -> ConfigError:
    lines = []
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        value = item.get("input")
        shown = json.dumps(value) if isinstance(value, (int, float, str, bool, type(None))) else repr(value)
        lines.append(f"config key '{key}' = {shown[:80]}: {message}")
    return ConfigError("invalid config:\n  " + "\n  ".join(lines))


def load_config(source: Config | dict | str | os.PathLike | None) -> Config:
    """Build a Config from a dict, a JSON file path or an existing Config (copied)."""
    if isinstance(source, Config):
        return _with_checked_params(source.model_copy(deep=True))
    if source is None:
        raw: dict = {}
    elif isinstance(source, dict):
        raw = source
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist; pass the path of a JSON config")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file '{path}' is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a JSON object (a dict), got {type(raw).__name__}")
    refuse_auto_values(raw)
    _check_keys(raw, Config, "")
    # Disabled DeepSpeed-only sections passed the key check; they change nothing, so drop them.
    raw = {k: v for k, v in raw.items() if k in Config.model_fields}
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        raise _explain(exc) from None
    return _with_checked_params(config)


def _with_checked_params(config: Config) -> Config:
    """The optimizer's and scheduler's params by name and type: their constructors run only after the
    process groups exist, where an error would not name the key (see config/params.py)."""
    if config.optimizer is not None:
        check_optimizer_params(config.optimizer.type, config.optimizer.params)
    if config.scheduler is not None:
        check_scheduler_params(config.scheduler.type, config.scheduler.params)
    return config


def resolve_batch(config: Config, world_size: int) -> Config:
    """Fill the three batch keys from any two (DeepSpeed's rule; "gpus" means the dp size) and check the
    layout sizes against the world. Returns a new, fully resolved Config."""
    cfg = config.model_copy(deep=True)
    mp = cfg.model_parallel_size
    sizes = (f"pipeline.stages ({cfg.pipeline.stages}) x context_parallel.size ({cfg.context_parallel.size}) "
             f"x tensor_parallel.size ({cfg.tensor_parallel.size})")
    if world_size % mp:
        raise ConfigError(f"{sizes} = {mp} does not divide the world size {world_size}; launch a multiple of "
                          f"{mp} processes or change the sizes")
    dp = cfg.dp_size(world_size)
    if dp * mp != world_size:
        raise ConfigError(f"data_parallel.size ({dp}) x {sizes} = {dp * mp}, but {world_size} processes were "
                          f"launched; set data_parallel.size to {world_size // mp} or -1 (the rest)")
    tbs, mbs, gas = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    pipe_m = cfg.pipeline.micro_batches
    if pipe_m is not None:  # DeepSpeed's pipeline: the micro-batches of a step are the accumulation steps
        if gas is not None and gas != pipe_m:
            raise ConfigError(f"pipeline.micro_batches ({pipe_m}) and gradient_accumulation_steps ({gas}) disagree: "
                              f"a pipeline runs gradient_accumulation_steps micro-batches per optimizer step; set "
                              f"them equal or remove one")
        gas = pipe_m
    rule = (f"train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
            f"data-parallel size ({dp})")
    if tbs is None and mbs is None:
        raise ConfigError("set train_batch_size or train_micro_batch_size_per_gpu (the third batch key is "
                          f"derived: {rule})")
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * dp:
            raise ConfigError(
                f"batch sizes do not add up: {rule}, but {tbs} != {mbs} x {gas} x {dp} = {mbs * gas * dp}. "
                f"Fix: set train_batch_size to {mbs * gas * dp}, or remove one of the three keys and it will "
                f"be derived")
    elif tbs is not None and mbs is not None:
        if tbs % (mbs * dp):
            raise ConfigError(
                f"train_batch_size ({tbs}) is not divisible by train_micro_batch_size_per_gpu ({mbs}) x "
                f"data-parallel size ({dp}) = {mbs * dp}, so gradient_accumulation_steps cannot be derived "
                f"({rule}); use a train_batch_size that is a multiple of {mbs * dp}")
        gas = tbs // (mbs * dp)
    elif tbs is not None:
        gas = gas or 1
        if tbs % (gas * dp):
            raise ConfigError(
                f"train_batch_size ({tbs}) is not divisible by gradient_accumulation_steps ({gas}) x "
                f"data-parallel size ({dp}) = {gas * dp}, so train_micro_batch_size_per_gpu cannot be derived "
                f"({rule}); use a train_batch_size that is a multiple of {gas * dp}")
        mbs = tbs // (gas * dp)
    else:
        gas = gas or 1
        tbs = mbs * gas * dp
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = tbs, mbs, gas
    if cfg.pipeline.stages > 1:
        cfg.pipeline.micro_batches = gas
    return cfg
