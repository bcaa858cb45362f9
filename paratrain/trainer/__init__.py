"""The built-in job behind `paratrain train` (`job.py`: the run, its metrics and report; `inputs.py`: the model,
the data and the loaders it trains on; `grpo_job.py`: the online GRPO job; `run_outputs.py`: what every job
writes around its steps)."""

from paratrain.trainer.job import train

__all__ = ["train"]
