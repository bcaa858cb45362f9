"""DeepSpeed-shaped entry points: `initialize`, `init_distributed`, `add_config_arguments`."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import replace
from pathlib import Path, PurePath

import torch.distributed as dist

from paratrain.comm import build_mesh
from paratrain.config import Config, ConfigError, load_config, resolve_batch
from paratrain.distributed import init_distributed, uses_cuda
from paratrain.engine import Engine
from paratrain.engine.strategies import strategies_of
from paratrain.errors import InvalidValueError
from paratrain.failure import install_excepthook
from paratrain.layout.mesh import ParallelDims
from paratrain.model_spec import pretrained_for
from paratrain.moe.layer import expert_parallel_size_of
from paratrain.parallel.checks import check_supported

log = logging.getLogger("paratrain")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's arguments: --deepspeed, --deepspeed_config and (unless the script declares it) --local_rank."""
    group = parser.add_argument_group("paratrain", "paratrain / DeepSpeed configuration")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable the engine (accepted for DeepSpeed compatibility)")
    group.add_argument("--deepspeed_config", "--paratrain_config", dest="deepspeed_config", default=None,
                       type=str, help="path of the JSON config")
    declared = [a for a in parser._actions if "--local_rank" in a.option_strings]
    if not declared:
        group.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                           help="set by the launcher")
    elif "LOCAL_RANK" in os.environ:
        # DeepSpeed's launcher passes --local_rank=N; torchrun (under `paratrain run`) sets LOCAL_RANK instead.
        # A script that declares --local_rank (default -1, as the tutorials do) still gets its local rank.
        declared[0].default = int(os.environ["LOCAL_RANK"])
    return parser


def _config_source(args, config, config_params):
    chosen = [c for c in (config, config_params) if c is not None]
    path = getattr(args, "deepspeed_config", None) if args is not None else None
    if path is not None:
        chosen.append(path)
    if len(chosen) > 1:
        raise ConfigError("the config was given more than once (config=, config_params= and/or "
                          "--deepspeed_config); pass exactly one")
    if not chosen:
        raise ConfigError("no config: pass config= (a dict or a JSON path) or --deepspeed_config FILE")
    return chosen[0]


def resolve_layout(source, world_size: int) -> tuple[Config, ParallelDims]:
    """Load, validate and resolve a config for a world size, and its layout: pure, so every rank fails the
    same way."""
    cfg = resolve_batch(load_config(source), world_size)
    check_supported(strategies_of(cfg))
    return cfg, cfg.parallel_dims(world_size)


def layout_label(dims: ParallelDims, zero_stage: int = 0) -> str:
    """The layout as a run's summary shows it: `dims.describe()` with a replicated dp named HSDP, and the ZeRO stage
    where it shards anything (over dp_shard x cp; `unsharded_zero` warns of the others)."""
    label = dims.describe().replace("(dp: replicate", "(HSDP: replicate")
    return label + (f" ZeRO-{zero_stage}" if zero_stage and dims.dp_shard * dims.cp > 1 else "")


def unsharded_zero(stage: int, dims: ParallelDims) -> str | None:
    """The warning for a ZeRO stage with nothing to shard: it shards over dp_shard x cp, which is 1 here."""
    if not stage or dims.dp_shard * dims.cp > 1:
        return None
    return (f"zero_optimization.stage {stage} shards over the data x context-parallel ranks, of which this layout "
            f"({dims.describe()}) has {dims.dp_shard * dims.cp}: nothing is sharded; raise data_parallel.size (or "
            f"lower tensor_parallel / pipeline sizes), or set zero_optimization.stage to 0")


