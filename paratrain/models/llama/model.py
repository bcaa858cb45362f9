"""The Llama family: RMSNorm, rotary position embeddings, a SwiGLU MLP and grouped-query attention.

    model = Llama("llama-tiny")                      # or Llama(LlamaConfig(...)), Llama("llama3-8b", n_layer=2)
    loss = model(idx, targets)                       # idx, targets: (b, s) token ids
    logits = model(idx)                              # (b, s, vocab)

Parameter names are Hugging Face's `LlamaForCausalLM` names (`model.embed_tokens.weight`,
`model.layers.N.self_attn.q_proj.weight`, ..., `model.norm.weight`, `lm_head.weight`), so weights saved by
`save_pretrained` load with no mapping, and the forward computes what transformers' does (the rotary
embedding in float32, RMSNorm in float32 then cast back, `rotate_half`). As in the GPT, every strategy applies
from outside: q/k/v/o and gate/up/down are separate Linear layers, attention derives its local head counts
from the projected shapes (tensor parallelism splits q's heads and k/v's heads alike), the attention kernel
is a replaceable `CausalAttentionCore` (which repeats k/v's heads for grouped-query attention), and
`position_ids` flow to every layer (context parallelism passes its chunks'). How the strategies apply is
the family's model spec, `llama/spec.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.attention import CausalAttentionCore, Documents
from paratrain.errors import InvalidValueError
from paratrain.models.gpt.model import TokenCrossEntropy, check_token_ids
from paratrain.models.presets import preset


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    seq_len: int = 64  # the training sequence length (HF's max_position_embeddings)
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2  # grouped-query attention: k and v have this many heads (a divisor of n_head)
    d_model: int = 64
    d_ff: int = 0  # the SwiGLU width; 0: 8/3 d_model rounded up to a multiple of 32
    rope_theta: float = 10000.0
    # Llama 3.1's frequency scaling: (factor, low_freq_factor, high_freq_factor, original_max_position)
    rope_scaling: tuple[float, float, float, int] | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise InvalidValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise InvalidValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head}): "
                                    f"each k/v head serves n_head / n_kv_head query heads")
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 32 * math.ceil(8 * self.d_model / 3 / 32))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def num_params(self) -> int:
        """Exact parameter count of `Llama(self)` (the planner uses it without building the model)."""
        d, f, v, hd = self.d_model, self.d_ff, self.vocab_size, self.head_dim
        attn = 2 * d * self.n_head * hd + 2 * d * self.n_kv_head * hd
        layer = attn + 3 * d * f + 2 * d
        return v * d + self.n_layer * layer + d + (0 if self.tie_embeddings else v * d)

    def flops_per_token(self) -> int:
        """Training FLOPs per token (Megatron/PaLM): 6 per matmul parameter (the token table is a lookup;
        a tied head still multiplies) + attention scores and values over the full sequence."""
        matmul = self.num_params() - self.vocab_size * self.d_model * (0 if self.tie_embeddings else 1)
        return 6 * matmul + 12 * self.n_layer * self.d_model * self.seq_len


# Meta's published shapes (Llama 3 and 3.1); the small ones are for tests, demos and the big-init benchmark.
PRESETS: dict[str, LlamaConfig] = {
    "llama-tiny": LlamaConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64),
    "llama-mini": LlamaConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, n_kv_head=2, d_model=128,
                              d_ff=352),
    "llama-350m": LlamaConfig(vocab_size=32000, seq_len=512, n_layer=24, n_head=16, n_kv_head=8, d_model=1024,
                              d_ff=2816),
    "llama3-8b": LlamaConfig(vocab_size=128256, seq_len=8192, n_layer=32, n_head=32, n_kv_head=8, d_model=4096,
                             d_ff=14336, rope_theta=500000.0),
    "llama3-70b": LlamaConfig(vocab_size=128256, seq_len=8192, n_layer=80, n_head=64, n_kv_head=8, d_model=8192,
                              d_ff=28672, rope_theta=500000.0),
    "llama3-405b": LlamaConfig(vocab_size=128256, seq_len=8192, n_layer=126, n_head=128, n_kv_head=8,
                               d_model=16384, d_ff=53248, rope_theta=500000.0, rope_scaling=(8.0, 1.0, 4.0, 8192)),
}


def llama_config(name: str, **overrides) -> LlamaConfig:
    """A preset by name, optionally with fields replaced (e.g. n_layer=2)."""
    return preset(PRESETS, "Llama", "LlamaConfig", name, overrides)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight, computed in float32 and cast back (transformers' LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotary_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """inv_freq (head_dim / 2,) in float32, with Llama 3.1's scaling when the config has it."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if cfg.rope_scaling is None:
        return inv_freq
    factor, low, high, old_len = cfg.rope_scaling
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(cfg: LlamaConfig, position_ids: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (b or 1, s, head_dim) of the given positions ((s,) or (b, s)), computed in float32."""
    positions = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
    inv_freq = rotary_frequencies(cfg).to(positions.device)
    freqs = positions.float()[..., None] * inv_freq  # (b, s, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (b, heads, s, hd) rotated by its positions' angles; cos/sin (b or 1, s, hd)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        hd, d = cfg.head_dim, cfg.d_model
        self.q_proj = nn.Linear(d, cfg.n_head * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.n_kv_head * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.n_kv_head * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * hd, d, bias=False)
        self.core = CausalAttentionCore()

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, width = t.shape  # (b, s, local_heads * head_dim): local under tensor parallelism
        return t.view(b, s, width // self.config.head_dim, self.config.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, documents: Documents | None = None
                ) -> torch.Tensor:
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        cos, sin = rotary_cos_sin(self.config, position_ids, q.dtype)  # (b|1, s, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = self.core(q, k, v) if documents is None else self.core(q, k, v, documents)  # (b, h, s, hd)
        b, h, s, hd = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(b, s, h * hd))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residuals. Inside a pipeline it takes and returns (h, position_ids);
    `documents` (packed documents, left padding) come from the micro-batch, never through the hand-over."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x, position_ids: torch.Tensor | None = None, documents: Documents | None = None):
        staged = isinstance(x, tuple)
        h, position_ids = x if staged else (x, position_ids)
        h = h + self.self_attn(self.input_layernorm(h), position_ids, documents)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return (h, position_ids) if staged else h


class LlamaModel(nn.Module):
    """HF's `LlamaModel`: the token table, the layers and the final norm."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)


class Llama(nn.Module):
    """HF's `LlamaForCausalLM`, with the loss as a replaceable module (tensor parallelism swaps in the
    vocab-parallel cross-entropy)."""

    def __init__(self, cfg: LlamaConfig | str = "llama-tiny", **overrides):
        super().__init__()
        cfg = llama_config(cfg, **overrides) if isinstance(cfg, str) else replace(cfg, **overrides)
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.loss_fn = TokenCrossEntropy()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """transformers' Llama init: N(0, 0.02) for every Linear and Embedding, ones for the norms."""
        for name, module in self.named_modules():
            init_module(name, module)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, documents: Documents | None = None) -> torch.Tensor:
        """idx (b, s) token ids -> the mean loss over the targets that are not -100 if `targets` is given, else
        logits (b, s, V). `documents`: packed documents / left padding (`paratrain.attention.Documents`)."""
        check_token_ids(idx, self.model.embed_tokens.num_embeddings, "token ids")
        if targets is not None:
            check_token_ids(targets, self.config.vocab_size, "targets", ignore_index=-100)
        if position_ids is None:
            position_ids = torch.arange(idx.shape[1], device=idx.device)
        h = self.model.embed_tokens(idx)  # (b, s, d)
        for layer in self.model.layers:
            h = layer(h, position_ids, documents)
        logits = self.lm_head(self.model.norm(h))  # (b, s, V)
        return logits if targets is None else self.loss_fn(logits, targets)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


@torch.no_grad()
def init_module(name: str, module: nn.Module) -> None:
    """One module's share of `Llama.init_weights` (deferred initialization replays it module by module)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, 0.0, 0.02)
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)
