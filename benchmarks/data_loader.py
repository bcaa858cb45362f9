"""The fine-tuning job's data side against what a step consumes: is the loader ever what the step waits for?

    python examples/sft/make_data.py && paratrain train --config examples/sft/job.json --nproc-per-node 4
    python -m benchmarks.data_loader     # reads that run; writes benchmarks/results/data_loader.json + a docs table

On one process, on the example's files and tokenizer (examples/sft): reading and tokenizing the training
records (records/s and tokens/s of `iter_records` + `tokenize_records` in the chat format), building the rows
(best-fit packing), and drawing rows through the data-parallel loader (rows/s of `DataParallelLoader`, what
`train_batch` pulls per micro-batch). With workers: the example's records repeated COPIES times, tokenized by
`TokenizerPool` with 0, 1 and 2 worker processes (records/s once started; the start-up apart), and drawn
through the streaming loader (`StreamLoader`, the example's stream window, one worker: rows/s end to end,
tokenizing included). Against the example run's metrics: the rows a step consumes per second (rows per step /
the median step time) and the loader wait per step the run recorded (the example job streams, with a worker).
Medians of repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "data_loader.json"
COMMAND = "python -m benchmarks.data_loader"
COPIES = 8  # the example's 349 records are too few for a pool to show its rate


def _median_seconds(fn, repeats: int):
    times, value = [], None
    for _ in range(repeats):
        tic = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times), value


def measure(data_dir: Path, run_dir: Path, repeats: int) -> dict:
    import torch

    from paratrain.config.data import DataConfig
    from paratrain.data import DataParallelLoader, DataParallelSampler, iter_records, load_tokenizer, tokenize_records
    from paratrain.data.rows import Rows

    torch.set_num_threads(1)
    job = json.loads((ROOT / "examples" / "sft" / "job.json").read_text())
    cfg = DataConfig(**{**job["data"], "train": str(data_dir / "train.jsonl")})
    tokenizer = load_tokenizer(data_dir / "model")
    read_s, (examples, summary) = _median_seconds(lambda: tokenize_records(
        iter_records(cfg.train), cfg.format, tokenizer, seq_len=cfg.seq_len, overflow=cfg.overflow,
        on_untrainable=cfg.on_untrainable), repeats)
    rows_s, rows = _median_seconds(lambda: Rows(examples, cfg.seq_len, cfg.packing, tokenizer.pad_token_id), repeats)
    padded = Rows(examples, cfg.seq_len, False, tokenizer.pad_token_id)
    micro = job["train_micro_batch_size_per_gpu"]
    loader = DataParallelLoader(rows, DataParallelSampler(len(rows), micro, 1, 0, seed=0))
    draws = max(1, len(rows) // micro)
    draw_s, _ = _median_seconds(lambda: [next(loader) for _ in range(draws)], repeats)
    workers = _measure_workers(cfg, data_dir, repeats)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = statistics.median(r["step_time_s"] for r in metrics)
    rows_per_step = len(metrics[0]["samples"])
    return {"records": summary.records, "examples": summary.examples, "tokens": summary.tokens,
            "rows": len(rows), "rows_padded": len(padded),
            "padding_fraction_packed": rows.padding_fraction(range(len(rows))),
            "padding_fraction_padded": padded.padding_fraction(range(len(padded))), "tokenize_s": read_s,
            "records_per_s": summary.records / read_s,
            "tokens_per_s": summary.tokens / read_s, "build_rows_s": rows_s,
            "loader_rows_per_s": draws * micro / draw_s, "step_rows_per_s": rows_per_step / step_s,
            "step_time_s": step_s, "rows_per_step": rows_per_step,
            "loader_wait_s_median": statistics.median(r["loader_wait_s"] for r in metrics),
            "loader_wait_s_first": metrics[0]["loader_wait_s"],
            "loader_wait_s_max_after_first": max(r["loader_wait_s"] for r in metrics[1:]),
            "loader_wait_share": sum(r["loader_wait_s"] for r in metrics) / sum(r["step_time_s"] for r in metrics),
            "run_streaming": job["data"].get("streaming", False), "run_workers": job["data"].get("workers", 0),
            "run_stream_window": job["data"].get("stream_window"), **workers,
            "loader_wait_s_max": max(r["loader_wait_s"] for r in metrics),
            "padding_fraction_mean": statistics.fmean(r["padding_fraction"] for r in metrics),
            "steps": len(metrics), "repeats": repeats, "command": COMMAND}


def _measure_workers(cfg, data_dir: Path, repeats: int) -> dict:
    """Tokenizing rates with 0, 1, 2 worker processes, and the streaming loader's rows/s with one."""
    import tempfile

    from paratrain.data import iter_records
    from paratrain.data.stream import CHUNK_RECORDS, RowStream
    from paratrain.data.stream_loader import StreamLoader
    from paratrain.data.workers import TokenizerPool, TokenizeSpec, chunks

    records = list(iter_records(cfg.train)) * COPIES
    spec = TokenizeSpec(cfg.format, {}, cfg.seq_len, cfg.overflow, cfg.on_untrainable, str(data_dir / "model"))
    out: dict = {"worker_records": len(records)}
    for workers in (0, 1, 2):
        tic = time.perf_counter()
        pool = TokenizerPool(spec, workers)
        list(pool.map([records[:1]] * max(workers, 1)))  # started: spawned, imported, tokenizer loaded
        out[f"workers{workers}_startup_s"] = time.perf_counter() - tic
        seconds, _ = _median_seconds(lambda pool=pool: list(pool.map(chunks(records, CHUNK_RECORDS))), repeats)
        out[f"workers{workers}_records_per_s"] = len(records) / seconds
        pool.close()
    window = cfg.stream_window
    with tempfile.TemporaryDirectory() as tmp, TokenizerPool(spec, 1) as pool:
        path = Path(tmp) / "train.jsonl"
        path.write_text("".join(json.dumps(record) + "\n" for _, _, record in records))
        stream = RowStream(lambda: iter_records(path), spec, pool, seq_len=cfg.seq_len, packing=cfg.packing,
                           pad_id=0, window_records=window)
        loader = StreamLoader(stream, 8, 1, 0, seed=0)
        list(pool.map([records[:1]]))
        rows = len(records) // 2  # about one epoch of rows
        seconds, _ = _median_seconds(lambda: [next(loader) for _ in range(rows // 8)], 1)
        loader.close()
    out |= {"stream_window": window, "stream_rows_per_s": rows // 8 * 8 / seconds}
    return out


def table(result: dict) -> str:
    r = result
    return "\n".join([
        "| what | rate |", "|---|---:|",
        f"| read + tokenize (chat, {r['records']} records -> {r['examples']} examples, {r['tokens']:,} tokens) | "
        f"{r['records_per_s']:,.0f} records/s, {r['tokens_per_s']:,.0f} tokens/s |",
        f"| build {r['rows']} packed rows | {r['build_rows_s'] * 1e3:.1f} ms once |",
        f"| packed over the whole file: {r['rows']} rows, {r['padding_fraction_packed']:.1%} padding; padded (one "
        f"per row): {r['rows_padded']} rows, {r['padding_fraction_padded']:.1%} padding | "
        f"{r['rows_padded'] / r['rows']:.2f}x the rows to compute padded |",
        f"| loader: draw rows (one process) | {r['loader_rows_per_s']:,.0f} rows/s |",
        f"| tokenize in the rank's process ({r['worker_records']:,} records: the example's x{COPIES}) | "
        f"{r['workers0_records_per_s']:,.0f} records/s |",
        f"| tokenize with 1 worker process (start-up {r['workers1_startup_s']:.1f} s) | "
        f"{r['workers1_records_per_s']:,.0f} records/s |",
        f"| tokenize with 2 worker processes (start-up {r['workers2_startup_s']:.1f} s) | "
        f"{r['workers2_records_per_s']:,.0f} records/s |",
        f"| streaming loader, 1 worker, windows of {r['stream_window']} records (tokenizing included) | "
        f"{r['stream_rows_per_s']:,.0f} rows/s |",
        f"| the example job consumes | {r['step_rows_per_s']:,.1f} rows/s ({r['rows_per_step']} rows per step, "
        f"median step {r['step_time_s'] * 1e3:.0f} ms) |",
        "", f"Loader wait per step in the example run ({_run_data(r)}): median "
            f"{r['loader_wait_s_median'] * 1e3:.2f} ms, at most {r['loader_wait_s_max_after_first'] * 1e3:.2f} ms "
            f"after the first step (which waited {r['loader_wait_s_first'] * 1e3:.0f} ms for the first window), "
            f"{r['loader_wait_share']:.2%} of the run's step time over {r['steps']} steps; rows "
            f"{r['padding_fraction_mean']:.1%} padding on average. Medians of {r['repeats']} repeats, one thread "
            f"per process, on 2 cores."])


def _run_data(r: dict) -> str:
    if not r["run_streaming"]:
        return "rows tokenized before the first step"
    return f"streamed in windows of {r['run_stream_window']} records, {r['run_workers']} tokenizer worker(s) per rank"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("runs/sft"), help="make_data.py's output")
    parser.add_argument("--run", type=Path, default=Path("runs/sft/run"), help="the example job's run directory")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    result = measure(args.data, args.run, args.repeats)
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
