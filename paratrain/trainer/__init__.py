"""The built-in job behind `paratrain train` (`job.py`: the run, its metrics and report; `inputs.py`: the model,
the data and the loaders it trains on)."""

from paratrain.trainer.job import train

__all__ = ["train"]
