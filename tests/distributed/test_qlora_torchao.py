"""QLoRA over torchao's NF4 (torchtune's way), exact: `peft.quantize_backend: "torchao"` turns the adapted bases of
paratrain's Llama into torchao `NF4Tensor`s, whole, before any layout touches them, and the run equals one process
holding the same NF4 weights and running torchao's own forward (`linear_nf4`).

3 AdamW steps in fp32 on rows with masked prompts, clipping active, on 4 ranks: DDP and ZeRO-2 (the base whole), ZeRO-3
on dp4 with and without parameter offload (each unit's packed bytes, quantized scales and scale factors sharded,
gathered with the unit into the NF4Tensor's own tensors), pp2 (a stage's layers), tp2 alone (2 ranks), and dp2·tp2 under
DDP and ZeRO-3 (each rank's rows or columns of the packed bytes, dequantized as torchao does, beside the whole scales),
and the model arriving with its NF4 weights (`to_nf4` on each projection) in ZeRO-3 and dp2·tp2. Per step the loss and
the global gradient norm, and at the end every tensor (the adapters; the base's packed bytes, scales and factors),
within 1e-5 of the reference; on every rank but a pipeline's `memory_stats()` counts the frozen bytes equal to a
formula. A ZeRO-3 and a dp2·tp2 run resume bit for bit from a checkpoint with the NF4 base and without it, and the
dp2·tp2 checkpoint loads into DDP as the same model.
"""

from __future__ import annotations

import functools

from torch import nn

from paratrain.testing.parity import compare, reference_config, run_layout, summarize
from paratrain.testing.reference import reference_run
from tests.cases import import_or_skip
from tests.distributed.test_real_data import STEPS, real_layout
from tests.peft_cases import ALL_LINEAR, SECTIONS, resume_cases, section_model
from tests.real_data import RealRows, documents_loss

import_or_skip("torchao")

CLIP = 0.05  # below every reference step's gradient norm (asserted): clipping is active
MODEL = "llama qlora torchao"
LAYOUTS = {"ddp": real_layout(1, 4), "zero2": real_layout(1, 4, zero=2), "zero3": real_layout(1, 4, zero=3),
           "zero3 offload": real_layout(1, 4, zero=3, offload=True, offload_param=True),
           "pp2 1f1b": real_layout(2, 2, pp=2), "dp2 tp2": real_layout(1, 2, tp=2),
           "dp2 tp2 zero3": real_layout(1, 2, tp=2, zero=3)}
ALONE = {"tp2": real_layout(2, 1, tp=2)}  # on 2 ranks


def _frozen_bytes(engine) -> dict:
    return {"frozen": engine.memory_stats()["frozen_params"]}


def arriving_nf4() -> nn.Module:
    """The model as it comes from a torchao user: its projections' weights already torchao's NF4 (`to_nf4` on each
    nn.Linear's weight); the `peft` section then only adds the adapters."""
    from torchao.quantization import to_nf4

    model = section_model(MODEL)
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ALL_LINEAR:
            module.weight = nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
    return model


ARRIVING = {k: v for k, v in SECTIONS[MODEL].items() if k not in ("quantize_base", "double_quant", "quantize_backend")}


def _runs(names: list[str]) -> list:
    """Each layout; "... as it comes": the model arrives with its NF4 weights (`arriving_nf4`)."""
    return [run_layout({**{**LAYOUTS, **ALONE}[name.removesuffix(" as it comes")], "gradient_clipping": CLIP,
                        "peft": ARRIVING if name.endswith("as it comes") else SECTIONS[MODEL]},
                       arriving_nf4 if name.endswith("as it comes") else functools.partial(section_model, MODEL),
                       RealRows("masked"), STEPS, keep_state=True, inspect=_frozen_bytes) for name in names]


def _nf4_bytes(n: int, tp: int) -> tuple[int, int]:
    """An NF4 weight of n values: (its packed bytes on a tp rank, n/2/tp; what every rank keeps whole: a quantized
    int8 scale per block of 64, an fp32 factor per 256 blocks, the fp32 mean, the 16-entry fp32 code book)."""
    return n // 2 // tp, n // 64 + 4 * (n // 16384) + 4 + 16 * 4


