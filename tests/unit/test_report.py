"""`paratrain report` on a run directory's metrics: four pictures and a summary whose numbers come from the rows."""

from __future__ import annotations

import json

import pytest

from paratrain.cli import main as cli_main
from paratrain.report import ReportError, build_report

PNG = b"\x89PNG\r\n\x1a\n"


def _rows(steps: int = 6) -> list[dict]:
    rows = []
    for step in range(1, steps + 1):
        comm = {"dp": {"all_reduce": {"calls": 1, "elements": 1000, "bytes": 4000}},
                "tp": {"all_reduce": {"calls": 8, "elements": 2048, "bytes": 8192},
                       "all_gather": {"calls": 2, "elements": 256, "bytes": 1024}}}
        row = {"step": step, "loss": 5.0 - 0.5 * step, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 0.1 * step,
               "tokens_per_s": 1000.0 / step, "state_bytes": 3 * 2**20, "comm_bytes": 13216, "comm": comm}
        if step % 2 == 0:  # checkpoint.save_every 2, asynchronous: each write seen a step later
            row["checkpoint/stall_s"] = 0.004
        if step % 2 == 1 and step > 1:
            row["checkpoint/write_s"] = 0.5
        if step % 3 == 0:
            row.update(val_loss=4.6 - 0.5 * step, state_bytes_per_rank=[3 * 2**20, 3 * 2**20, 2**20, 2**20],
                       peak_rss_per_rank=[400 * 2**20, 401 * 2**20, 402 * 2**20, 410 * 2**20])
        rows.append(row)
    return rows


def test_metrics_report_draws_and_summarizes(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in _rows()) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({"layout": "dp2 x tp2", "world_size": 4, "params": 2_500_000,
                                                        "wall_s": 2.5, "run_dir": "runs/x",
                                                        "checkpoints": [{"async": True}] * 3}))
    (tmp_path / "config.json").write_text(json.dumps({"checkpoint": {"dir": "ck", "save_every": 2}}))
    assert cli_main(["report", str(tmp_path)]) == 0
    for name in ("loss", "throughput", "memory", "comm"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG
    summary = (tmp_path / "summary.md").read_text().splitlines()
    assert "- layout dp2 x tp2 on 4 process(es), 2.50M parameters, 6 steps in 2.5 s" in summary
    assert "- loss 4.5000 (step 1) -> 2.0000 (step 6), last validation loss 1.6000" in summary
    assert any(line.startswith("- speed: median step 350.0 ms, median 292 tokens/s") for line in summary)
    assert "- model state per rank (params + grads + optimizer state): 1.00 MiB to 3.00 MiB" in summary
    assert "- peak RSS per rank: 400.00 MiB to 410.00 MiB" in summary
    assert "- communication per step on rank 0 (median): dp 3.91 KiB, tp 9.00 KiB" in summary
    # steps without a save: 0.1, 0.3, 0.5 s
    assert ("- checkpoints (asynchronous): 3 saves, training stalled 4.0 ms (median) (1.3% of the median step "
            "without a save), written in 0.500 s (median)") in summary
    # the steps that did more than train, marked in the pictures and timed apart (step time: 0.1 s x step)
    assert ("- marked in throughput.png and comm.png: checkpoint save at steps 2, 4, 6 (median step 400.0 ms); "
            "evaluation at steps 3, 6 (median step 450.0 ms); per-rank memory gather at steps 3, 6 (median step "
            "450.0 ms); the other steps 300.0 ms") in summary


def test_report_errors_name_the_problem(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_rows(1)[0]) + "\n{\"step\": 2, \"lo")
    with pytest.raises(ReportError, match="metrics.jsonl line 2 is not JSON"):
        build_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ReportError, match="is empty: the run stopped before its first step"):
        build_report(tmp_path)
    with pytest.raises(ReportError, match="does not exist"):
        build_report(tmp_path / "nothing")
