"""The engine: one object that trains a parallelized model (`engine.py`), set up from a config (`setup.py`), composed
of parts each built with what it uses: the forward pass (`forward_pass.py`), the objective's step
(`objective_step.py`), the token-weighted loss window (`token_loss.py`), the optimizer update (`update.py`),
checkpoints (`checkpoints.py`; values besides them: `weights.py`), evaluation (`evaluation.py`), generation
(`generation.py`), the step reporter (`monitor.py`, over the TensorBoard / CSV monitors of `monitor_files.py` and the
W&B / MLflow trackers of `trackers.py`) and the phases (`phases.py`); its train state (`train_state.py`) and
DeepSpeed's engine accessors (`deepspeed_api.py`)."""

from paratrain.engine.engine import Engine

__all__ = ["Engine"]