def resolve_config(source, world_size: int) -> Config:
    """`resolve_layout`'s config (every check included)."""
    return resolve_layout(source, world_size)[0]


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               config_params=None, mesh=None, init_fn=None, objective=None):
    """Build the engine. Returns (engine, optimizer, training_dataloader, lr_scheduler) as DeepSpeed does.
    `objective`: one's own objective (a `paratrain.objectives.Objective`), in place of the `objective` section's
    (docs/objectives.md).
    A model on the meta device (`paratrain.init_empty()`) is materialized shard by shard: with the values
    eager construction gives, or `init_fn(module)` run module by module, or `checkpoint.load_weights`.
    A path (str) as `model` is a saved model (a Hugging Face directory): `from_pretrained`.
    Under a launcher (torchrun) an uncaught error is then reported once for the job (`paratrain.failure`)."""
    install_excepthook()
    if model is None:
        raise InvalidValueError("initialize() needs model=")
    pretrained = None
    if isinstance(model, (str, PurePath)):  # resolved before any process group: a bad path fails at once
        pretrained, directory = pretrained_for(model), Path(model).expanduser().resolve()
        model = pretrained.model
        if callable(model_parameters):  # the model is built here, so its param groups can only be a function of it
            model_parameters = model_parameters(model)
    if mpu is not None:
        raise ConfigError("initialize(mpu=...) is Megatron's model-parallel unit, which paratrain does not use; "
                          "set tensor_parallel / pipeline sizes in the config instead")
    source = _config_source(args, config, config_params)
    # Validate everything that can be validated before touching any process group.
    cfg = load_config(source)
    # DeepSpeed's MoE layers carry their ep_size; it is the config's expert_parallel.size (checked: pure, so
    # every rank refuses a disagreement the same way before any process group exists)
    cfg.expert_parallel.size = expert_parallel_size_of(model, cfg.expert_parallel.size)
    if pretrained is not None:
        _load_pretrained_weights(cfg, pretrained.weights)
    init_distributed(timeout=cfg.comm.timeout_s)
    world = dist.get_world_size()
    cfg, dims = resolve_layout(cfg, world)
    if dist.get_rank() == 0 and (warning := unsharded_zero(cfg.zero_optimization.stage, dims)):
        log.warning(warning)
    if mesh is None:
        mesh = build_mesh(dims, device_type="cuda" if uses_cuda() else "cpu")
    engine = Engine(model, cfg, mesh, optimizer=optimizer, lr_scheduler=lr_scheduler,
                    model_parameters=model_parameters, training_data=training_data, collate_fn=collate_fn,
                    init_fn=init_fn, objective=objective)
    if pretrained is not None:
        engine.tokenizer = pretrained.tokenizer
        if engine.adapters is not None and engine.adapters.base_model_name_or_path is None:
            # the saved adapter names its base, so peft's AutoPeftModel*.from_pretrained(adapter) finds it
            engine.adapters = replace(engine.adapters, base_model_name_or_path=str(directory))
    if cfg.checkpoint.auto_resume:  # a restarted job continues from the newest complete checkpoint
        path, client_state = engine.load_checkpoint(cfg.checkpoint.dir,
                                                    load_module_strict=cfg.checkpoint.load_module_strict)
        if path is not None:
            engine.auto_resumed = (path, client_state)
            if engine.global_rank == 0:
                log.info("auto_resume: continuing from %s (step %d)", path, engine.global_steps)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _load_pretrained_weights(cfg: Config, weights: str) -> None:
    if cfg.checkpoint.load_weights and cfg.checkpoint.load_weights != weights:
        raise ConfigError(f"model= is a saved model, whose weights ('{weights}') it loads, and "
                          f"checkpoint.load_weights is also set ('{cfg.checkpoint.load_weights}'); remove "
                          f"checkpoint.load_weights, or continue from a checkpoint with checkpoint.auto_resume / "
                          f"engine.load_checkpoint")
    cfg.checkpoint.load_weights = weights


def from_pretrained(path, config=None, **initialize_kwargs):
    """A saved model trained in the config's layout: `initialize(model=path, config=config, ...)`.
    `path`: a Hugging Face model directory (config.json + safetensors shards) or a Hub name its cache holds.
    The model is built on the meta device and each rank reads only its slices of the weights; a tokenizer
    saved beside them is `engine.tokenizer`. `model_parameters` may be a function of the (transformers) model
    returning its param groups. Returns initialize()'s (engine, optimizer, loader, scheduler)."""
    if "model" in initialize_kwargs:
        raise InvalidValueError("from_pretrained(path, ...) builds the model from path; do not pass model=")
    return initialize(model=path, config=config, **initialize_kwargs)
