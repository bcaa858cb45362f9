"""`paratrain checkpoint inspect | export | convert`: one process, no torch.distributed.

    paratrain checkpoint inspect ckpts [--tag T] [--no-verify] [--tensors]
    paratrain checkpoint export ckpts --out model.safetensors [--hf [--n-head N]] [--dtype bf16]
    paratrain checkpoint export ckpts --out hf-dir --hf                    # a transformers model's checkpoint
    paratrain checkpoint convert ckpts ckpts-single [--tag T] [--out-tag T2]
"""

from __future__ import annotations

import argparse
import math
import sys

from paratrain.checkpoint.format import CheckpointError


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)

    def source(p: argparse.ArgumentParser) -> None:
        p.add_argument("path", help="checkpoint directory (its 'latest' tag is used) or DIR/TAG")
        p.add_argument("--tag", default=None, help="the tag to read instead of the one 'latest' names")
        p.add_argument("--no-verify", action="store_true", help="check file sizes only, not their sha256")

    inspect = sub.add_parser("inspect", help="print what a checkpoint holds (and verify its files)")
    source(inspect)
    inspect.add_argument("--tensors", action="store_true", help="list every tensor with its shape and pieces")
    export = sub.add_parser("export", help="write the consolidated model as one safetensors file")
    source(export)
    export.add_argument("--out", required=True, help="output .safetensors file (--hf: or a model directory)")
    export.add_argument("--format", default="safetensors", choices=["safetensors"], help="output format")
    export.add_argument("--hf", action="store_true", help="Hugging Face names and config.json beside the weights (GPT: "
                        "GPT-2's; a transformers model: its own), loadable by from_pretrained")
    export.add_argument("--n-head", type=int, default=None, help="--hf: attention heads, if not in the config")
    export.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="cast floating tensors")
    convert = sub.add_parser("convert", help="rewrite as a single-rank checkpoint (every tensor whole)")
    source(convert)
    convert.add_argument("out_dir", help="directory to write the converted checkpoint to")
    convert.add_argument("--out-tag", default=None, help="tag of the converted checkpoint (default: the same)")


def run_checkpoint(args: argparse.Namespace) -> int:
    from paratrain.checkpoint.export import CheckpointReader, convert, export_safetensors

    try:
        reader = CheckpointReader(args.path, args.tag, verify=not args.no_verify)
        if args.action == "inspect":
            print(describe(reader, args.tensors, verified=not args.no_verify))
        elif args.action == "export":
            from paratrain.precision import compute_dtype

            dtype = compute_dtype(args.dtype) if args.dtype else None
            state = export_safetensors(reader, args.out, hf=args.hf, dtype=dtype, n_head=args.n_head)
            print(f"wrote {len(state)} tensors ({sum(t.numel() for t in state.values()):,} elements) to {args.out}")
        else:
            path = convert(reader, args.out_dir, args.out_tag)
            print(f"wrote single-rank checkpoint {path}")
    except CheckpointError as exc:
        print(f"paratrain checkpoint {args.action}: {exc}", file=sys.stderr)
        return 2
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def describe(reader, tensors: bool = False, verified: bool = True) -> str:
    m = reader.manifest
    layout, states, opt = m["layout"], m["states"], m["optimizer"]
    train = states.get("train") or {}
    model = {k: v for k, v in m["tensors"].items() if k.startswith("model/")}
    states = sorted({k.split("/")[1] for k in m["tensors"] if k.startswith("optim/")})
    lines = [
        f"checkpoint {reader.path} (tag {m['tag']}), paratrain {m['paratrain_version']}, torch {m['torch_version']}",
        f"layout: {layout['describe']} ({layout['world_size']} ranks), ZeRO stage {layout['zero_stage']}, "
        f"{layout['precision']}, train_batch_size {layout['train_batch_size']}, gradient_accumulation_steps "
        f"{layout['gradient_accumulation_steps']}",
        f"engine: global_steps {train.get('global_steps')}, micro_steps {train.get('micro_steps')}, global_samples "
        f"{train.get('global_samples')}, skipped_steps {train.get('skipped_steps')}; states saved: "
        f"{', '.join(sorted(states)) or 'none'}",
        f"data: {train['data']}" if train.get("data") else "data: no training loader position",
        f"optimizer: {opt['type']}, {len(opt['groups'])} group(s), states {', '.join(states) or '-'}, scalars "
        f"{', '.join(sorted(opt['scalars'])) or '-'}" if opt else "optimizer: none",
        f"model: {len(model)} tensors, {sum(math.prod(v['shape']) for v in model.values()):,} elements",
        f"files: {len(m['files'])}, {_size(sum(f['bytes'] for f in m['files'].values()))}, "
        f"{'sha256 verified' if verified else 'sizes checked (not verified)'}",
        f"client_state: {sorted(m['client_state'])}" if m["client_state"] else "client_state: none",
    ]
    if tensors:
        for key, info in m["tensors"].items():
            lines.append(f"  {key:<48} {str(info['shape']):<16} {info['dtype']:<9} {len(m['pieces'][key])} piece(s)")
    return "\n".join(lines)
