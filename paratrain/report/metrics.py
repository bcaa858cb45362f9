"""The metrics part of a report: pictures of metrics.jsonl and a short text summary (summary.md).

metrics.jsonl (written by `paratrain train` on rank 0) has one row per optimizer step: loss, lr, grad norm,
step time, tokens/s, model-state bytes, comm bytes and counts per axis/op, sometimes val_loss, and every
`steps_per_print` steps every rank's model-state bytes and peak RSS; an MoE model's rows add `moe_tokens`
({layer: tokens per expert}), `moe_dropped` and the moe_* scalars. A row without a loss is an evaluation before
the first step (step 0, trainer.eval_at_start). summary.json adds the layout and an early stop.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

from paratrain.report.errors import ReportError

MIB = 2**20


def load_rows(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ReportError(f"{path} line {number} is not JSON ({exc}); was the run interrupted while writing?") \
                from None
    return rows


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", MIB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _spread(values: list[int]) -> str:
    low, high = min(values), max(values)
    return _bytes(low) if low == high else f"{_bytes(low)} to {_bytes(high)}"


def summarize(rows: list[dict], summary: dict, pictures: list[Path], evaluations: list[dict] = (),
              events: str | None = None) -> str:
    """The text summary: layout, loss, speed, memory and communication, in a few lines of markdown.
    `evaluations`: the rows of evaluations outside a training step (step 0); `events`: `events_summary`'s line."""
    from paratrain.report.plots import comm_per_axis

    lines = [f"# Run summary: {summary.get('run_dir', '')}".rstrip(), ""]
    if summary:
        params = summary.get("params")
        lines.append(f"- layout {summary.get('layout', '?')} on {summary.get('world_size', '?')} process(es)"
                     + (f", {params / 1e6:.2f}M parameters" if params else "")
                     + f", {len(rows)} steps" + (f" in {summary['wall_s']:.1f} s" if "wall_s" in summary else ""))
    if summary.get("frozen_params"):  # trained through adapters (or with frozen parts)
        lines.append(f"- parameters: {summary['trainable_params']:,} trainable, {summary['frozen_params']:,} frozen "
                     f"({summary['trainable_params'] / (summary['trainable_params'] + summary['frozen_params']):.2%} "
                     f"trained)")
    val = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    lines.append(f"- loss {rows[0]['loss']:.4f} (step 1) -> {rows[-1]['loss']:.4f} (step {rows[-1]['step']})"
                 + (f", last validation loss {val[-1]:.4f}" if val else ""))
    for row in evaluations:
        lines.append(f"- validation loss {row['val_loss']:.4f} at step {row['step']} (before training)")
    if summary.get("stopped_early_at") is not None:
        lines.append(f"- stopped early at step {summary['stopped_early_at']}: the validation loss stopped improving "
                     f"(best {summary['best_val_loss']:.4f} at step {summary['best_val_step']})")
    times = [r["step_time_s"] for r in rows]
    lines.append(f"- speed: median step {statistics.median(times) * 1000:.1f} ms, median "
                 f"{statistics.median(r['tokens_per_s'] for r in rows):,.0f} tokens/s (timings are wall clock on "
                 f"whatever else the machine was doing)")
    last = next((r for r in reversed(rows) if "state_bytes_per_rank" in r), None)
    if last is not None:
        lines.append(f"- model state per rank (params + grads + optimizer state): "
                     f"{_spread(last['state_bytes_per_rank'])}")
        if last.get("peak_rss_per_rank"):
            lines.append(f"- peak RSS per rank: {_spread(last['peak_rss_per_rank'])}")
    else:
        lines.append(f"- model state on rank 0: {_bytes(rows[-1]['state_bytes'])}")
    per_axis: dict[str, list[int]] = {}
    for row in rows:
        for axis, count in comm_per_axis(row).items():
            per_axis.setdefault(axis, []).append(count)
    if per_axis:
        parts = ", ".join(f"{axis} {_bytes(statistics.median(v))}" for axis, v in sorted(per_axis.items()))
        lines.append(f"- communication per step on rank 0 (median): {parts}")
    for extra in (events, checkpoint_summary(rows, summary), moe_summary(rows), data_summary(rows, summary),
                  preference_summary([*evaluations, *rows]),
                  samples_summary([*evaluations, *rows]), grpo_summary(rows), replica_summary(rows, summary)):
        if extra:
            lines.append(extra)
    lines += ["", "Pictures: " + ", ".join(p.name for p in pictures)]
    return "\n".join(lines)


