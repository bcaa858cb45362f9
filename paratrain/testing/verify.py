"""`paratrain verify --config FILE`: the configured layout against the single-process reference, on this
machine's CPUs, on a small instance of the configured model.

    paratrain verify --config job.json [--steps 5] [--nproc-per-node N]

The layout (dp, pp, cp, tp, ZeRO stage, schedule, sequence parallelism, activation checkpointing, precision,
plan) is the config's; the model is shrunk so every rank fits a laptop: the built-in GPT keeps its shape
rules (heads divisible by tp, the sequence by 2·cp and cp·tp, at least one block per pipeline stage) at a
few layers of width 8·heads, no dropout (the reference draws other masks) and no biases (see tests/cases.py
on the key bias). A model named `package.module:factory` in `trainer.model` is built as
`factory(**trainer.model_overrides)` on every rank and trained on the same byte-token corpus: its
`forward(idx, targets)` must return the loss; choose its size with the overrides.

Each rank gathers the full state after every step; this process trains the reference on the same global
batches and prints loss, grad norm and the worst parameter difference per step. Exit code 0 when every
step is within the tolerance, 1 when any is not (or a rank failed), 2 for a config error.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from paratrain.config import Config, ConfigError, load_config, resolve_batch
from paratrain.testing.parity import TOLERANCE, compare, describe_layout, reference_config, run_layout, summarize
from paratrain.testing.reference import reference_run

DEFAULT_STEPS = 5


@dataclass(frozen=True)
class ModelRecipe:
    """How every rank (and the reference) builds the same model: a GPT config, or an importable factory."""

    seed: int
    gpt: dict | None = None  # GPTConfig fields
    llama: dict | None = None  # LlamaConfig fields
    factory: str | None = None  # "package.module:function"
    overrides: dict | None = None
    seq_len: int = 16

    def build(self) -> nn.Module:
        torch.manual_seed(self.seed)
        if self.gpt is not None:
            from paratrain.models import GPT, GPTConfig

            return GPT(GPTConfig(**self.gpt))
        if self.llama is not None:
            from paratrain.models import Llama, LlamaConfig

            return Llama(LlamaConfig(**self.llama))
        return load_factory(self.factory)(**(self.overrides or {}))

    def describe(self) -> str:
        if self.llama is not None:
            g = self.llama
            return (f"Llama n_layer {g['n_layer']}, d_model {g['d_model']}, n_head {g['n_head']}, n_kv_head "
                    f"{g['n_kv_head']}, seq_len {g['seq_len']}, vocab {g['vocab_size']}")
        if self.gpt is None:
            return f"{self.factory}({', '.join(f'{k}={v!r}' for k, v in (self.overrides or {}).items())})"
        g = self.gpt
        return (f"GPT n_layer {g['n_layer']}, d_model {g['d_model']}, n_head {g['n_head']}, seq_len {g['seq_len']}, "
                f"vocab {g['vocab_size']} (dropout 0, no biases)")


def load_factory(name: str):
    module_name, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"config key 'trainer.model' = {name!r}: cannot import {attr!r} from {module_name!r} "
                          f"({exc}); name a preset (gpt-tiny, gpt-7b, ...) or an importable 'package.module:factory'"
                          ) from None
    if not callable(factory):
        raise ConfigError(f"config key 'trainer.model' = {name!r} is not callable; name a function or class that "
                          f"returns the model")
    return factory


def _lcm(*values: int) -> int:
    return math.lcm(*values)


def small_instance(config: Config, seq_len: int | None = None) -> ModelRecipe:
    """The configured model, small: a shrunk GPT keeping the layout's divisibility rules, or the factory."""
    t = config.trainer
    tp, cp, pp = config.tensor_parallel.size, config.context_parallel.size, config.pipeline.stages
    if ":" in t.model:
        overrides = dict(t.model_overrides)
        return ModelRecipe(config.seed, factory=t.model, overrides=overrides,
                           seq_len=seq_len or overrides.get("seq_len", 16))
    from paratrain.models import LlamaConfig, LlamaMoEConfig, preset_config

    try:
        base = preset_config(t.model, **t.model_overrides)
    except ValueError as exc:
        raise ConfigError(f"config key 'trainer.model' = {t.model!r}: {exc}") from None
    if isinstance(base, LlamaMoEConfig):
        # each data-parallel rank balances its own micro-batch, so the router losses differ from one process's
        # by design: verify's equality to one process does not hold for an MoE model
        raise ConfigError(f"config key 'trainer.model' = {t.model!r} is a mixture-of-experts model: paratrain "
                          f"verify checks equality with one process, which MoE's per-rank router losses do not "
                          f"have; verify a dense preset (llama-tiny, gpt-tiny)")
    n_head = tp * math.ceil(4 / tp)
    seq = seq_len or _lcm(16, 2 * cp, cp * tp)
    shape = dict(vocab_size=256, n_layer=max(2, pp * config.pipeline.virtual_stages), n_head=n_head,
                 d_model=8 * n_head, d_ff=32 * n_head, seq_len=seq)
    if isinstance(base, LlamaConfig):  # k/v heads: tp of them, so grouped-query attention splits as it would
        small = replace(base, **shape, n_kv_head=tp, tie_embeddings=base.tie_embeddings and pp == 1)
        return ModelRecipe(config.seed, llama=asdict(small), seq_len=seq)
    small = replace(base, **shape, dropout=0.0, bias=False)
    return ModelRecipe(config.seed, gpt=asdict(small), seq_len=seq)


