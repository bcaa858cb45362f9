"""DeepSpeed compatibility at the bottom layer: the DeepSpeed names paratrain refuses, with the replacement
(`names.py`). The engine accessors DeepSpeed scripts call are `paratrain/engine/deepspeed_api.py`. See
docs/deepspeed-compat.md."""