def moe_summary(rows: list[dict]) -> str | None:
    """The MoE line: the most and least loaded expert over the run (its tokens / its layer's mean) and the
    fraction of routed choices dropped by capacity; None without MoE rows."""
    from paratrain.report.plots import moe_layers

    rows = [r for r in rows if r.get("moe_tokens")]
    layers = moe_layers(rows)
    if not layers:
        return None
    loads, routed, dropped = [], 0, 0
    for name in layers:
        counts = [row["moe_tokens"][name] for row in rows if name in row["moe_tokens"]]
        totals = [sum(column) for column in zip(*counts)]
        mean = sum(totals) / len(totals)
        routed += sum(totals)
        dropped += sum(row.get("moe_dropped", {}).get(name, 0) for row in rows)
        loads += [(count / mean if mean else 1.0, expert, name) for expert, count in enumerate(totals)]
    (high, e_high, l_high), (low, e_low, l_low) = max(loads), min(loads)
    experts = {len(row["moe_tokens"][name]) for row in rows for name in row["moe_tokens"]}
    return (f"- MoE routing ({len(layers)} layers x {'/'.join(map(str, sorted(experts)))} experts, {len(rows)} steps): "
            f"most loaded expert {e_high} of {l_high} ({high:.2f}x its layer's mean), least loaded expert {e_low} "
            f"of {l_low} ({low:.2f}x); {dropped / routed if routed else 0.0:.2%} of the routed choices dropped")


