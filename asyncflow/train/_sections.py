"""The sections of a run configuration (``[model]``, ``[data]``, ``[train]``,
``[actor]``, ``[critic]``, ``[reward]``, ``[cost]``, ``[pools]``, ``[placement]``,
``[env]``): typed, keyword-only msgspec Structs that check their own values on
decode. The whole :class:`~asyncflow.train.RunConfig` lives in
:mod:`asyncflow.train._config`, the checks across sections in
:mod:`asyncflow.train._validate`."""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import msgspec

from asyncflow.algos._checks import above, at_least
from channels import ConfigError
from workers.data import ArithmeticTaskConfig
from workers.episodes import MAX_TURNS_LIMIT
from workers.rewards import DEFAULT_TIMEOUT_S, split_function_spec

_CFG = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}

class ModelSection(msgspec.Struct, **_CFG):
    """Where the policy starts: a local Hugging Face causal LM directory, a GGUF
    file, or (neither) the SFT warm start's output. Nothing is downloaded."""

    path: str = ""
    """A local Hugging Face model directory (``config.json`` and safetensors or bin
    weights, with its tokenizer and chat template)."""
    gguf: str = ""
    """A GGUF file, dequantised to float32 on load (converted once into
    ``<output_dir>/model_from_gguf-<hash of its path>``, with the file's tokenizer
    and chat template)."""

    def __post_init__(self) -> None:
        if self.path and self.gguf:
            raise ConfigError("ModelSection: both path and gguf are set; keep one")


class DataSection(msgspec.Struct, **_CFG):
    """Where the prompts come from: the user's files (``source = "files"``) or the
    built-in arithmetic problems (``source = "arithmetic"``, set in
    ``[data.arithmetic]``). Each file is JSONL (or JSON), Parquet, CSV or a
    ``datasets`` ``save_to_disk`` directory; every field of a row other than the
    prompt reaches the reward function as a keyword list (``answer=[...]``)."""

    source: Literal["files", "arithmetic"] | None = None
    """``"files"`` (``train`` and ``eval``) or ``"arithmetic"`` (``arithmetic``);
    unset: ``"files"`` when ``train`` is set, else ``"arithmetic"``."""
    arithmetic: ArithmeticTaskConfig = ArithmeticTaskConfig()
    """The arithmetic source: operand digits, operators, the sizes of the train and
    held-out splits, and the seed they are drawn with (equal settings give equal
    problems)."""
    train: str = ""
    """The training prompts' file."""
    eval: str = ""
    """The held-out prompts' file, evaluated before and after RL (the first
    ``train.eval_size``)."""
    prompt: str = "prompt"
    """The prompt's field: plain text, or a list of chat messages (``[{role,
    content}]``) rendered with the tokenizer's chat template."""
    max_prompt_tokens: int = 0
    """Longer prompts are dropped (and counted in the log); 0: the model's context
    minus ``algorithm.sampling.max_new_tokens``."""

    def __post_init__(self) -> None:
        at_least("DataSection.max_prompt_tokens", self.max_prompt_tokens, 0,
                 "0 takes the model's context minus max_new_tokens")
        if self.eval and not self.train:
            raise ConfigError("DataSection: eval is set but train is not; set data.train too")
        if not self.prompt:
            raise ConfigError("DataSection.prompt must name the prompt's field, e.g. prompt = \"question\"")
        if self.source == "arithmetic" and self.train:
            raise ConfigError("DataSection: source = \"arithmetic\" but train is set; remove data.train, or set "
                              "source = \"files\"")
        if self.source == "files" and not self.train:
            raise ConfigError("DataSection: source = \"files\" needs train (and eval) set to your files")
        if self.kind == "files" and self.arithmetic != ArithmeticTaskConfig():
            raise ConfigError("DataSection: [data.arithmetic] is set but the prompts come from data.train; "
                              "remove one of them")

    @property
    def kind(self) -> Literal["files", "arithmetic"]:
        """The source the prompts come from (``source``, or what its default picks)."""
        if self.source is not None:
            return self.source
        return "files" if self.train else "arithmetic"


