"""Config sections of what a run writes and how it talks: monitors, experiment trackers, communication logging,
checkpoints, the trainer's outputs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from paratrain.config.section import Section
from paratrain.errors import InvalidValueError


class TensorboardConfig(Section):
    """TensorBoard events of every optimizer step (needs the tensorboard package: paratrain[monitor])."""

    enabled: bool = False
    output_path: str = ""
    """Directory that gets the job_name folder ("" = the working directory), as in DeepSpeed."""
    job_name: str = "DeepSpeedJobName"


class CsvMonitorConfig(Section):
    """One CSV file per metric (step,value), DeepSpeed's csv_monitor: output_path/job_name/Train_Samples_lr.csv."""

    enabled: bool = False
    output_path: str = ""
    """Directory that gets the job_name folder ("" = the working directory), as in DeepSpeed."""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(Section):
    """A Weights & Biases run (DeepSpeed's `wandb` keys, plus mode and dir; needs wandb: paratrain[tracking])."""

    enabled: bool = False
    team: str | None = None
    """The W&B entity (team or user) the run belongs to, as in DeepSpeed; None: your default entity."""
    group: str | None = None
    """A W&B group that gathers related runs (e.g. the runs of one sweep)."""
    project: str = "deepspeed"
    """The W&B project (DeepSpeed's default name)."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """"offline" writes the run under `dir` with no network (`wandb sync` uploads it later); None: the
    WANDB_MODE environment variable, else "online" (wandb's own default)."""
    dir: str | None = None
    """Directory that gets the `wandb/` run folders; None: the WANDB_DIR environment variable, else the
    working directory."""


class MlflowConfig(Section):
    """An MLflow run (needs mlflow: paratrain[tracking]): metrics per optimizer step, the config as params."""

    enabled: bool = False
    tracking_uri: str | None = None
    """Where runs are stored: a local path or file: URI (a file store, e.g. "file:./mlruns"), "sqlite:///x.db",
    or a tracking server's http(s) URL; None: the MLFLOW_TRACKING_URI environment variable, else mlflow's
    default."""
    experiment_name: str | None = None
    """The experiment the run goes to (created when missing); None: MLFLOW_EXPERIMENT_NAME, else "Default"."""
    run_name: str | None = None
    """The run's name in the MLflow UI; None: a generated one."""


class CommConfig(Section):
    """Collective time-outs: a collective that waits longer reports what it was waiting in and stops."""

    timeout_s: float = Field(600.0, gt=0.0)
    """Seconds a collective may wait before the job stops with a report (also the backend's own timeout)."""
    report_dir: str = ""
    """Where each stopped rank writes hang_report_rank{r}.json; empty: the run directory under
    `paratrain train`, else the current directory."""


class CheckpointConfig(Section):
    """Sharded checkpoints (docs/checkpoints.md): DeepSpeed's `checkpoint` keys, plus where and how often the
    engine saves by itself and whether a (re)started job resumes from the newest complete checkpoint."""

    dir: str | None = None
    """Directory the engine saves to every `save_every` steps and `auto_resume` loads from."""
    save_every: int = Field(0, ge=0)
    """Save after every N-th optimizer step (0: only when engine.save_checkpoint is called)."""
    auto_resume: bool = False
    """initialize() loads the newest complete checkpoint in `dir` when there is one (restarted jobs continue)."""
    keep_last: int = Field(0, ge=0)
    """After each save, delete all but the N newest complete checkpoints in the directory (0 keeps all)."""
    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    """DeepSpeed's: when ranks pass different tags to save_checkpoint, warn (and use rank 0's), fail, or ignore."""
    exclude_frozen_parameters: bool = False
    """The checkpoints the engine saves by itself (save_every, the trainer's) leave the frozen parameters out
    (DeepSpeed's save_checkpoint argument): a LoRA run stores its adapters and their state, not the base; a
    fingerprint of the base is kept, and resuming on a different base is refused."""
    async_save: bool = Field(False, validation_alias=AliasChoices("async_save", "async"))
    """Every save the engine makes stalls training only while each rank copies its share to host memory; a thread
    writes the copy on a process group of its own, one save in flight, committed by rename as a synchronous save
    (also accepted as `async`). Costs a second host copy of the rank's share until it is written; the next save, a
    load and the end of the job wait for it (docs/checkpoints.md)."""
    load_module_strict: bool = True
    """DeepSpeed's load_checkpoint argument, for auto_resume: false keeps the model's own values of the tensors the
    checkpoint lacks (a checkpoint saved without its frozen base, resumed on another base) and ignores the
    checkpoint's tensors the model does not have; true refuses both, naming them."""
    load_universal: bool = False
    """Accepted for DeepSpeed compatibility: every paratrain checkpoint loads under any layout."""
    load_weights: str | None = None
    """Model weights (not optimizer state) initialize() loads into the parallel model: a .safetensors file, a
    directory of them (a Hugging Face model directory, sharded with model.safetensors.index.json or not), or a
    paratrain checkpoint; each rank reads only the slices it keeps (docs/big-models.md)."""
    load_weights_map: dict[str, str] | None = None
    """Renames for load_weights: {name in the weights: name in the model}; other names are kept as they are."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _capitalized(cls, value: Any) -> Any:
        return value.capitalize() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _needs_dir(self) -> CheckpointConfig:
        if self.dir is None and (self.save_every or self.auto_resume):
            raise InvalidValueError("checkpoint.save_every / checkpoint.auto_resume need checkpoint.dir, the "
                                    "directory to "
                                    "save to and resume from")
        return self


class EarlyStoppingConfig(Section):
    """Stop `paratrain train` when the validation loss stops improving (needs trainer.eval_every > 0 and a
    validation set; docs/evaluation.md)."""

    patience: int = Field(3, ge=1)
    """Evaluations in a row without an improvement after which the run stops."""
    min_delta: float = Field(0.0, ge=0.0)
    """An evaluation improves when its loss is lower than the best so far by more than this."""


class SamplesConfig(Section):
    """Sample generations at each evaluation of `paratrain train` (docs/evaluation.md): the model's greedy
    answer to each prompt, in metrics.jsonl and `paratrain report`."""

    prompts: list[str | dict[str, Any]] = Field(min_length=1)
    """Records of the data format (chat: {"messages": [...]}, rendered with the chat template and its generation
    prompt; prompt_completion: {"prompt": ...}; text: {"text": ...}) or plain strings (chat: one user turn)."""
    max_new_tokens: int = Field(32, ge=1)
    """Tokens generated per prompt at most (a row stops at the tokenizer's end-of-sequence token)."""


class TrainerConfig(Section):
    """Settings of the built-in `paratrain train` job (GPT on the embedded corpus)."""

    model: str = "gpt-tiny"
    """GPT or Llama preset (gpt-tiny, gpt-mini, gpt-small, gpt-125m, ..., llama-tiny, llama-mini, llama3-8b, ...),
    or a Hugging Face model directory (config.json + safetensors, loaded with from_pretrained); `paratrain verify`
    also takes a user model as 'package.module:factory', built as factory(**model_overrides)."""
    model_overrides: dict[str, Any] = Field(default_factory=dict)
    """GPTConfig / LlamaConfig fields to replace, e.g. {"n_layer": 8}; for a Hugging Face directory only
    {"seq_len": N}, the training sequence length (default 128)."""
    text: str | None = None
    """A UTF-8 text file to train on instead of the embedded corpus (the last 10% is validation); tokenized by a
    Hugging Face directory's tokenizer, else as bytes."""
    steps: int = Field(300, ge=1)
    """Optimizer steps to train."""
    eval_every: int = Field(100, ge=0)
    """Validation loss every N steps (and at the end); 0 disables."""
    eval_batches: int = Field(4, ge=0)
    """Validation micro-batches per data-parallel rank at each evaluation; 0: every validation row (the exact
    token-weighted loss over the whole set, `engine.evaluate`)."""
    eval_at_start: bool = False
    """Also evaluate before the first step: a metrics row with step 0 and val_loss."""
    early_stopping: EarlyStoppingConfig | None = None
    """Stop when the validation loss has not improved for `patience` evaluations in a row; absent: never."""
    samples: SamplesConfig | None = None
    """Prompts the model answers at each evaluation (and at step 0 with eval_at_start); absent: none."""
    run_dir: str = "runs/latest"
    """Where config.json, metrics.jsonl/.csv and summary.json go."""
    save_pretrained: str | None = None
    """A directory the trained model is written to at the end (`engine.save_pretrained`: what transformers'
    from_pretrained loads), and every `save_pretrained_every` steps."""
    save_merged: bool = False
    """With adapters (the `peft` section, or a peft model): save_pretrained writes both the adapter in peft's format,
    in `<save_pretrained>/adapter`, and the model with every adapter folded into its base weight (what transformers
    loads alone), in `<save_pretrained>/merged`; without, the adapter alone in `<save_pretrained>`."""
    save_pretrained_every: int = Field(0, ge=0)
    """Also write save_pretrained every N steps (0: only at the end)."""
    progress_bar: bool = True
    reward_funcs: list[str] = Field(default_factory=list)
    """A grpo job's reward functions, TRL's signature `fn(prompts, completions, completion_ids, **columns)`, each
    named 'file.py:function' (relative to where the job runs) or 'package.module:function'."""
    reward_weights: list[float] | None = None
    """One weight per reward function (TRL's `reward_weights`); default 1 each."""

    @model_validator(mode="after")
    def _early_stopping_evaluates(self) -> TrainerConfig:
        if self.early_stopping is not None and not self.eval_every:
            raise InvalidValueError("trainer.early_stopping decides on validation losses, but trainer.eval_every "
                                    "is 0 (no evaluation); set trainer.eval_every to N > 0, or remove "
                                    "trainer.early_stopping")
        return self
