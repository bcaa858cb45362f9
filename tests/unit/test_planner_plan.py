"""Planner, search and output: the enumeration's rules, the ranking, the config it writes, the CLI."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from paratrain.cli import main
from paratrain.config import load_config, resolve_batch
from paratrain.planner.enumerate import SearchSpace, enumerate_layouts, evaluate, invalid_reason
from paratrain.planner.hardware import GiB, Hardware
from paratrain.planner.layout import Layout
from paratrain.planner.model_shape import model_shape
from paratrain.planner.report import layout_config
from paratrain.planner.search import plan

SPEC = model_shape("gpt-1.3b")  # 24 layers, 32 heads, seq 2048


def test_every_enumerated_layout_obeys_the_rules():
    layouts = list(enumerate_layouts(SPEC, 32, 256, gpus_per_node=8))
    assert len(layouts) == len(set(layouts)) > 100
    for lay in layouts:
        assert invalid_reason(SPEC, lay, 8) is None
        assert lay.world == 32 and lay.global_batch == 256
        assert lay.tp <= 8 and SPEC.n_head % lay.tp == 0 and not (lay.zero_stage == 3 and lay.pp > 1)
        assert lay.recompute != "selective"  # flash attention: nothing to drop, so not enumerated twice
        if lay.dp * lay.cp == 1:
            assert lay.zero_stage == 0
    kinds = {(lay.tp, lay.pp, lay.cp, lay.schedule, lay.zero_stage) for lay in layouts}
    assert (2, 4, 1, "interleaved", 1) in kinds and (8, 1, 4, "none", 3) in kinds
    unfused = list(enumerate_layouts(SPEC, 4, 8, 8, SearchSpace(flash_attention=False)))
    assert any(lay.recompute == "selective" for lay in unfused)


def test_the_search_weighs_every_sequence_method_and_schedule():
    layouts = list(enumerate_layouts(SPEC, 16, 64, gpus_per_node=8))
    kinds = {(lay.cp, lay.cp_method, lay.ulysses_size) for lay in layouts}
    assert {(4, "ring", 1), (4, "ulysses", 1), (4, "usp", 2), (8, "usp", 4)} <= kinds
    assert {"zb-v", "dualpipev"} <= {lay.schedule for lay in layouts}
    assert all(lay.virtual_stages == 2 for lay in layouts if lay.schedule in ("zb-v", "dualpipev"))
    assert all(lay.grad_accum >= 2 * lay.pp for lay in layouts if lay.schedule == "dualpipev")
    # 12 heads: Ulysses over 8 ranks cannot split them, USP with a Ulysses part of 4 can (ring over 2).
    twelve = model_shape("gpt-125m")
    found = {(lay.cp, lay.cp_method, lay.ulysses_size) for lay in enumerate_layouts(twelve, 8, 8, gpus_per_node=8)
             if lay.tp == 1}
    assert (8, "ulysses", 1) not in found and (8, "usp", 4) in found and (8, "usp", 2) in found
    assert "Ulysses over 8 ranks does not divide the 12 heads" in invalid_reason(
        twelve, Layout(dp=1, micro_batch=1, grad_accum=8, cp=8, cp_method="ulysses"), 8)
    # At equal micro-batches ZB-V idles half as long as ZB-H1 and DualPipeV, which hold more activations; but
    # under a V rank 0 holds the embedding and the head, so with the uniform split its compute sets the pace.
    hw = Hardware(latency=0.0, intra_node_bandwidth=1e30, inter_node_bandwidth=1e30)
    base = Layout(dp=1, micro_batch=1, grad_accum=16, pp=4, schedule="zb-h1", precision="bf16")
    runs = {name: evaluate(SPEC, replace(base, schedule=name, virtual_stages=2 if name != "zb-h1" else 1), hw)
            for name in ("zb-h1", "zb-v", "dualpipev")}
    bubble = {name: run.time.bubble / (run.time.compute / base.grad_accum) for name, run in runs.items()}
    assert bubble == pytest.approx({"zb-h1": 1.0, "zb-v": 0.5, "dualpipev": 1.0})
    assert runs["zb-v"].memory.total < runs["dualpipev"].memory.total
    assert runs["zb-v"].time.compute > runs["zb-h1"].time.compute


@pytest.mark.parametrize("layout,reason", [
    (Layout(dp=1, micro_batch=1, grad_accum=1, tp=16), "tp=16 is larger than a node"),
    (Layout(dp=1, micro_batch=1, grad_accum=1, tp=3), "tp=3 does not divide the 32 heads"),
    (Layout(dp=2, micro_batch=1, grad_accum=4, pp=2, zero_stage=3, schedule="1f1b"), "ZeRO-3 with pipeline"),
    (Layout(dp=1, micro_batch=1, grad_accum=3, pp=2, schedule="interleaved", virtual_stages=2),
     "micro-batches \\(3\\) divisible by pp=2"),
    (Layout(dp=1, micro_batch=1, grad_accum=4, pp=5, schedule="interleaved", virtual_stages=2),
     "24 layers divisible by pp\\*v = 10"),
    (Layout(dp=1, micro_batch=1, grad_accum=1, cp=3), "cp=3 does not divide the sequence length 2048"),
    (Layout(dp=2, micro_batch=1, grad_accum=1, offload_optimizer=True), "offload needs ZeRO stage >= 1"),
    (Layout(dp=1, micro_batch=1, grad_accum=1, pp=2), "schedule is needed exactly when pp > 1"),
])
def test_invalid_layouts_say_why(layout, reason):
    found = invalid_reason(SPEC, layout, 8)
    assert found is not None and re.search(reason, found), found


def test_plan_ranks_fitting_layouts_by_time_and_memory_decides_what_fits():
    result = plan(SPEC, 16, 128, Hardware(gpu_memory=40 * GiB))
    times = [round(e.time.total, 6) for e in result.ranked]  # ties within a microsecond go to simpler layouts
    assert times == sorted(times) and len(result.ranked) > 10
    assert all(e.memory.total <= 36 * GiB for e in result.ranked)
    small = plan(SPEC, 16, 128, Hardware(gpu_memory=8 * GiB))
    assert 0 < len(small.ranked) < len(result.ranked)
    assert all(e.layout.zero_stage > 0 or e.layout.tp * e.layout.pp > 1 for e in small.ranked)  # 16 Psi > 8 GiB
    none = plan(SPEC, 2, 8, Hardware(gpu_memory=1 * GiB))
    assert none.ranked == [] and none.smallest is not None


def test_the_best_layout_config_is_a_valid_paratrain_config():
    result = plan(SPEC, 64, 512, Hardware())
    for e in result.ranked[:20]:
        cfg = load_config(layout_config(SPEC, e.layout))
        resolved = resolve_batch(cfg, 64)
        lay = e.layout
        assert (resolved.train_batch_size, resolved.gradient_accumulation_steps) == (512, lay.grad_accum)
        assert resolved.dp_size(64) == lay.dp and cfg.pipeline.stages == lay.pp
        assert cfg.zero_optimization.stage == lay.zero_stage and cfg.precision == lay.precision


def test_cli_prints_the_ranking_and_writes_the_config(tmp_path, capsys):
    out = tmp_path / "best.json"
    code = main(["plan", "--model", "gpt-1.3b", "--gpus", "16", "--gpu-memory", "40GiB", "--global-batch", "64",
                 "--top", "3", "--config-out", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "Top 3 by predicted step time" in text and "comm:" in text and "Config for #1" in text
    cfg = json.loads(out.read_text())
    assert cfg["trainer"]["model"] == "gpt-1.3b" and cfg["train_batch_size"] == 64
    load_config(cfg)


def test_cli_uses_a_config_file_as_the_model_and_keeps_its_optimizer(tmp_path, capsys):
    base = {"train_batch_size": 32, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "trainer": {"model": "gpt-small", "model_overrides": {"n_layer": 4}, "steps": 7}}
    (tmp_path / "c.json").write_text(json.dumps(base))
    code = main(["plan", "--model", str(tmp_path / "c.json"), "--gpus", "4", "--json", "--top", "2"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and len(report["ranked"]) == 2
    cfg = report["config"]
    assert cfg["optimizer"]["type"] == "SGD" and cfg["trainer"]["steps"] == 7 and cfg["train_batch_size"] == 32


def test_cli_errors_name_the_flag(capsys):
    assert main(["plan", "--model", "gpt-1.3b", "--gpus", "8", "--gpu-memory", "lots"]) == 2
    assert "--gpu-memory 'lots'" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt-1.3b", "--gpus", "8", "--schedules", "1f1b,zb-h2"]) == 2
    assert "zb-h2" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt-70b", "--gpus", "2", "--global-batch", "2"]) == 1
    assert "nothing fits" in capsys.readouterr().out


def test_evaluate_one_layout_is_what_the_search_reports():
    hw = Hardware(gpu_memory=40 * GiB)
    best = plan(SPEC, 16, 128, hw).ranked[0]
    again = evaluate(SPEC, best.layout, hw)
    assert again == best and again.fits
    too_big = evaluate(SPEC, Layout(dp=16, micro_batch=8, grad_accum=1), Hardware(gpu_memory=8 * GiB))
    assert not too_big.fits and too_big.memory.total > 8 * GiB * 0.9


def test_hsdp_is_enumerated_and_ranked_above_zero3_across_slow_node_links():
    """Two nodes of 8 with links 8x slower between them: ZeRO-3 over all 16 ranks gathers every parameter
    across nodes; HSDP (replicas across, shards inside) gathers inside a node and sends one gradient all-reduce
    across, so the planner ranks it first among the data-parallel-only ZeRO-3 layouts."""
    hw = Hardware(intra_node_bandwidth=200e9, inter_node_bandwidth=25e9)
    space = SearchSpace(zero_stages=(3,), schedules=("1f1b",), recompute=("full",), cp_methods=("ring",))
    result = plan(SPEC, 16, 64, hw, space)
    pure = [e for e in result.ranked if (e.layout.tp, e.layout.pp, e.layout.cp) == (1, 1, 1)]
    by_replicas = {}
    for e in pure:
        by_replicas.setdefault((e.layout.micro_batch, e.layout.dp_replicate), e)
    pairs = [(by_replicas[(mb, 1)], by_replicas[(mb, 2)]) for mb, r in by_replicas if r == 2 and (mb, 1) in by_replicas]
    assert pairs, sorted(by_replicas)
    for zero3, hsdp in pairs:
        assert hsdp.time.total < zero3.time.total, (zero3.layout.describe(), hsdp.layout.describe())
        assert result.ranked.index(hsdp) < result.ranked.index(zero3)
    assert "replicate2" in pairs[0][1].layout.describe()


def test_qlora_plans_keep_the_4bit_blocks_whole_and_write_quantize_base(capsys):
    """--quantize-base: tp only where its slices are whole blocks of 64 (llama-mini's d_ff 352 over tp2 would cut
    them; gpt-mini's widths of 128 and 512 allow tp2, not tp4), ZeRO-3 in the search (its 4-bit buffers costed), the
    written config carries peft.quantize_base, and a 4-bit base holds fewer parameter bytes per rank than the same
    layout's 16-bit one."""
    args = ["plan", "--model", "llama-mini", "--gpus", "8", "--global-batch", "32", "--lora-r", "8", "--json",
            "--precision", "bf16", "--top", "50"]
    assert main([*args, "--quantize-base", "nf4"]) == 0
    report = json.loads(capsys.readouterr().out)
    layouts = [r["layout"] for r in report["ranked"]]
    assert layouts and not any(re.search(r"tp[2-9]", lay) for lay in layouts), layouts
    assert report["config"]["peft"]["quantize_base"] == "nf4"
    assert main(args) == 0
    plain = {r["layout"]: r["memory"]["params"] for r in json.loads(capsys.readouterr().out)["ranked"]}
    same = [(r["memory"]["params"], plain[r["layout"]]) for r in report["ranked"] if r["layout"] in plain]
    assert same and all(q < full for q, full in same), same[:3]
    assert main(["plan", "--model", "gpt-mini", "--gpus", "8", "--global-batch", "32", "--lora-r", "8", "--json",
                 "--top", "5000", "--quantize-base", "nf4"]) == 0
    gpt = [r["layout"] for r in json.loads(capsys.readouterr().out)["ranked"]]
    assert any(" tp2 " in lay for lay in gpt) and not any(re.search(r" tp[48] ", lay) for lay in gpt), gpt[:3]
    assert any(" zero3 " in lay for lay in gpt), gpt[:3]
    assert main(["plan", "--model", "llama-mini", "--gpus", "8", "--quantize-base", "nf4"]) == 2
    assert "--quantize-base need --lora-r" in capsys.readouterr().err


def test_a_torchao_nf4_plan_writes_its_backend_and_refuses_what_torchao_cannot_quantize(capsys):
    """--quantize-backend torchao: gpt-mini's projections (multiples of 16384 values) are planned and the written config
    carries peft.quantize_backend; llama-mini's are refused by name (its k and v, 128 x 64, are not such multiples), as
    is the backend without nf4 and double quantization."""
    args = ["plan", "--gpus", "4", "--global-batch", "16", "--lora-r", "8", "--json", "--quantize-base", "nf4",
            "--double-quant", "--quantize-backend", "torchao"]
    assert main([*args, "--model", "gpt-mini"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ranked"] and report["config"]["peft"]["quantize_backend"] == "torchao"
    assert main([*args, "--model", "llama-mini"]) == 2
    assert "needs a multiple of 16384 values, and a projection has 128 x 64" in capsys.readouterr().err
    assert main([*args[:-3], "--quantize-backend", "torchao", "--model", "gpt-mini"]) == 2  # no --double-quant
    assert "--quantize-backend torchao needs --quantize-base nf4 --double-quant" in capsys.readouterr().err
