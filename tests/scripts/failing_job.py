"""A user's training script, launched on 2 processes by tests/distributed/test_failures.py (under `paratrain run` and
under a plain torchrun), failing the way argv[1] says: `data` trains the config of argv[2] (its data file is
missing) through `paratrain.trainer.train`; `config` and `adapter` build an engine from it with
`paratrain.initialize` (a bad value, a LoRA target that matches no module); `bug` builds a good engine, then
raises an exception of its own (not a paratrain error)."""

import json
import sys
from pathlib import Path

import paratrain
from paratrain.models import build_model

case, config = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
if case == "data":
    from paratrain.trainer import train

    train(config)
else:
    engine, *_ = paratrain.initialize(model=build_model("llama-tiny", vocab_size=260, seq_len=32), config=config)
    if case == "bug":
        raise ZeroDivisionError("a deliberate bug in the user's script")
