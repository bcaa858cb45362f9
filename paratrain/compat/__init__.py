"""DeepSpeed compatibility: the engine accessors DeepSpeed scripts use (`engine_api.py`) and the names
paratrain refuses with a replacement (`names.py`). See docs/deepspeed-compat.md."""