class TrainSection(msgspec.Struct, **_CFG):
    """The RL loop."""

    steps: int = 20
    """RL steps."""
    prompts_per_step: int = 16
    """Prompts sampled per step."""
    checkpoint_every: int = 10
    """Save a checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept."""
    eval_every: int = 0
    """Held-out evaluation every this many steps (0: before and after only)."""
    eval_size: int = 500
    """Held-out prompts evaluated (the first ones of the eval split)."""
    eval_samples: int = 0
    """Also sample this many responses per held-out prompt (at
    ``algorithm.sampling.temperature``) and log ``eval/mean@n`` and
    ``eval/pass@k`` for k = 1, 2, 4, ... up to n (0: greedy accuracy only)."""
    pass_threshold: float = 1.0
    """A sampled response counts as correct for pass@k when its reward is at least
    this (the built-in verifiers give 1.0 to a correct answer)."""
    export_hf: Literal["end", "checkpoints", "never"] = "end"
    """Write the trained policy as a Hugging Face directory (``policy`` in the run's
    directory, ``<output_dir>/version_<n>``) that
    ``AutoModelForCausalLM.from_pretrained`` and vLLM load: at the end, also with
    every checkpoint (``<checkpoint>/policy``), or never."""
    max_seconds: float = 0.0
    """Stop RL after this long (0: no limit); the run still evaluates and saves."""
    kl_metric: bool = True
    """Place a reference policy to report the actor's KL to its starting point
    (``actor/kl_to_ref``) even when no KL term is in the loss."""
    stream: bool = False
    """Stream finished samples from generation into the inference calls (GRPO and
    PPO): stages on other pools start on the first micro-batch instead of the
    whole batch. The updated model is the same as without streaming."""
    stream_micro_batch: int = 16
    """Rows per streamed micro-batch (whole prompt groups)."""
    migrate: int | Literal["auto"] = "auto"
    """Long-tail migration while streaming: move the samples still generating onto
    fewer actor ranks once at most this many remain (0: never); ``"auto"`` picks
    the threshold with the simulator from the previous step's response lengths."""
    max_staleness: int = 0
    """With a rollout role (``[placement] rollout = { pool = ... }``, generation on its
    own pool): how many steps generation may run ahead of training. Batch ``j`` is
    sampled by the actor's weights of step ``j - 1 - max_staleness`` or newer, so
    generating steps ``n+1 .. n+k`` overlaps training step ``n``; the loss corrects
    stale tokens (``algorithm.policy.off_policy``). 0: synchronous (the same
    metrics as generating on the actor)."""
    overlap_steps: bool = False
    """With a rollout role (GRPO, PPO): queue step ``m + 1``'s calls once step ``m``
    submitted its update, so that the training pool goes on to the next update
    without waiting for step ``m``'s metrics to reach the driver. The results are
    those of steps run one after the other (each pool runs its calls in the order
    they were queued). Never across an evaluation, a checkpoint, the last traced
    step, a stop request or the time budget's end. The metric
    ``async/overlapped`` is 1 on each step whose successor started before its
    metrics were back. Off by default: where both pools share the same cores, the
    rollout's generations slow down by more than the training pool's idle gap
    shrinks (the docs' benchmarks page has the figures); for pools on devices of
    their own."""
    weight_sync_bucket_mb: float = 256.0
    """With a rollout role: the actor's weights reach it in buckets of at most this
    many MiB (one ``rollout.load_weights`` call each; a larger parameter is a
    bucket of its own), so a rollout rank holds at most one bucket beside its
    weights."""
    weight_sync_timeout_s: float = 30.0
    """With a rollout role: seconds one bucket's pull may take once it runs; past
    it the run stops with an error naming the rollout rank and the actor ranks it
    pulls from (0: no limit)."""
    partial_rollout_decode_steps: int = 0
    """With a rollout role: partial rollouts. A batch's generation stops after this
    many engine steps (once each rollout rank finished a group); its unfinished
    samples go on in the next batch's generation, under the newer weights it is
    sampled by (each token's ``policy_version`` says which version sampled it,
    and the loss corrects it as it corrects stale batches), so a long response no
    longer holds up a step. A batch then holds the groups that finished in it:
    fewer or more than ``prompts_per_step``. A sample's first tokens may be up to
    ``partial_rollout_max_carries`` versions older than ``max_staleness`` allows.
    0: off (every batch is its own prompts' groups)."""
    partial_rollout: Literal["continue", "restart"] = "continue"
    """With ``partial_rollout_decode_steps``: ``continue`` a carried sample from its
    tokens so far, or ``restart`` it from its prompt under the newer weights."""
    partial_rollout_max_carries: int = 1
    """With ``partial_rollout_decode_steps``: how many batches a sample may be carried
    over to; it finishes in the last, whatever its length."""
    trace_steps: int = 0
    """Trace the first this many RL steps of the run: ``timeline.png`` (one lane per
    pool rank) and ``trace.json`` (open in ui.perfetto.dev) in the run's
    directory (0: no trace)."""

    def __post_init__(self) -> None:
        # "TrainSection.steps ... - at `$.train`" reaches the user as "train.steps ..."
        # (see load_config).
        for name in ("steps", "prompts_per_step", "eval_size", "keep_checkpoints", "partial_rollout_max_carries"):
            at_least(f"TrainSection.{name}", getattr(self, name), 1)
        for name in ("checkpoint_every", "eval_every", "trace_steps", "eval_samples", "max_staleness",
                     "partial_rollout_decode_steps"):
            at_least(f"TrainSection.{name}", getattr(self, name), 0, "0 turns it off")
        at_least("TrainSection.max_seconds", self.max_seconds, 0, "0 means no limit")
        if not self.weight_sync_bucket_mb > 0:
            raise ConfigError(f"TrainSection.weight_sync_bucket_mb must be > 0, got {self.weight_sync_bucket_mb}")
        at_least("TrainSection.weight_sync_timeout_s", self.weight_sync_timeout_s, 0, "0 means no limit")
        at_least("TrainSection.stream_micro_batch", self.stream_micro_batch, 1)
        if self.migrate != "auto":
            at_least("TrainSection.migrate", self.migrate, 0, '0 turns it off; "auto" picks it')


