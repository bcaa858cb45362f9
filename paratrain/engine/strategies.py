"""Cut each strategy's settings out of a resolved config: the one place where the whole `Config` meets the
strategy layer (`paratrain.parallel` never imports it: an import-linter contract)."""

from __future__ import annotations

from paratrain.config import Config
from paratrain.parallel.pp.schedules import partial_backwards
from paratrain.parallel.settings import DataParallelSettings, PipelineSettings, Strategies, TensorParallelSettings


def strategies_of(config: Config) -> Strategies:
    """The settings `parallelize` hands each step, from the config's sections."""
    pp = config.pipeline
    return Strategies(
        tensor=TensorParallelSettings(config.tensor_parallel, config.seed),
        expert_parallel_size=config.expert_parallel.size,
        pipeline=PipelineSettings(pp, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps,
                                  token_loss=config.loss.reduction == "token"),
        context=config.context_parallel,
        recompute=config.activation_checkpointing,
        data=DataParallelSettings(config.data_parallel, config.zero_optimization, config.precision,
                                  config.prescale_gradients, config.gradient_predivide_factor,
                                  partial_backwards=partial_backwards(pp.schedule, pp.stages, pp.virtual_stages)),
        autocast=config.torch_autocast.enabled,
    )
