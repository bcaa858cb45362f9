"""Where the engine's values come from, before and besides checkpoints: weights files (safetensors, HF sharded, a
paratrain checkpoint), adapter directories in peft's format, a meta model's initialization, and the objective's
frozen reference copy, which gets the values the policy got. Each rank reads its own slices (collective)."""

from __future__ import annotations

from pathlib import Path

from paratrain.adapters import AdapterError
from paratrain.adapters.peft_format import ADAPTER_WEIGHTS, model_name
from paratrain.checkpoint import CheckpointError
from paratrain.checkpoint.adapters import read_adapter_config
from paratrain.checkpoint.sources import open_weights
from paratrain.checkpoint.weights import fill_model
from paratrain.config import Config
from paratrain.engine.adapters import adapted_names, check_same_adapters
from paratrain.init.adapters import fill_adapters
from paratrain.init.sharded import meta_init_source
from paratrain.layout.mesh import Mesh


def load_weights(parallel, mesh: Mesh, adapter_tensors: list, path, name_map=None, strict: bool = True) -> set[str]:
    """`engine.load_weights`: fills the model from `path`; returns the adapters' names the weights do not hold."""
    source = open_weights(path, adapted_names(name_map, adapter_tensors))
    held = source.names()
    skipped = {t.name for t in adapter_tensors} - held
    fill_model(parallel, mesh, source, strict=strict, names=held, skip=skipped)
    return skipped


def load_adapter(parallel, mesh: Mesh, adapters, directory) -> None:
    """`engine.load_adapter`: an adapter directory's weights into the model's adapters."""
    if adapters is None:
        raise AdapterError(f"load_adapter('{directory}'): the model has no adapters; put them in with the `peft` "
                           f"config section (peft.load loads a directory into them)")
    check_same_adapters(read_adapter_config(directory), adapters, directory)
    source = open_weights(Path(directory) / ADAPTER_WEIGHTS, lambda key: model_name(key, adapters.adapter_name))
    fill_model(parallel, mesh, source, strict=True, names=source.names(), only=source.names())


def fill_initial_values(parallel, mesh: Mesh, config: Config, template, init_fn, adapters, adapter_tensors) -> None:
    """`checkpoint.load_weights`, else a meta model's initialization (`meta_init`); then the adapters of a meta
    model that neither gave values (drawn from their names, DoRA's magnitude from the base: init/adapters)."""
    names = {t.name for t in adapter_tensors}
    if config.checkpoint.load_weights:
        missing = load_weights(parallel, mesh, adapter_tensors, config.checkpoint.load_weights,
                               config.checkpoint.load_weights_map)
    elif template is not None:  # deferred init: eager construction's values, or sharded draws
        fill_model(parallel, mesh, meta_init_source(config.meta_init, template, parallel.spec, init_fn), skip=names)
        missing = names
    if template is not None and names and missing:
        init = config.peft.init if config.peft is not None else "default"
        fill_adapters(parallel, mesh, [t for t in adapter_tensors if t.name in missing], config.seed, init)
    if config.peft is not None and config.peft.load:
        load_adapter(parallel, mesh, adapters, config.peft.load)


def fill_reference(reference, mesh: Mesh, config: Config, template, init_fn, adapter_tensors) -> None:
    """The objective's frozen reference copy gets the initial values the policy got: `objective.reference_model`'s
    weights when set, else `checkpoint.load_weights`, else a meta model's initialization (collective)."""
    names = {t.name for t in adapter_tensors}
    path = config.objective.reference_model or config.checkpoint.load_weights
    if path:
        name_map = None if config.objective.reference_model else config.checkpoint.load_weights_map
        source = open_weights(path, adapted_names(name_map, adapter_tensors))
        try:
            fill_model(reference, mesh, source, names=source.names(), skip=names - source.names())
        except CheckpointError as exc:
            raise CheckpointError(f"the objective's reference from '{path}': {exc} (objective.reference_model "
                                  f"must hold the policy's architecture)") from None
    elif template is not None:
        fill_model(reference, mesh, meta_init_source(config.meta_init, template, reference.spec, init_fn), skip=names)