def _formula(name: str) -> int:
    """A rank's frozen bytes by formula. Whole base (DDP) or split over tp: each NF4 weight `_nf4_bytes`; the
    embedding and head 1/tp of theirs (the Llama plan splits their vocabularies), the norms whole. ZeRO-3 (over dp
    ranks): per unit (each decoder layer; the root: embedding, final norm, head) one buffer per kind padded to a
    multiple of dp and sharded: the packed bytes, and for a whole base (tp 1) the int8 scales and fp32 factors, the
    fp32 norms; kept whole: the mean and code book (tp 1), or all but the packed bytes (a tp slice's scales)."""
    tp = 2 if "tp2" in name else 1
    dp = {**LAYOUTS, **ALONE}[name]["data_parallel"]["size"]
    model = section_model(MODEL, reference=True)
    nf4 = [m.weight.numel() for m in model.modules() if type(m).__name__ == "NF4Linear"]
    if "zero3" not in name:
        return sum(sum(_nf4_bytes(n, tp)) for n in nf4) + sum(
            p.numel() * 4 // (tp if "embed" in k or "lm_head" in k else 1)
            for k, p in model.named_parameters() if not p.requires_grad and type(p).__name__ != "NF4Tensor")

    def shard(count: int, size: int) -> int:
        return -(-count // dp) * size

    total = 0
    for layer in model.model.layers:
        sizes = [m.weight.numel() for m in layer.modules() if type(m).__name__ == "NF4Linear"]
        norms = sum(p.numel() for k, p in layer.named_parameters() if "norm" in k)
        total += shard(sum(n // 2 // tp for n in sizes), 1) + shard(norms, 4)
        if tp == 1:
            scales, factors = sum(n // 64 for n in sizes), sum(n // 16384 for n in sizes)
            total += shard(scales, 1) + shard(factors, 4) + 68 * len(sizes)
        else:
            total += sum(_nf4_bytes(n, tp)[1] for n in sizes)
    vocab = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    return total + shard(vocab // tp + model.model.norm.weight.numel(), 4)


def _reference(layout: dict, run):
    """One process holding the same NF4 weights, running torchao's forward, on the global batch `run` trained on."""
    config = {**layout, "gradient_clipping": CLIP, "peft": SECTIONS[MODEL]}
    reference = reference_run(functools.partial(section_model, MODEL, True), reference_config(config, run),
                              RealRows("masked"), STEPS, loss_of=documents_loss)
    assert all(norm > CLIP for norm in reference.grad_norms), reference.grad_norms
    return reference


def test_torchao_nf4_bases_train_exactly_in_ddp_zero3_and_tensor_parallelism(world4):
    names = [*LAYOUTS, "zero3 as it comes", "dp2 tp2 as it comes"]
    per_rank = world4.run(_runs, names)
    reference = None
    for i, name in enumerate(names):
        run = per_rank[0][i]
        reference = reference or _reference(LAYOUTS[name], run)
        summary = summarize(compare(run, reference))
        print(f"torchao nf4 {name} ({run.case}): loss {summary['loss_err']:.1e} norm {summary['norm_err']:.1e} "
              f"param {summary['param_err']:.1e}")
        assert summary["passed"], (name, summary)
        if "pp2" not in name:  # (a stage holds its own layers)
            want = _formula(name.removesuffix(" as it comes"))
            assert [ranks[i].extra["frozen"] for ranks in per_rank] == [want] * 4, (name, want)


def test_torchao_nf4_bases_train_exactly_in_tp2_alone(world2):
    """Tensor parallelism alone (2 ranks, 2 micro-batches each): the NF4 slices on their own, parity and bytes."""
    run = world2.run(_runs, ["tp2"])
    summary = summarize(compare(run[0][0], _reference(ALONE["tp2"], run[0][0])))
    assert summary["passed"], summary
    assert [ranks[0].extra["frozen"] for ranks in run] == [_formula("tp2")] * 2


def _checkpoints(root: str) -> dict:
    """`resume_cases` for the NF4 model made again as it was (same base, same adapters), then loaded; each checkpoint
    with the base also loads into DDP."""
    from paratrain import initialize

    def start(config: dict):
        return initialize(model=section_model(MODEL), config={**config, "peft": SECTIONS[MODEL]},
                          training_data=RealRows("masked"))[0]

    layouts = {"zero3": LAYOUTS["zero3"], "dp2 tp2": LAYOUTS["dp2 tp2"]}
    return resume_cases(root, layouts, start, start, then=LAYOUTS["ddp"])


def test_an_nf4_run_resumes_bit_for_bit_with_and_without_its_base_and_loads_in_another_layout(world4, tmp_path):
    for case, r in world4.run(_checkpoints, str(tmp_path))[0].items():
        assert r["losses"][0] == r["losses"][1] and r["equal"], (case, r)
