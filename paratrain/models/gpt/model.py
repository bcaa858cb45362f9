"""A decoder-only transformer written so that every strategy can be applied from outside.

Choices that make it parallel-friendly (and why):
- q, k, v and o are separate Linear layers: a tensor-parallel plan shards q/k/v column-wise and o row-wise
  by name, with no fused-qkv reshuffling.
- Attention derives the local head count and sequence length from the projected tensors' shapes, so the
  same code runs when q/k/v hold 1/tp of the heads or when sequence parallelism gathers the sequence.
- The attention kernel (`attn.core`), the loss (`loss_fn`) and the position ids are replaceable: context
  parallelism swaps in ring attention and passes the positions of its chunks; tensor parallelism swaps in
  a vocab-parallel loss.
- `embed`, `blocks`, `ln_f`, `head` are the top-level pieces a pipeline split cuts between.
How the strategies apply to it (its plan, blocks, attention cores, pipeline layers) is its model spec,
`gpt/spec.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.attention import CausalAttentionCore, Documents
from paratrain.errors import Error, InvalidValueError
from paratrain.models.presets import preset


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    d_ff: int = 0  # 0 means 4 * d_model
    dropout: float = 0.0
    bias: bool = True
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise InvalidValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def num_params(self) -> int:
        """Exact parameter count of `GPT(self)` (used by the planner without building the model)."""
        d, f, v, b = self.d_model, self.d_ff, self.vocab_size, int(self.bias)
        attn = 4 * (d * d + b * d)
        mlp = d * f + b * f + f * d + b * d
        norms = 2 * 2 * d
        embed = v * d + self.seq_len * d
        head = 2 * d + d * v + b * v
        return embed + self.n_layer * (attn + mlp + norms) + head

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 per parameter (forward + backward) + attention scores and values."""
        return 6 * self.num_params() + 12 * self.n_layer * self.d_model * self.seq_len


# Sizes from GPT-3 / Megatron / Llama tables; vocab 256 where the embedded byte-level corpus is used.
# The 7B-70B presets are Llama-shaped but with this model's blocks (full multi-head attention, a 2-matrix
# GELU MLP): d_ff is chosen so the parameter count matches the named size (Llama's 3-matrix SwiGLU of width
# f has the parameters of a 2-matrix MLP of width 1.5 f; 70B's d_ff also absorbs its grouped-query K/V).
PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, d_model=32),
    "gpt-mini": GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=128),
    "gpt-small": GPTConfig(vocab_size=256, seq_len=128, n_layer=6, n_head=8, d_model=256),
    "gpt-125m": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "gpt-350m": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=24, n_head=16, d_model=1024),
    "gpt-1.3b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=24, n_head=32, d_model=2048),
    "gpt-2.7b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=32, n_head=32, d_model=2560),
    "gpt-7b": GPTConfig(vocab_size=32000, seq_len=4096, n_layer=32, n_head=32, d_model=4096, d_ff=11008 * 3 // 2,
                        bias=False),
    "gpt-13b": GPTConfig(vocab_size=32000, seq_len=4096, n_layer=40, n_head=40, d_model=5120, d_ff=13824 * 3 // 2,
                         bias=False),
    "gpt-70b": GPTConfig(vocab_size=32000, seq_len=4096, n_layer=80, n_head=64, d_model=8192, d_ff=36864,
                         bias=False),
}