def preference_summary(rows: list[dict]) -> str | None:
    """A dpo run: the reward accuracy and margin at the first and last step (the mean of the last tenth of the
    steps, whose global batches are small and noisy) and on the held-out pairs; None without them."""
    trained = [r for r in rows if "rewards/accuracies" in r]
    held_out = [r for r in rows if "eval/rewards/accuracies" in r]
    if not trained and not held_out:
        return None
    parts = []
    if trained:
        tail = trained[-max(1, len(trained) // 10):]
        parts.append(f"training reward accuracy {trained[0]['rewards/accuracies']:.1%} (step {trained[0]['step']}) "
                     f"-> {statistics.fmean(r['rewards/accuracies'] for r in tail):.1%}, margin "
                     f"{statistics.fmean(r['rewards/margins'] for r in tail):.3f} (mean of steps {tail[0]['step']}-"
                     f"{tail[-1]['step']})")
    if held_out:
        first, last = held_out[0], held_out[-1]
        parts.append(f"held-out pairs: reward accuracy {first['eval/rewards/accuracies']:.1%} (step {first['step']}) "
                     f"-> {last['eval/rewards/accuracies']:.1%} (step {last['step']}), margin "
                     f"{first['eval/rewards/margins']:.3f} -> {last['eval/rewards/margins']:.3f}")
    return "- preference (dpo): " + "; ".join(parts)


def grpo_summary(rows: list[dict]) -> str | None:
    """A grpo run: the reward and each function's mean over the first and the last tenth of the rollout batches
    (one batch is a few prompts: noisy), the sampler's largest log-prob mismatch, and the last batch's rollouts;
    None without rewards."""
    rows = [r for r in rows if "reward" in r]
    if not rows:
        return None
    tenth = max(1, len(rows) // 10)
    head, tail = rows[:tenth], rows[-tenth:]
    span = f"steps {head[0]['step']}-{head[-1]['step']} -> {tail[0]['step']}-{tail[-1]['step']}"
    names = [k for k in rows[0] if k.startswith("rewards/") and k.endswith("/mean")]
    parts = [f"reward {statistics.fmean(r['reward'] for r in head):.3f} -> "
             f"{statistics.fmean(r['reward'] for r in tail):.3f} (means of {span})"]
    parts += [f"{name.split('/')[1]} {statistics.fmean(r[name] for r in head):.3f} -> "
              f"{statistics.fmean(r[name] for r in tail):.3f}" for name in names]
    lines = ["- rewards (grpo): " + "; ".join(parts)]
    split = [name for name in ("generation_s", "rewards_s", "update_s") if name in rows[0]]
    if split:
        lines.append("- a rollout batch's time (median): " + ", ".join(
            f"{name.removesuffix('_s')} {statistics.median(r[name] for r in rows) * 1e3:.1f} ms" for name in split))
    mismatch = [r["logprob_mismatch"] for r in rows if "logprob_mismatch" in r]
    if mismatch:
        lines.append(f"- sampler vs training log-probs: mean |difference| per token at most {max(mismatch):.2e} "
                     f"(over {len(mismatch)} rollout batches)")
    last = rows[-1]
    if last.get("rollouts"):
        lines.append(f"- rollouts at step {last['step']} (each prompt's first completion, its reward):")
        lines += [f"  - {json.dumps(r['prompt'][-200:])} -> {json.dumps(r['completion'])} ({r['reward']})"
                  for r in last["rollouts"]]
    return "\n".join(lines)


def samples_summary(rows: list[dict]) -> str | None:
    """trainer.samples: each prompt's answer at the first and the last evaluation that generated (before and
    after fine-tuning); None without generations."""
    generated = [r for r in rows if r.get("generations")]
    if not generated:
        return None
    first, last = generated[0], generated[-1]
    lines = [f"- sample generations (greedy) at step {first['step']}"
             + (f" and step {last['step']}:" if last is not first else ":")]
    for i, sample in enumerate(first["generations"]):
        lines.append(f"  - prompt {json.dumps(sample['prompt'][-200:])}")
        lines.append(f"    - step {first['step']}: {json.dumps(sample['completion'])}")
        if last is not first:
            lines.append(f"    - step {last['step']}: {json.dumps(last['generations'][i]['completion'])}")
    return "\n".join(lines)


def data_summary(rows: list[dict], summary: dict) -> str | None:
    """A data-section job: what was read and cut, the padding, the loader's wait."""
    padded = [r["padding_fraction"] for r in rows if "padding_fraction" in r]
    if not padded:
        return None
    line = (f"- data: padding {statistics.fmean(padded):.1%} of the trained positions (mean over steps), loader "
            f"wait median {statistics.median(r['loader_wait_s'] for r in rows if 'loader_wait_s' in r) * 1e3:.2f} "
            f"ms per step")
    data = summary.get("data", {})
    train = data.get("train")
    if train:
        laid_out = (f"in {data['train_rows']} rows" if "train_rows" in data else
                    f"streamed in windows of {data.get('stream_window')} records")
        line += (f"; {train['records']} records read, {train['examples']} examples {laid_out}, "
                 f"{train['skipped_untrainable']} skipped with nothing to train, {train['truncated']} truncated, "
                 f"{train['split']} split")
    return line


def checkpoint_summary(rows: list[dict], summary: dict) -> str | None:
    """The saves: how long training stalled for each (the call until the step went on) against the median step
    without one, and how long writing took (an asynchronous save's, beside training)."""
    # every save, the job's last included (its stall comes after the last row), from the summary when it has them
    saves = [s for s in summary.get("checkpoints", []) if s.get("stall_s") is not None]
    timed = [r for r in rows if "checkpoint/stall_s" in r]
    stalls = [s["stall_s"] for s in saves] or [r["checkpoint/stall_s"] for r in timed]
    if not stalls:
        return None
    writes = [s["write_s"] for s in saves if s.get("write_s") is not None] or \
        [r["checkpoint/write_s"] for r in rows if "checkpoint/write_s" in r]
    saved = {s["step"] for s in saves} or {r.get("checkpoint/step", r["step"]) for r in timed}
    plain = [r["step_time_s"] for r in rows if r["step"] not in saved]
    kinds = {s.get("async") for s in summary.get("checkpoints", [])}
    kind = {frozenset({True}): " (asynchronous)", frozenset({False}): " (synchronous)"}.get(frozenset(kinds), "")
    stall = statistics.median(stalls)
    share = f" ({stall / statistics.median(plain):.1%} of the median step without a save)" if plain else ""
    written = f", written in {statistics.median(writes):.3f} s (median)" if writes else ""
    return f"- checkpoints{kind}: {len(stalls)} saves, training stalled {stall * 1000:.1f} ms (median){share}{written}"


def replica_summary(rows: list[dict], summary: dict) -> str | None:
    """Replica groups (docs/fault-tolerance.md): each failure and its recovery from the summary's `recoveries`, and a
    restarted group's healing from a live peer (`healed`)."""
    groups = summary.get("replica_groups")
    if not groups:
        return None
    alone = sum(r.get("participants", groups) < groups for r in rows)
    line = (f"- replica groups: group {summary.get('replica_group', 0)} of {groups}; {alone} of {len(rows)} steps "
            f"trained with fewer groups up")
    for rec in summary.get("recoveries") or []:
        line += (f"; step {rec['step']} failed ({len(rec['failed_attempts_s'])} attempt(s)) and was redone by "
                 f"{rec['participants_after']} group(s) on {rec['shards_trained']} of {groups} shards, "
                 f"{rec['failed_step_s']:.2f} s in all, {rec['lost_rows']} rows lost")
        if rec.get("rejoined_at_step") is not None:
            line += f", every group back at step {rec['rejoined_at_step']} ({rec['degraded_s']:.1f} s later)"
    healed = summary.get("healed")
    if healed:
        line += (f"; this group healed from a live peer at step {healed['healed_at_step']}, "
                 f"{healed['process_start_to_rejoin_s']:.2f} s after its processes started")
    return line


def step_events(rows: list[dict], config: dict) -> dict[str, list[int]]:
    """The steps that did more than train, from the rows and the run's config.json: checkpoint saves (inside the
    step's time: its spikes), evaluations (after the step) and every steps_per_print step's all-gather of the
    per-rank memory (counted in the next step's communication). Kinds without steps are left out."""
    steps = [r["step"] for r in rows]
    every = (config.get("checkpoint") or {}).get("save_every") or 0
    saves = [s for s in steps if every and s % every == 0] if (config.get("checkpoint") or {}).get("dir") else []
    events = {"checkpoint save": saves, "evaluation": [r["step"] for r in rows if r.get("val_loss") is not None],
              "per-rank memory gather": [r["step"] for r in rows if "state_bytes_per_rank" in r]}
    return {kind: found for kind, found in events.items() if found}


def events_summary(rows: list[dict], events: dict[str, list[int]]) -> str | None:
    """The steps of each event kind against the others: what a spike or dip in the pictures is."""
    if not events:
        return None
    eventful = {s for found in events.values() for s in found}
    plain = [r["step_time_s"] for r in rows if r["step"] not in eventful]
    parts = []
    for kind, found in events.items():
        at = set(found)
        times = [r["step_time_s"] for r in rows if r["step"] in at]
        shown = ", ".join(map(str, found[:6])) + (", ..." if len(found) > 6 else "")
        parts.append(f"{kind} at steps {shown} (median step {statistics.median(times) * 1000:.1f} ms)")
    rest = f"; the other steps {statistics.median(plain) * 1000:.1f} ms" if plain else ""
    return f"- marked in throughput.png and comm.png: {'; '.join(parts)}{rest}"


def metrics_report(run_dir: Path) -> str | None:
    """metrics.jsonl -> loss.png, throughput.png, memory.png, comm.png (moe_tokens.png for an MoE model, data.png
    for a data-section job, preference.png for a dpo run, rewards.png for a grpo run) and summary.md; None without
    metrics."""
    source = run_dir / "metrics.jsonl"
    if not source.is_file():
        return None
    rows = load_rows(source)
    evaluations = [r for r in rows if "loss" not in r]  # step 0: validation before training
    rows = [r for r in rows if "loss" in r]
    if not rows:
        raise ReportError(f"{source} is empty: the run stopped before its first step")
    if importlib.util.find_spec("matplotlib") is None:
        raise ReportError("drawing the metrics needs matplotlib: pip install 'paratrain[plot]'")
    from paratrain.report import plots
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    config_path = run_dir / "config.json"
    events = step_events(rows, json.loads(config_path.read_text()) if config_path.is_file() else {})
    pictures = [plots.plot_loss(rows, run_dir / "loss.png", evaluations),
                plots.plot_throughput(rows, run_dir / "throughput.png", events)]
    last = next((r for r in reversed(rows) if "state_bytes_per_rank" in r), None)
    state = last["state_bytes_per_rank"] if last else [rows[-1]["state_bytes"]]
    pictures.append(plots.plot_memory(state, last.get("peak_rss_per_rank") if last else None,
                                      run_dir / "memory.png"))
    comm_png = plots.plot_comm(rows, run_dir / "comm.png", events)
    if comm_png is not None:
        pictures.append(comm_png)
    for extra in (plots.plot_moe_tokens(rows, run_dir / "moe_tokens.png"), plots.plot_data(rows, run_dir / "data.png"),
                  plots.plot_preference([*evaluations, *rows], run_dir / "preference.png"),
                  plots.plot_rewards(rows, run_dir / "rewards.png")):
        if extra is not None:
            pictures.append(extra)
    text = summarize(rows, summary, pictures, evaluations, events_summary(rows, events))
    (run_dir / "summary.md").write_text(text + "\n")
    return text