def verify_config(config: Config, world_size: int) -> dict:
    """The config the ranks run: the layout as given, micro-batches of at most 2 samples."""
    resolved = resolve_batch(config, world_size)
    cfg = resolved.model_dump(mode="json", exclude_none=True)
    cfg.pop("train_batch_size", None)
    cfg["train_micro_batch_size_per_gpu"] = min(resolved.train_micro_batch_size_per_gpu, 2)
    cfg["gradient_accumulation_steps"] = resolved.gradient_accumulation_steps
    cfg["pipeline"].pop("micro_batches", None)
    cfg["comm"]["report_dir"] = cfg["comm"].get("report_dir") or "."
    return cfg


def _dataset(seq_len: int):
    from paratrain.data import TokenWindows, load_corpus

    return TokenWindows(load_corpus()[0], seq_len)


def _rank_main(cfg: dict, recipe: ModelRecipe, steps: int):
    import torch.distributed as dist

    return run_layout(cfg, recipe.build, _dataset(recipe.seq_len), steps, state_every_step=True,
                      keep_state=dist.get_rank() == 0)


def default_world_size(config: Config) -> int:
    dp = config.data_parallel.size if config.data_parallel.size != -1 else 2
    return dp * config.model_parallel_size


def _table(rows) -> str:
    header = ["step", "loss", "ref loss", "rel err", "grad norm", "ref norm", "rel err", "param rel err", "worst param",
              "result"]
    lines = []
    for r in rows:
        norm = f"{r.grad_norm:.6f}" if r.grad_norm is not None else "-"
        param = f"{r.param_err:.1e}" if r.param_err is not None else "-"
        lines.append([str(r.step), f"{r.loss:.6f}", f"{r.ref_loss:.6f}", f"{r.loss_err:.1e}", norm,
                      f"{r.ref_grad_norm:.6f}", f"{r.norm_err:.1e}", param, r.where or "-",
                      "ok" if r.passed else "FAIL"])
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i < 8 else c.ljust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    out = [fmt(header), fmt(["-" * w for w in widths]), *(fmt(c) for c in lines)]
    errors: dict[str, list[str]] = {}
    for r in rows:
        if r.error:
            errors.setdefault(r.error, []).append(str(r.step))
    out += [f"step {', '.join(steps)}: {error}" for error, steps in errors.items()]
    return "\n".join(out)


def verify(config_source, steps: int = DEFAULT_STEPS, world_size: int | None = None, tolerance: float | None = None,
           seq_len: int | None = None, timeout_s: float = 300.0, out=sys.stdout) -> bool:
    """Run the check and print the table; True when every step passed."""
    from paratrain.testing.world import World, WorldError

    config = load_config(config_source)
    world_size = world_size or default_world_size(config)
    cfg = verify_config(config, world_size)
    recipe = small_instance(config, seq_len)
    resolved = load_config(cfg)
    tolerance = tolerance if tolerance is not None else TOLERANCE[resolved.precision]
    from paratrain.api import resolve_config

    resolve_config(cfg, world_size)  # every layout check that needs no model, before spawning anything
    print(f"paratrain verify: {world_size} processes (gloo, CPU), {steps} steps, tolerance {tolerance:g}", file=out)
    print(f"  model: {recipe.describe()}", file=out)
    layout = describe_layout(resolved)
    print(f"  layout: dp x pp x cp x tp = {resolved.dp_size(world_size)} x {resolved.pipeline.stages} x "
          f"{resolved.context_parallel.size} x {resolved.tensor_parallel.size}{' ' + layout if layout else ''}; "
          f"micro-batch {cfg['train_micro_batch_size_per_gpu']} x {cfg['gradient_accumulation_steps']} accumulation",
          file=out)
    out.flush()
    world = World(world_size, timeout_s=timeout_s)
    try:
        run = world.run(_rank_main, cfg, recipe, steps)[0]
    except WorldError as exc:
        print(f"FAIL: the layout did not run:\n{exc}", file=out)
        return False
    finally:
        world.stop()
    ref = reference_run(recipe.build, reference_config(cfg, run), _dataset(recipe.seq_len), steps, keep_states=True)
    rows = compare(run, ref, tolerance)
    print(_table(rows), file=out)
    summary = summarize(rows)
    if summary["passed"]:
        print(f"PASS: {run.case} equals the single-process reference within {tolerance:g} (loss "
              f"{summary['loss_err']:.1e}, grad norm {summary['norm_err']:.1e}, parameters {summary['param_err']:.1e})",
              file=out)
    else:
        failed = [str(r.step) for r in rows if not r.passed]
        print(f"FAIL: {run.case} differs from the single-process reference at step(s) {', '.join(failed)} "
              f"(tolerance {tolerance:g})", file=out)
    return summary["passed"]


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="JSON config: the layout to check (and trainer.model)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps to compare")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="processes to launch (default: the config's data_parallel.size, or 2 when it is -1, "
                             "times pp x cp x tp)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="relative error allowed (default 1e-5 in fp32, 2.5e-2 bf16, 2e-2 fp16)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length of the small instance")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a silent rank counts as hung")


def run_verify(args: argparse.Namespace) -> int:
    try:
        ok = verify(args.config, steps=args.steps, world_size=args.nproc_per_node, tolerance=args.tolerance,
                    seq_len=args.seq_len, timeout_s=args.timeout)
    except ConfigError as exc:
        print(f"paratrain verify: {exc}", file=sys.stderr)
        return 2
    return 0 if ok else 1
