"""Building blocks shared by the multi-process tests: tiny models, data and config dicts."""

from __future__ import annotations

import logging
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from paratrain.data import TokenWindows, load_corpus
from paratrain.models import GPT, Llama

# bias=False: a key projection's bias has an exactly-zero gradient (softmax ignores a shift shared by all
# keys), so its computed gradient is pure rounding noise that Adam normalizes into lr-sized steps, and two
# correct runs then disagree on it. Without biases every parameter has a real gradient to compare.
TINY = dict(vocab_size=256, seq_len=16, n_layer=2, n_head=4, d_model=32, bias=False)


def tiny_gpt(seed: int = 1, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT("gpt-tiny", **{**TINY, **overrides})


# Grouped-query attention (2 k/v heads for 4 query heads), so tp = 2 splits k/v by their own heads.
TINY_LLAMA = dict(vocab_size=256, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64)


def tiny_llama(seed: int = 1, **overrides) -> Llama:
    torch.manual_seed(seed)
    return Llama("llama-tiny", **{**TINY_LLAMA, **overrides})


def corpus_windows(seq_len: int = 16, limit: int = 512) -> TokenWindows:
    train, _ = load_corpus()
    return TokenWindows(train[: limit * seq_len + 1], seq_len)


# AdamW eps for parity tests whose models have gradient elements of ~1e-9: Adam's first update is
# lr · g / (|g| + eps), so at torch's 1e-8 such an element moves by ±lr and its sign flips with the summation
# order (another layout, another CPU's kernels), which compares noise's sign instead of gradients.
STABLE_EPS = 1e-6


def adamw_config(**extra) -> dict:
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "betas": [0.9, 0.95]}},
        "gradient_clipping": 1.0,
        "seed": 7,
    }
    cfg.update(extra)
    return cfg


REQUIRE_DEEPSPEED = "PARATRAIN_REQUIRE_DEEPSPEED"  # CI (.ci/run) sets it to 1


def skip_without_deepspeed(reason: str) -> None:
    """Skip a comparison with DeepSpeed that cannot run here, or fail it where CI requires it to run: a
    comparison silently skipped in CI would let the documented agreement go unchecked."""
    import os

    import pytest

    if os.environ.get(REQUIRE_DEEPSPEED) == "1":
        pytest.fail(f"{reason}; {REQUIRE_DEEPSPEED}=1 requires the DeepSpeed comparisons to run (install the dev "
                    f"extra: pip install -e '.[dev]')", pytrace=False)
    pytest.skip(reason)


def import_or_skip(module: str):
    """`module` (a dev-extra test tool: transformers, tensorboard), or skip; where CI requires the comparisons
    (PARATRAIN_REQUIRE_DEEPSPEED=1) a missing one fails instead: a silently skipped file would leave its checks
    unrun."""
    import importlib
    import os

    import pytest

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        reason = f"{module} is not installed ({exc}); it comes with the dev extra"
        if os.environ.get(REQUIRE_DEEPSPEED) == "1":
            pytest.fail(f"{reason}; {REQUIRE_DEEPSPEED}=1 requires the comparisons to run", pytrace=False)
        pytest.skip(reason, allow_module_level=True)


def import_deepspeed(module: str = "deepspeed"):
    """`module` of DeepSpeed, or skip (fail in CI) when DeepSpeed is not installed."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        skip_without_deepspeed(f"DeepSpeed is not installed ({exc}); it comes with the dev extra")


# Tiny transformers causal LMs (random weights; no hub here): grouped-query attention with tp = n_kv_heads.
TINY_HF = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
TINY_MOE = dict(num_experts_per_tok=2, experts_implementation="eager", attn_implementation="eager")
HF_FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
               "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
               # GPT-2: a learned position table, Conv1D (transposed) layers, packed c_attn; dropouts off
               "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
                                                          "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                                                          "bos_token_id": 0, "eos_token_id": 0}),
               # Phi-3: packed qkv_proj and gate_up_proj
               "phi3": ("Phi3Config", "Phi3ForCausalLM", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "pad_token_id": 0,
                                                          "bos_token_id": 0, "eos_token_id": 0}),
               # Mixture of experts: 4 experts, top-2, in every layer; the reference runs transformers' own eager
               # experts loop and attention (the engine's view routes them through paratrain's)
               "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**TINY_MOE, "num_local_experts": 4,
                                                                  "sliding_window": None}),
               # and a shared expert behind a sigmoid gate, top-k weights not renormalised (norm_topk_prob False)
               "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {**TINY_MOE, "num_experts": 4,
                                                                       "moe_intermediate_size": 32,
                                                                       "shared_expert_intermediate_size": 64}),
               # q/k norms per head, no shared expert
               "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**TINY_MOE, "num_experts": 4,
                                                                       "moe_intermediate_size": 32})}


def tiny_hf(family: str = "llama", seed: int = 1, **overrides):
    import transformers

    config_name, model_name, extra = HF_FAMILIES[family]
    base = TINY_HF if family != "gpt2" else {"vocab_size": 256, "tie_word_embeddings": False}
    config = getattr(transformers, config_name)(**{**base, **extra, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config)


def hf_param_groups(model) -> list[dict]:
    """The k projection's bias gets lr 0: softmax ignores a shift shared by all keys, so its gradient is exactly
    zero in theory and rounding noise in practice, which Adam would turn into lr-sized steps of random sign.
    GPT-2 packs k's bias into c_attn's, so that whole bias gets it."""
    keys = ("k_proj.bias", "c_attn.bias")
    frozen = [p for n, p in model.named_parameters() if n.endswith(keys)]
    rest = [p for n, p in model.named_parameters() if not n.endswith(keys)]
    return [{"params": rest}] + ([{"params": frozen, "lr": 0.0}] if frozen else [])


def hf_loss(model, batch) -> torch.Tensor:
    """The single-process reference: the transformers model's own forward, the loss on pre-shifted targets."""
    import torch.nn.functional as F

    idx, targets = batch
    logits = model(input_ids=idx).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class WarningLines(logging.Handler):
    """The warnings logged while it is attached to a logger (in a spawned rank too, where caplog is not)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


class LiveTensorBytes(TorchDispatchMode):
    """The bytes of tensor storage made inside the block and still alive, and their peak: seen from outside the
    code under test, at every operator (a storage is counted when an operator first returns it, unless it is one
    of the operator's inputs, i.e. a view or an in-place result, and uncounted when its last tensor dies)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: weakref.WeakSet = weakref.WeakSet()

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and not t.is_meta}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                if storage not in self._seen and storage.data_ptr() not in inputs:
                    self._seen.add(storage)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._freed, storage.nbytes())
                    self.peak = max(self.peak, self.live)
        return out
