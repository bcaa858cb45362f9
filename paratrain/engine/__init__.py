"""The engine: one object that trains a parallelized model (`engine.py`), set up from a config (`setup.py`),
with its optimizer update (`update.py`), token-weighted loss window (`token_loss.py`), whole pipeline steps
(`pipeline_steps.py`), checkpoints (`checkpoints.py`), train state (`train_state.py`), step reporter
(`monitor.py`, over the TensorBoard / CSV monitors of `monitor_files.py` and the W&B / MLflow trackers of
`trackers.py`) and DeepSpeed's engine accessors (`deepspeed_api.py`)."""

from paratrain.engine.engine import Engine

__all__ = ["Engine"]
