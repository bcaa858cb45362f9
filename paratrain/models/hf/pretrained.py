"""Pretrained in: a Hugging Face model directory (or Hub name) as a meta model plus the weights to fill it.

    engine, optimizer, loader, scheduler = paratrain.from_pretrained("llama-dir", config=ds_config)
    engine, *_ = paratrain.initialize(model="llama-dir", config=ds_config)      # the same

The architecture comes from `config.json` alone (`AutoModelForCausalLM.from_config` on the meta device), so
no rank ever holds the whole model; the engine then reads each rank's slices from the safetensors shards
(`checkpoint.load_weights`: `paratrain.checkpoint.sources`). A tokenizer saved beside the weights becomes
`engine.tokenizer`.

[Note: what the weights files do not hold]
Non-persistent buffers (the rotary embeddings' `inv_freq`) are in no weights file and no checkpoint: they
are computed from the config. On the meta device they would stay empty (or get uninitialized memory), so
`materialize_buffers` computes them at full size on the CPU with the model's own `_init_weights` (which
transformers gives every rotary module) before anything is split: they are a few numbers per head dimension.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from paratrain.init.empty import init_empty
from paratrain.model_spec import ModelSpecError, Pretrained

CONFIG = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]  # config, weights, tokenizer


def materialize_buffers(hf: nn.Module) -> None:
    """Give every non-persistent buffer still on the meta device its value (see the module's note); one that
    the model's initialization does not set is refused by name."""
    for prefix, module in hf.named_modules():
        keys = [k for k in module._non_persistent_buffers_set
                if module._buffers.get(k) is not None and module._buffers[k].is_meta]
        if not keys:
            continue
        for k in keys:
            module._buffers[k] = torch.empty_like(module._buffers[k], device="cpu")
        versions = {k: module._buffers[k]._version for k in keys}
        with torch.no_grad():
            hf._init_weights(module)
        unset = [k for k in keys if module._buffers[k]._version == versions[k]]
        if unset:
            names = ", ".join(f"{prefix}.{k}" if prefix else k for k in unset)
            raise ModelSpecError(f"{type(hf).__name__} built on the meta device: the non-persistent buffer(s) "
                                 f"{names} are in no weights file and its _init_weights does not compute them; "
                                 f"build the model on the CPU (no init_empty / meta device) instead")


def _resolve(path: str) -> Path:
    """A local model directory for `path`: the directory itself, or a Hub name through huggingface_hub's cache
    (what transformers' own from_pretrained uses)."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise ModelSpecError(f"'{path}' is a file; pass the model directory that holds {CONFIG} and the "
                             f"safetensors weights")
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise ModelSpecError(f"model directory '{path}' does not exist; pass a directory written by "
                             f"save_pretrained (config.json + safetensors weights)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # offline, unknown name, no cache: the hub client's many error types, one answer
        raise ModelSpecError(f"'{path}' is not a local directory and could not be resolved as a Hugging Face Hub "
                             f"model ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); pass "
                             f"a local directory written by save_pretrained, or download it where the Hub is "
                             f"reachable first (`hf download {path}`, then HF_HUB_OFFLINE=1 uses the cache)"
                             ) from None


def _check_weights(directory: Path) -> None:
    if not any(directory.glob("*.safetensors")):
        pickled = sorted(p.name for p in directory.glob("*.bin"))
        found = f" (it has {', '.join(pickled)}: pickled weights, which paratrain does not unpickle)" if pickled else ""
        raise ModelSpecError(f"'{directory}' has no .safetensors weights{found}; save them with "
                             f"save_pretrained(..., safe_serialization=True)")


def build_empty(directory: Path) -> nn.Module:
    """The causal LM that `config.json` describes, on the meta device (no memory, no initialization)."""
    import transformers

    try:
        cfg = transformers.AutoConfig.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelSpecError(f"'{directory / CONFIG}' is not a config transformers can read ({exc}); fix its "
                             f"model_type or re-save the model with save_pretrained") from None
    try:
        with init_empty():
            return transformers.AutoModelForCausalLM.from_config(cfg)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        raise ModelSpecError(f"'{directory / CONFIG}' has model_type {cfg.model_type!r} "
                             f"({type(cfg).__name__}), which is not a causal language model (AutoModelForCausalLM "
                             f"has no class for it); paratrain.from_pretrained trains decoder-only causal LMs"
                             ) from None


def load_tokenizer(directory: Path):
    """The tokenizer saved in `directory`, or None when it holds none."""
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        return None
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as exc:
        raise ModelSpecError(f"'{directory}' has tokenizer files that transformers cannot load ({exc}); remove "
                             f"them or re-save the tokenizer with save_pretrained") from None


def load_pretrained(path: str) -> Pretrained:
    """`path` (a model directory or Hub name) as a meta model, its weights and its tokenizer."""
    directory = _resolve(path)
    if not (directory / CONFIG).is_file():
        raise ModelSpecError(f"'{directory}' has no {CONFIG}: from_pretrained builds the model from its Hugging "
                             f"Face config; pass a directory written by save_pretrained")
    model = build_empty(directory)
    _check_weights(directory)
    materialize_buffers(model)
    return Pretrained(model=model, weights=str(directory), tokenizer=load_tokenizer(directory))
