"""The hot path reads nothing back from the device: host reads per training step, counted in every layout.

`paratrain.testing.HostSyncs` patches every way Python reads a tensor's value (`item`, `tolist`, `cpu`,
`__float__`, `__bool__`, ...), the CPU stand-in for CUDA's sync debug mode. After a first step (which checks
batch agreement and agrees on the token-loss unit), two more steps are counted with the monitor off and no
log line due. Token rows without documents: 0 reads in every layout. What remains is named, per micro-batch:
reading the batch's own document structure (the document lengths decide the attention kernel calls and the
ring parts skipped) and, with expert parallelism or dropless capacity, the row counts an all-to-all and a
buffer need. `nonfinite_loss: "stop"` (the default) reads the norm once per step, before the update.
"""

from __future__ import annotations

import copy

import paratrain
from paratrain.testing.host_syncs import HostSyncs
from tests.cases import adamw_config, corpus_windows, hf_param_groups, import_or_skip, tiny_gpt
from tests.distributed.test_expert_parallel import ep_config, moe_model
from tests.distributed.test_real_data import model_factory, real_layout
from tests.real_data import RealRows

LEAN = {"nonfinite_loss": "stop_at_log", "steps_per_print": 1000}
LAYOUTS = {"ddp": real_layout(1, 4), "zero1": real_layout(1, 4, zero=1), "zero2": real_layout(1, 4, zero=2),
           "zero3": real_layout(1, 4, zero=3), "zero2 offload": real_layout(1, 4, zero=2, offload=True),
           "dp2·tp2 sp": real_layout(2, 2, tp=2, sp=True), "dp2·pp2 1f1b": real_layout(2, 2, pp=2),
           "dp2·pp2 zb-v": real_layout(2, 2, pp=2, schedule="zb-v"), "dp2·cp2 ring": real_layout(2, 2, cp=2),
           "ulysses2": real_layout(2, 2, cp=2, cp_method="ulysses"),
           "dp2·pp2 full ckpt": real_layout(2, 2, pp=2, ckpt="full")}
# The batch's document structure, read once per micro-batch where attention needs it (on an accelerator these
# come from the loader's host tensors), and the ring parts a row's documents leave empty (skipped).
DOCUMENT_READS = ("data/micro_batch.py", "attention.py", "parallel/cp/ring_masks.py")
EXPERT_READS = ("moe/exchange.py", "moe/dispatch.py")  # ep all-to-all row counts; a dropless buffer's width


def _counted(engine, data=None) -> dict[str, int]:
    engine.train_batch(data)
    with HostSyncs() as syncs:
        engine.train_batch(data)
        engine.train_batch(data)
    return dict(syncs.sites)


def _real(family: str, kind: str, cfg: dict, extra: dict = LEAN) -> dict[str, int]:
    model = model_factory(family)()
    engine, *_ = paratrain.initialize(model=model, config={**copy.deepcopy(cfg), **extra}, training_data=RealRows(kind),
                                      model_parameters=hf_param_groups(model))
    return _counted(engine)


def _engine_api(extra: dict) -> dict[str, int]:
    """forward / backward / step, the DeepSpeed loop, on the GPT family (2 micro-batches a step)."""
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, **extra)
    engine, _, loader, _ = paratrain.initialize(model=tiny_gpt(), config=cfg, training_data=corpus_windows())

    def step():
        for _ in range(2):
            x, y = next(loader)
            engine.backward(engine(x, y))
            engine.step()

    step()
    with HostSyncs() as syncs:
        step()
        step()
    return dict(syncs.sites)


def _moe(variant: str, ep: int) -> dict[str, int]:
    engine, *_ = paratrain.initialize(model=moe_model(variant), config={**ep_config(ep, 4), **LEAN},
                                      training_data=corpus_windows())
    return _counted(engine)


def _matrix() -> dict[str, dict[str, int]]:
    out = {f"masked {name}": _real("llama", "masked", cfg) for name, cfg in LAYOUTS.items()}
    out["masked bf16 zero1"] = _real("llama", "masked", LAYOUTS["zero1"], {**LEAN, "bf16": {"enabled": True}})
    for kind in ("packed", "right"):
        for name in ("ddp", "dp2·tp2 sp", "dp2·cp2 ring"):
            out[f"{kind} {name}"] = _real("llama", kind, LAYOUTS[name])
    out["engine api lean"] = _engine_api(LEAN)
    out["engine api stop"] = _engine_api({})
    out["moe dropping ep1"] = _moe("dropping", 1)
    out["moe dropping ep2"] = _moe("dropping", 2)
    out["moe dropless ep1"] = _moe("dropless", 1)
    return out


def _outside(sites: dict[str, int], allowed: tuple[str, ...]) -> dict[str, int]:
    return {site: n for site, n in sites.items() if not any(f"paratrain/{path}:" in site for path in allowed)}


def test_training_steps_read_nothing_back(world4):
    import_or_skip("transformers")
    runs = world4.run(_matrix)
    for rank, per_case in enumerate(runs):
        for case, sites in per_case.items():
            where = f"rank {rank}, {case}: {sites}"
            if case.startswith("masked") or case in ("engine api lean", "moe dropping ep1"):
                assert sites == {}, where
            elif case == "engine api stop":  # one read of the norm per step, nothing else
                assert list(sites.values()) == [2] and "paratrain/engine/update.py:" in next(iter(sites)), where
            elif case.startswith("moe"):
                assert sites and _outside(sites, EXPERT_READS) == {}, where
            else:  # documents: only their structure is read, a bounded number of times per micro-batch
                assert sites and _outside(sites, DOCUMENT_READS) == {}, where
                assert sum(sites.values()) <= 16 * 4, where  # 4 micro-batches a rank in 2 steps

