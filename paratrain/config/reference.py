"""Generate the key reference in docs/config.md from the schema, so the docs cannot drift from the code.

    python -m paratrain.config.reference --write docs/config.md
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from paratrain.config.load import DEEPSPEED_UNSUPPORTED, _model_of
from paratrain.config.schema import Config

BEGIN, END = "<!-- generated: config keys -->", "<!-- /generated: config keys -->"


def _type_name(annotation) -> str:
    text = str(annotation).replace("typing.", "")
    return re.sub(r"<class '([\w.]+)'>", lambda m: m.group(1).split(".")[-1], text)


def _default(field) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
        return "—" if value is None else json.dumps(value) if not isinstance(value, BaseModel) else "{…}"
    if field.default_factory is not None:
        value = field.default_factory()
        return "{…}" if isinstance(value, BaseModel) else json.dumps(value)
    return "required"


def rows(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        sub = _model_of(field.annotation)
        if sub is not None:
            doc = (sub.__doc__ or "").strip().split("\n")[0]
            out.append(f"| **`{prefix}{name}`** | section | | {doc} |")
            out += rows(sub, f"{prefix}{name}.")
        else:
            desc = " ".join((field.description or "").split())  # one table row: a docstring's lines joined
            out.append(f"| `{prefix}{name}` | `{_type_name(field.annotation)}` | `{_default(field)}` | {desc} |")
    return out


def generate() -> str:
    lines = [BEGIN, "| key | type | default | notes |", "|---|---|---|---|", *rows(), "",
             "DeepSpeed sections that are recognized and refused unless `enabled` is false: " +
             ", ".join(f"`{k}`" for k in sorted(DEEPSPEED_UNSUPPORTED)) + ".", END]
    return "\n".join(lines)


def update(path: Path) -> bool:
    text = path.read_text()
    new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: generate(), text, flags=re.S)
    changed = new != text
    path.write_text(new)
    return changed


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", type=Path, help="rewrite the generated block of this markdown file")
    args = parser.parse_args()
    if args.write:
        update(args.write)
    else:
        print(generate())
    sys.exit(0)
