"""The engine's checkpoints, weights and pretrained directories (paratrain/checkpoint, docs/checkpoints.md): what
it hands the checkpoint code (a `CheckpointTarget` of stateful objects, never itself)."""

from __future__ import annotations

import logging
from pathlib import Path

from paratrain.adapters import AdapterError
from paratrain.adapters.peft_format import ADAPTER_WEIGHTS, model_name
from paratrain.checkpoint import CheckpointError, CheckpointTarget, load_checkpoint, save_checkpoint
from paratrain.checkpoint.adapters import Merger, merge_plan, read_adapter_config, save_adapter
from paratrain.checkpoint.pretrained import save_pretrained
from paratrain.checkpoint.sources import open_weights
from paratrain.checkpoint.weights import fill_model
from paratrain.engine.adapters import adapted_names, check_same_adapters
from paratrain.init.adapters import fill_adapters
from paratrain.init.sharded import meta_init_source
from paratrain.precision import compute_dtype

log = logging.getLogger("paratrain")


class EngineCheckpoints:
    """Mixed into `Engine`: uses its parallel model, mesh, optimizer, config and stateful objects."""

    def checkpoint_target(self, states: bool = True, lr_scheduler: bool = True) -> CheckpointTarget:
        """The model, optimizer and stateful objects a checkpoint saves or loads (without `states`: the model
        and optimizer only)."""
        named = {"train": self.train_state, "lr_scheduler": self.lr_scheduler if lr_scheduler else None,
                 "loss_scaler": self.loss_scaler} if states else {}
        return CheckpointTarget(self.parallel, self.optimizer, self.mesh, self.config,
                                {k: v for k, v in named.items() if v is not None},
                                {"random": self.random_state} if states else {}, self.model_config)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool | None = None) -> bool:
        """Save everything needed to continue exactly (collective). `tag` defaults to global_step{N};
        `exclude_frozen_parameters` to the config's checkpoint.exclude_frozen_parameters."""
        if exclude_frozen_parameters is None:
            exclude_frozen_parameters = self.config.checkpoint.exclude_frozen_parameters
        if self.train_state.window_micro_steps:
            raise CheckpointError(f"save_checkpoint was called in the middle of a gradient-accumulation window "
                                  f"(micro step {self.micro_steps}, {self.gradient_accumulation_steps()} per step): "
                                  f"call it after the step that ends the window")
        tag = tag if tag is not None else f"global_step{self.global_steps}"
        self._update.check_nonfinite()  # never write parameters a NaN/inf step reached
        save_checkpoint(self.checkpoint_target(), save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """Load a checkpoint saved under any layout (collective); returns (path, client_state), (None, None)
        when `load_dir` holds none. `tag` defaults to the one the `latest` file names."""
        target = self.checkpoint_target(states=not load_module_only, lr_scheduler=load_lr_scheduler_states)
        return load_checkpoint(target, load_dir, tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states and not load_module_only)

    def load_weights(self, path, name_map=None, strict: bool = True) -> set[str]:
        """Model weights only, from safetensors (file, directory, HF sharded) or a paratrain checkpoint; each rank
        reads its slices (collective). `name_map`: {weights' name: model name}, or a function (None: skip). An
        adapted model's base takes the names it has without adapters ("q_proj.weight" fills
        "q_proj.base_layer.weight"); adapters the weights do not hold keep their values. Returns those names."""
        source = open_weights(path, adapted_names(name_map, self._adapter_tensors))
        held = source.names()
        skipped = {t.name for t in self._adapter_tensors} - held
        fill_model(self.parallel, self.mesh, source, strict=strict, names=held, skip=skipped)
        return skipped

    def _fill_initial_values(self, template, init_fn) -> None:
        """`checkpoint.load_weights`, else a meta model's initialization (`meta_init`); then the adapters of a meta
        model that neither gave values (drawn from their names, DoRA's magnitude from the base: init/adapters)."""
        config, adapters = self.config, {t.name for t in self._adapter_tensors}
        if config.checkpoint.load_weights:
            missing = self.load_weights(config.checkpoint.load_weights, config.checkpoint.load_weights_map)
        elif template is not None:  # deferred init: eager construction's values, or sharded draws
            fill_model(self.parallel, self.mesh, meta_init_source(config.meta_init, template, self.parallel.spec,
                                                                  init_fn), skip=adapters)
            missing = adapters
        if template is not None and adapters and missing:
            init = config.peft.init if config.peft is not None else "default"
            fill_adapters(self.parallel, self.mesh, [t for t in self._adapter_tensors if t.name in missing],
                          config.seed, init)
        if config.peft is not None and config.peft.load:
            self.load_adapter(config.peft.load)

    def _fill_reference(self, template, init_fn) -> None:
        """The objective's frozen reference copy gets the initial values the policy got: `objective.reference_model`'s
        weights when set, else `checkpoint.load_weights`, else a meta model's initialization (collective)."""
        reference = self.objective.reference if self.objective is not None else None
        if reference is None:
            return
        config, adapters = self.config, {t.name for t in self._adapter_tensors}
        path = config.objective.reference_model or config.checkpoint.load_weights
        if path:
            name_map = None if config.objective.reference_model else config.checkpoint.load_weights_map
            source = open_weights(path, adapted_names(name_map, self._adapter_tensors))
            try:
                fill_model(reference, self.mesh, source, names=source.names(), skip=adapters - source.names())
            except CheckpointError as exc:
                raise CheckpointError(f"the objective's reference from '{path}': {exc} (objective.reference_model "
                                      f"must hold the policy's architecture)") from None
        elif template is not None:
            fill_model(reference, self.mesh, meta_init_source(config.meta_init, template, reference.spec, init_fn),
                       skip=adapters)

    def load_adapter(self, directory) -> None:
        """An adapter directory's weights (peft's format: adapter_model.safetensors) into the model's adapters, each
        rank reading its slices (collective); its adapter_config.json must describe the same adapters."""
        if self.adapters is None:
            raise AdapterError(f"load_adapter('{directory}'): the model has no adapters; put them in with the `peft` "
                               f"config section (peft.load loads a directory into them)")
        check_same_adapters(read_adapter_config(directory), self.adapters, directory)
        adapter = self.adapters.adapter_name
        source = open_weights(Path(directory) / ADAPTER_WEIGHTS, lambda key: model_name(key, adapter))
        fill_model(self.parallel, self.mesh, source, strict=True, names=source.names(), only=source.names())

    def save_pretrained(self, save_directory, max_shard_size: int | str = "5GB", dtype=None,
                        merged: bool = False) -> None:
        """The model as a directory `from_pretrained` loads (transformers' too): config files, safetensors
        shards of at most `max_shard_size` (+ index), the tokenizer; from any layout (collective: a tensor at
        a time, rank 0 writes, atomic). `dtype` ("bf16", torch.bfloat16): cast floating tensors (default fp32).
        A model with adapters writes the adapter in peft's format (`PeftModel.from_pretrained` loads it), or,
        `merged`, the model with every adapter folded into its base weight (`merge_peak_bytes`: what rank 0 held
        at most for it, counted)."""
        dtype = compute_dtype(dtype) if isinstance(dtype, str) else dtype
        if self.adapters is not None and not merged:
            save_adapter(self.parallel, self.mesh, self.device, save_directory, self.adapters, dtype)
            return
        merger = Merger(merge_plan(self.parallel, self.mesh)) if self.adapters is not None else None
        save_pretrained(self.parallel, self.mesh, self.device, save_directory, self.model_config, self.tokenizer,
                        max_shard_size, dtype, merger)
        self.merge_peak_bytes = merger.peak_bytes if merger is not None else 0
        if self.global_rank == 0:
            log.info("saved pretrained model %s", save_directory)

    def _save_if_due(self) -> None:
        every = self.config.checkpoint.save_every
        if every and self.global_steps % every == 0:
            self.save_checkpoint(self.config.checkpoint.dir)