class OptimSection(msgspec.Struct, **_CFG):
    """A trained role's optimizer and update schedule."""

    lr: float = 1e-5
    """Peak AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up (optimizer steps)."""
    micro_batch_size: int = 64
    """Rows per forward/backward pass (gradients accumulate over micro-batches); rows of
    similar length go together, so a pass pads little."""
    epochs: int = 1
    """Passes over each step's batch."""
    mini_batches: int = 1
    """Optimizer steps per pass."""
    engine: Literal["native", "megatron"] = "native"
    """The training engine: ``"native"`` (PyTorch FSDP2 and DTensor tensor
    parallelism; CPU or GPU) or ``"megatron"`` (Megatron-core's layers over the same
    placement: GPUs, ``pip install 'megatron-core>=0.16'``, Llama/Qwen2 models, no
    pipeline stages, no generation layout). The reference policy runs on the actor's
    engine."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """``"bf16"``: bfloat16 compute with float32 master weights, optimizer state and
    gradient reduction (log-probs and losses stay float32); ``"fp32"``: float32
    throughout; ``"auto"``: bf16 on a GPU, fp32 on the CPU. The actor's setting also
    sets its rollout engine's dtype and the reference's and reward model's
    inference dtype."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in backward instead of keeping its
    activations: far less activation memory for about a third more compute."""
    pipeline_chunks: int = 1
    """With pipeline stages (the placement's ``p`` above 1), model pieces per stage:
    1 runs 1F1B, more runs interleaved 1F1B (a shorter pipeline fill and drain for
    more messages). The model needs at least ``p * pipeline_chunks`` layers."""

    def __post_init__(self) -> None:
        key = type(self).__name__  # the section's own name; load_config says which one
        above(f"{key}.lr", self.lr, 0, "use a learning rate such as 1e-5")
        at_least(f"{key}.weight_decay", self.weight_decay, 0, "0 turns weight decay off")
        at_least(f"{key}.grad_clip", self.grad_clip, 0, "0 turns gradient clipping off; 1.0 is usual")
        at_least(f"{key}.warmup_steps", self.warmup_steps, 0, "0 turns the warm-up off")
        for name in ("micro_batch_size", "epochs", "mini_batches", "pipeline_chunks"):
            at_least(f"{key}.{name}", getattr(self, name), 1)


class ActorSection(OptimSection, **_CFG):
    """The policy."""

    rollout_engine: Literal["native", "vllm"] = "native"
    """Which engine generates: the native one or vLLM."""
    rollout_batch_size: int | None = None
    """Most sequences the native engine decodes at once; None: all of a request's
    samples in one batch."""
    offload_optimizer: bool = False
    """While the actor generates, keep its optimizer state in host memory (pinned on
    a GPU), leaving that device memory to generation; it returns for the update."""
    offload_params: bool = False
    """While the actor generates, keep its training parameters (and gradients) in
    host memory too (the rollout engine samples from its own copy)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rollout_batch_size is not None:
            at_least("ActorSection.rollout_batch_size", self.rollout_batch_size, 1)


class WeightedFunction(msgspec.Struct, **_CFG):
    """One reward function of a weighted sum (``[reward] functions``)."""

    function: str
    """``module:function`` (see ``ScoreSection.function`` for the call forms)."""
    weight: float = 1.0
    """Its weight in the sum (any finite number; negative penalizes)."""


class ScoreSection(msgspec.Struct, **_CFG):
    """A reward (or cost) source: a rule function, a weighted sum of them, or a model.

    One function: ``function = "module:fn"``. Several: ``functions = [{ function =
    "workers.rewards:numeric_match", weight = 1.0 }, { function =
    "workers.rewards:format_check", weight = 0.2 }]``; the score is the weighted sum
    and each function's mean is logged as ``reward/<fn>/mean``.
    """

    DEFAULT_FUNCTION: ClassVar[str] = "workers.rewards:arithmetic_reward"

    function: str = DEFAULT_FUNCTION
    """``module:function``, called as ``fn(prompts=, completions=, **columns)`` (TRL's
    form) or ``fn(prompts, responses, answers)`` (see ``workers.rewards``)."""
    functions: list[WeightedFunction] = msgspec.field(default_factory=list)
    """Several weighted functions; when given, they score instead of ``function``."""
    model_dir: str = ""
    """A reward/value model directory; when set, it scores instead of ``function``."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Seconds one call of a reward function may take on a rank's samples; past it the
    run stops with an error naming the function and the samples (one that hangs: code
    it runs that never ends, a request never answered). 0 means no limit."""

    def __post_init__(self) -> None:
        at_least("ScoreSection.timeout_s", self.timeout_s, 0, "0 means no limit")
        if self.function:  # imported by validate, for the roles the run needs
            split_function_spec(self.function, key="ScoreSection.function")
        if self.functions and self.function not in ("", self.DEFAULT_FUNCTION):
            raise ConfigError(f"ScoreSection: both function = {self.function!r} and functions are set; "
                              "keep one (put the function in the functions list)")
        for i, wf in enumerate(self.functions):
            split_function_spec(wf.function, key=f"ScoreSection.functions[{i}].function")
            if not math.isfinite(wf.weight):
                raise ConfigError(f"ScoreSection.functions[{i}].weight must be a finite number, got {wf.weight}")

    @property
    def weighted(self) -> list[WeightedFunction]:
        """The functions with their weights: ``functions``, or ``function`` with weight 1."""
        if self.functions:
            return list(self.functions)
        return [WeightedFunction(function=self.function)] if self.function else []


class PoolSection(msgspec.Struct, **_CFG):
    """A resource pool."""

    devices: int = 1
    """Devices (worker processes); checked in :func:`validate`, which knows the pool's name."""
    threads: int | None = None
    """torch threads per worker process; None: ``OMP_NUM_THREADS`` if set, else the
    cores divided among all pools' workers (``asyncflow.ResourcePool.threads``)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """What a device of the pool is: a GPU (``"cuda"``), a CPU slot (``"cpu"``), or
    ``"auto"``: GPUs when the Ray cluster has any. Every pool of a run uses one kind."""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    """Node labels the pool's nodes must have, e.g. ``{ role = "trainer" }`` for
    nodes started with ``ray start --labels role=trainer`` (``ResourcePool.labels``);
    empty: any node with free devices."""


class GenSection(msgspec.Struct, **_CFG):
    """The actor's generation layout (the hybrid engine): ``gen = { t = 1 }``."""

    t: int = 1
    """Generation tensor-parallel size; must divide the placement's ``t``."""
    p: int = 1
    """Generation pipeline-parallel size; only 1."""
    grouping: Literal["hybridflow", "vanilla"] = "hybridflow"
    """How generation groups take the training ranks (``vanilla``: a baseline)."""


class PlacementSection(msgspec.Struct, **_CFG):
    """Where a role runs and its parallel layout."""

    pool: str
    """The pool's name (a key of ``[pools]``)."""
    p: int = 1
    """Pipeline-parallel size: the actor, critic and reference on the native engine
    split their decoder layers over ``p`` stages (1F1B, or interleaved with the
    role's ``pipeline_chunks``); 1 for the other roles."""
    t: int = 1
    """Tensor-parallel size."""
    gen: GenSection | None = None
    """The actor only: its generation layout. Unset, every actor rank generates
    with a full copy of the weights, refreshed after every update (or, where the
    rank trains the whole model in the rollout's dtype, as on the CPU, from the
    training parameters themselves); set, the hybrid engine reshards the training
    shards into generation shards for each generation (native rollout engine; the
    actor's data-parallel ranks then keep whole tensor-parallel shards)."""


class EnvSection(msgspec.Struct, **_CFG):
    """Multi-turn episodes: each sample is an episode with an environment (see
    ``workers.episodes``). The sampling settings' ``max_new_tokens`` is a turn's
    budget; the reward is the episode's (``workers.episodes:episode_reward``) unless
    ``[reward]`` names another function."""

    cls: str = msgspec.field(name="class", default="")
    """The environment class, ``"module:Class"`` (a module beside the config works):
    ``reset(row) -> observation`` and ``step(action) -> (observation, reward,
    done)``, ``async`` or not; ``"workers.episodes:ToolEnv"`` makes functions tools."""
    settings: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword arguments of the class (one environment per episode)."""
    max_turns: int = 4
    """Most turns of the model in an episode."""
    max_tokens: int = 256
    """An episode's tokens after the prompt, turns and observations together."""
    timeout_s: float = 60.0
    """Longest an environment call may take."""
    on_error: Literal["end", "fail"] = "end"
    """An environment that raises or times out ends its episode with reward 0
    (``"end"``) or the run (``"fail"``)."""
    format: Literal["auto", "chat", "text"] = "auto"
    """How observations are wrapped: the chat template's (``"chat"``) or
    ``text_template`` (``"text"``); ``"auto"``: chat when the model has a template."""
    observation_role: str = "tool"
    """The chat role of observations."""
    text_template: str = "{observation}"
    """An observation's text in the text format."""
    stop: list[str] = msgspec.field(default_factory=list)
    """More stop strings that end a turn (e.g. ``"</tool_call>"``)."""

    def __post_init__(self) -> None:
        if self.cls:  # required: validate says so when it is missing
            split_function_spec(self.cls, key="[env] class", form="module:Class", example="workers.episodes:ToolEnv")
        at_least("[env] max_turns", self.max_turns, 1)
        if "{observation}" not in self.text_template:  # else the workers find it, once they are up
            raise ConfigError(f"[env] text_template = {self.text_template!r} has no '{{observation}}' to fill in")
        if self.max_turns > MAX_TURNS_LIMIT:
            raise ConfigError(f"[env] max_turns must be at most {MAX_TURNS_LIMIT}, got {self.max_turns}")
        at_least("[env] max_tokens", self.max_tokens, 1)
        above("[env] timeout_s", self.timeout_s, 0)