def gpt_config(name: str, **overrides) -> GPTConfig:
    """A preset by name, optionally with fields replaced (e.g. seq_len=32)."""
    return preset(PRESETS, "GPT", "GPTConfig", name, overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(d, d, bias=cfg.bias)
        self.k = nn.Linear(d, d, bias=cfg.bias)
        self.v = nn.Linear(d, d, bias=cfg.bias)
        self.o = nn.Linear(d, d, bias=cfg.bias)
        self.core = CausalAttentionCore(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, width = t.shape  # (b, s, local_heads * head_dim): local under tensor parallelism
        return t.view(b, s, width // self.head_dim, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        q, k, v = self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x))  # (b, h, s, hd)
        y = self.core(q, k, v) if documents is None else self.core(q, k, v, documents)
        b, h, s, hd = y.shape
        y = y.transpose(1, 2).reshape(b, s, h * hd)  # (b, s, local width)
        return self.resid_dropout(self.o(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        # documents only when there are some: hooks of other libraries (torch's TP styles) count the inputs
        x = x + (self.attn(self.ln1(x)) if documents is None else self.attn(self.ln1(x), documents))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token + learned position embeddings. `position_ids` lets context parallelism pass its chunks'."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        check_token_ids(idx, self.tok.num_embeddings, "token ids")  # also the vocab-parallel table's
        if position_ids is None:
            position_ids = torch.arange(idx.shape[1], device=idx.device)
        return self.dropout(self.tok(idx) + self.pos(position_ids))


class TokenIdError(Error, ValueError):
    """Token ids (or targets) that are not integers in the model's vocabulary."""


def check_token_ids(ids: torch.Tensor, vocab_size: int, what: str, ignore_index: int | None = None) -> None:
    """Raise a clear error for ids outside [0, vocab_size): an embedding would index out of range, and a
    vocabulary split over tp would silently read zeros for them. One reduction per call, never read by the host
    while the ids are valid (the hot path has no host sync, tests/distributed/test_host_syncs.py)."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TokenIdError(f"GPT {what} must be an integer tensor, got {ids.dtype} of shape {tuple(ids.shape)}; "
                           f"feed token ids (e.g. torch.long), not embeddings or probabilities")
    if ids.numel() == 0 or not vocab_size:
        return
    valid = ids if ignore_index is None else ids.masked_fill(ids == ignore_index, 0)
    allowed = f"[0, {vocab_size})" + (f" or {ignore_index}" if ignore_index is not None else "")
    fix = "fix the dataset/tokenizer or build the GPT with a larger vocab_size"
    try:  # no host read when the ids are valid: an accelerator asserts on the device with this message
        torch._assert_async(((valid >= 0) & (valid < vocab_size)).all(),
                            f"GPT {what} must lie in {allowed} (vocab_size = {vocab_size}): {fix}")
    except RuntimeError:  # the CPU checks at once: name the first bad id
        raise _out_of_vocabulary(ids, valid, vocab_size, what, allowed, fix) from None


def _out_of_vocabulary(ids: torch.Tensor, valid: torch.Tensor, vocab_size: int, what: str, allowed: str,
                       fix: str) -> TokenIdError:
    low, high = (int(v) for v in torch.stack(torch.aminmax(valid)).tolist())
    bad = ((valid < 0) | (valid >= vocab_size)).nonzero()[0].tolist()
    where = f"row {bad[0]}, position {bad[1]}" if len(bad) == 2 else f"position {bad}"
    return TokenIdError(f"GPT {what} must lie in {allowed} (vocab_size = {vocab_size}), got values in [{low}, "
                        f"{high}] (first at {where} of the micro-batch: {int(ids[tuple(bad)])}): the data does not "
                        f"match the model's vocabulary; {fix}")


class TokenCrossEntropy(nn.Module):
    """Mean cross-entropy over the tokens that have a target (not -100). logits (b, s, V), targets (b, s).
    A micro-batch without any target gives 0, not NaN (a context-parallel chunk may hold only a prompt)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = targets.reshape(-1)
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets, reduction="sum")
        return total / (targets != -100).sum().clamp(min=1)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig | str = "gpt-tiny", **overrides):
        super().__init__()
        cfg = gpt_config(cfg, **overrides) if isinstance(cfg, str) else replace(cfg, **overrides)
        self.config = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.bias)
        self.loss_fn = TokenCrossEntropy()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layer)."""
        for name, module in self.named_modules():
            init_module(self.config, name, module)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, documents: Documents | None = None) -> torch.Tensor:
        """idx (b, s) token ids -> the mean loss over the targets that are not -100 if `targets` is given, else
        logits (b, s, V). `documents`: packed documents / left padding (`paratrain.attention.Documents`)."""
        if targets is not None:
            check_token_ids(targets, self.config.vocab_size, "targets", ignore_index=-100)
        h = self.embed(idx, position_ids)  # (b, s, d)
        for block in self.blocks:
            h = block(h) if documents is None else block(h, documents)
        logits = self.head(self.ln_f(h))  # (b, s, V)
        if targets is None:
            return logits
        return self.loss_fn(logits, targets)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


@torch.no_grad()
def init_module(cfg: GPTConfig, name: str, module: nn.Module) -> None:
    """One module's share of `GPT.init_weights` (deferred initialization replays it module by module)."""
    if isinstance(module, nn.Linear):
        std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("attn.o", "mlp.proj")) else 0.02
        nn.init.normal_(module.weight, 0.0, std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, 0.0, 0.02)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
