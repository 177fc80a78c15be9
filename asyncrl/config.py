"""One typed config tree for every role, loaded from YAML and overridden by dotted `key=value` pairs.

Every section is a pydantic model: its fields' types, choices and declared ranges are checked at load,
a `key=value` override is read by its field's type, and `config_schema()` is the tree's JSON Schema.
Unknown keys and values of the wrong type fail at start with the dotted path, the closest valid key
and the fix; cross-field checks live in `Config.validate`. Only pydantic and PyYAML are imported here,
so every entry point can parse its config before importing torch or vLLM.
"""

from __future__ import annotations

import difflib
import logging
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

REPO_CONFIGS = Path(__file__).resolve().parent.parent / "configs"  # the checkout's configs
# The shipped configs are package data (pyproject's package-data; in the checkout asyncrl/configs is a
# link to configs/), so an installed wheel finds them by name from any directory, as a checkout does.
PACKAGED_CONFIGS = Path(str(resources.files("asyncrl") / "configs"))
DEFAULT_CONFIG = PACKAGED_CONFIGS / "tiny.yaml"

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A user mistake in the config: the message names the dotted path and the fix."""


# Bounds declared on the fields, `lr: Annotated[float, Positive] = 5e-4`: pydantic checks them at load
# (YAML, overrides and assignments alike) and writes them into the JSON Schema.
Positive = Field(gt=0)
NonNegative = Field(ge=0)
AtLeastOne = Field(ge=1)
Fraction = Field(ge=0, le=1)
Port = Field(ge=0, le=65535)


class Section(BaseModel):
    """A node of the tree: unknown keys refused, assignments validated, each field's docstring its
    description in the schema. Values from YAML are checked strictly (an integer field takes an
    integer, not 2.0 or "2"; a boolean takes true/false), but a number in a text field is its text
    and a comma-separated string in a list field is its items."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              protected_namespaces=())

    @field_validator("*", mode="before")
    @classmethod
    def _yaml_scalar(cls, value: Any, info) -> Any:
        tp = cls.model_fields[info.field_name].annotation
        if tp is str and isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)  # `name: 7` in YAML is the name "7"
        if typing.get_origin(tp) is list and isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]  # `backends: jsonl,wandb`
        return value


class RunConfig(Section):
    name: str = "tiny"
    dir: str = "runs"
    """the run directory is {dir}/{name}"""
    max_steps: Annotated[int, AtLeastOne] = 20
    seed: int = 0
    mode: Literal["async", "sync"] = "async"
    """sync: the lockstep baseline (asyncrl/modes.py)"""
    resume: bool = False
    """Continue the run of this name: the launcher keeps its Redis state (and, with checkpoints, the learner
    resumes); a role started by hand continues a finished run instead of refusing it (asyncrl/protocol/identity.py)"""
    reset: bool = False
    """A role started by hand that finds a finished or foreign run of this name in Redis clears its keys and
    starts afresh instead of refusing (a live run is always joined)"""
    stall_timeout_s: Annotated[float, NonNegative] = 300.0
    """No trajectory, step or sync for this long is a stall, reported by the launcher's watchdog and by each
    role's own check (also for roles started by hand). 0: off."""
    on_stall: Literal["warn", "fail"] = "warn"
    """fail: the launcher stops the run with exit code 3"""
    affinity: Literal["auto", "off"] = "auto"
    """CPU affinity when no role's `cpus` is set. auto: on a machine of at most 4 CPUs the launcher pins the
    roles apart (asyncrl/launch/affinity.py); off: never pins unless a role's `cpus` says so."""
    purpose: str = ""
    """What a run of this config shows, in a sentence; `asyncrl run` prints it at its start and its end
    (the CPU configs of real models say there that they check the path, not learning)"""


class TinyModelConfig(Section):
    """The tiny Qwen2-architecture model written when model.path is empty (asyncrl/tools/tiny_model.py)."""

    warm_start_steps: int = 30
    """supervised warm start of the tiny model (format only, see tiny_model.py)"""
    warm_start_lr: float = 3e-3
    """larger shapes want less (the gpu-copy benchmark preset: 1e-3)"""
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 0
    """0: hidden_size // 64, i.e. head dimension 64 (what vLLM's CPU attention takes)"""
    num_kv_heads: int = 1
    intermediate_size: int = 0
    """0: 2 * hidden_size"""

    def shape(self) -> dict:
        """The shape as keyword arguments of asyncrl.tools.tiny_model.write_tiny_model."""
        heads = self.num_heads or self.hidden_size // 64
        return {"hidden_size": self.hidden_size, "num_layers": self.num_layers, "num_heads": heads,
                "num_kv_heads": self.num_kv_heads, "intermediate_size": self.intermediate_size or 2 * self.hidden_size}

    def shape_ok(self) -> bool:
        heads = self.shape()["num_heads"]
        return (self.hidden_size > 0 and self.num_layers > 0 and heads > 0 and self.num_kv_heads > 0
                and self.intermediate_size >= 0 and self.hidden_size % (self.num_heads or 64) == 0
                and heads % self.num_kv_heads == 0)


class ModelConfig(Section):
    path: str = ""
    """A Hugging Face model directory or hub name. Empty: a tiny model is written to {run_dir}/tiny-model."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """the tiny model's shape and warm start (model.path empty)"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class DataConfig(Section):
    task: str = "copy"
    """a built-in task (copy, arith, gsm8k, prompts; asyncrl/tasks/registry.py) or a task of your own,
    `my_pkg.my_tasks:TASK` (a module-level asyncrl.Task every role imports; asyncrl.register_task)"""
    num_prompts: Annotated[int, AtLeastOne] = 1024
    """copy and arith tasks: training prompts drawn from run.seed"""
    alphabet: str = "abcdefgh"
    min_len: Annotated[int, AtLeastOne] = 2
    max_len: Annotated[int, AtLeastOne] = 4
    arith_ops: str = "+-"
    """arith (asyncrl/tasks/arith.py): `a OP b`, OP from these, operands of min..max digits, asked in this prompt."""
    arith_min_digits: Annotated[int, Field(ge=1, le=9)] = 2
    arith_max_digits: Annotated[int, Field(ge=1, le=9)] = 2
    arith_nonnegative: bool = False
    """a - b with a >= b (operands swapped where needed)"""
    arith_prompt: str = "What is {a} {op} {b}? Answer with the number only."
    path: str = ""
    """gsm8k / prompts: a parquet or jsonl file (`asyncrl data gsm8k` writes train/test parquet)."""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    id_key: str = ""
    """empty: rows are named {file stem}-{row index}"""
    max_prompt_chars: Annotated[int, NonNegative] = 0
    """> 0: rows with longer prompts are skipped (tiny-model runs)"""
    chat_template: bool = False
    """apply the tokenizer's chat template (plain text when it has none)"""


def _reward_names() -> Any:
    """The Literal of `reward.name`: the built-in tasks' rewards (asyncrl/tasks/registry.py) and the others."""
    from asyncrl.tasks.registry import GENERIC_REWARDS, task_rewards

    return Literal[(*task_rewards(), *GENERIC_REWARDS)]


RewardName = _reward_names()


class RewardConfig(Section):
    name: RewardName = "copy"
    """each built-in task's reward under its name, and math, exact_match, format (asyncrl/tasks/rewards.py)"""
    function: str = ""
    """A user function `my_pkg.mod:score`, called score(completion, answer, **row) -> float; replaces `name`."""
    model: str = ""
    """A Hugging Face sequence-classification model (num_labels=1) scoring prompt+completion, one batch
    per group; replaces `name`."""
    model_batch_size: Annotated[int, AtLeastOne] = 16
    format_regex: str = r"^\s*\S.*$"
    """reward.name=format: 1.0 when the completion matches (re.DOTALL)"""
    extract: Literal["auto", "hash", "boxed", "last_number"] = "auto"
    """math rewards: see math_reward.py"""
    format_bonus: float = 0.0
    """math rewards: score of a well-formatted but wrong answer"""
    math_verify: bool = True
    """math rewards: use math-verify for non-numeric answers when installed"""
    workers: Annotated[int, AtLeastOne] = 4
    """threads a generator scores groups on, off its event loop"""


class EvalConfig(Section):
    every: Annotated[int, NonNegative] = 0
    """learner steps between evaluation rounds; 0: no evaluation"""
    num_prompts: Annotated[int, AtLeastOne] = 64
    """the first rows of the held-out set"""
    k: Annotated[int, NonNegative] = 4
    """samples per prompt at generator.temperature for mean@k; 0: greedy only"""
    path: str = ""
    """empty: the test split beside data.path (train -> test in the file name)"""
    timeout_s: Annotated[float, Positive] = 600.0
    """a round not complete by then is logged as incomplete and dropped"""
    before_train: bool = True
    """also evaluate the starting weights (version 0) when the learner starts"""
    show: Annotated[int, NonNegative] = 8
    """the first this many held-out prompts also have their greedy answer's text kept, each round, in
    {run_dir}/eval_samples.jsonl (what `asyncrl report` shows before and after training); 0: none"""


class EnvConfig(Section):
    """Multi-turn episodes (docs/agentic.md): what bounds an episode of a task with an environment
    (data.task=calc, guess, gsm8k_python, or a task of your own with one). Unused by single-turn tasks."""

    max_turns: Annotated[int, AtLeastOne] = 4
    """assistant turns per episode; the episode ends (end reason `max_turns`) after this many"""
    max_tokens: Annotated[int, NonNegative] = 0
    """tokens of an episode after its prompt (assistant and observation turns); 0: up to
    generator.max_model_len. Each assistant turn is also bounded by generator.max_tokens."""
    step_timeout_s: Annotated[float, Positive] = 10.0
    """seconds an environment may take for one step; past it the episode ends (`env_timeout`)"""
    max_observation_chars: Annotated[int, AtLeastOne] = 512
    """an observation longer than this is cut (and says so)"""
    system_prompt: str = ""
    """replaces the environment's own system prompt (which teaches its tool format); empty: keep it"""
    examples: Annotated[int, Field(ge=-1)] = -1
    """how many of the environment's worked exchanges (`Environment.examples`) open each episode, between
    the system prompt and the first user message; -1: all it has, 0: none"""
    tools: bool = True
    """false: a tool environment (calc, gsm8k_python) offers no tool: its system prompt asks for the answer
    alone and every turn is read as the final answer, a tool call included (what the policy does unaided)"""
    guess_max: Annotated[int, Field(ge=2)] = 16
    """data.task=guess: the secret number is in 1..guess_max"""
    calc_digits: str = "3x2"
    """data.task=calc: operand digits of the multiplications, `AxB`"""
    sandbox_cpu_s: Annotated[int, AtLeastOne] = 2
    """data.task=gsm8k_python: CPU seconds of one Python run (RLIMIT_CPU)"""
    sandbox_memory_mb: Annotated[int, Field(ge=32)] = 512
    """address space of one Python run (RLIMIT_AS)"""
    sandbox_output_bytes: Annotated[int, AtLeastOne] = 4096
    """stdout and stderr kept of one Python run (the rest is cut, and the run ended)"""
    sandbox_timeout_s: Annotated[float, Positive] = 5.0
    """wall-clock seconds of one Python run before its process group is killed"""


def parse_cpus(text: str) -> tuple[int, ...]:
    """A `cpus` value: '0-3,8' -> (0, 1, 2, 3, 8); '' -> (). Raises ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{part!r} is not a CPU number or range")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"range {part!r} is reversed")
        cpus.update(range(first, last + 1))
    if text.strip() and not cpus:
        raise ValueError(f"{text!r} names no CPU")
    return tuple(sorted(cpus))


class GeneratorConfig(Section):
    num_generators: Annotated[int, NonNegative] = 1
    """launcher only: how many generator processes `asyncrl run` starts"""
    backend: Literal["vllm", "hf"] = "vllm"
    n: Annotated[int, AtLeastOne] = 8
    """samples per prompt: one GRPO group"""
    max_tokens: Annotated[int, AtLeastOne] = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_concurrent_groups: Annotated[int, AtLeastOne] = 16
    """prompts leased and in flight at once"""
    heartbeat_s: Annotated[float, Positive] = 1.0
    heartbeat_ttl_s: Annotated[float, Positive] = 10.0
    # vLLM engine settings, passed through.
    max_model_len: Annotated[int, AtLeastOne] = 128
    dtype: str = "auto"
    """vLLM's compute dtype; auto: vLLM's choice (bf16 for a float32 model), except float32 on an x86 CPU
    without bf16 instructions, which would emulate bf16 several times slower"""
    enforce_eager: bool = True
    torch_compile: bool = True
    """with enforce_eager=false, whether vLLM compiles the model (torch.compile, piecewise CUDA graphs);
    false: no compile, full CUDA graphs for decode steps only (vLLM's compilation mode NONE): the engine
    starts without the compile, at some cost in generation speed"""
    engine_start: Literal["auto", "spawn", "fork"] = "auto"
    """How vLLM starts its engine core process. spawn: a fresh interpreter, which imports torch and vLLM
    a second time; fork: a copy of the generator process, which has imported both already and never
    initialised CUDA (vLLM itself falls back to spawn if CUDA was initialised). auto: on CUDA,
    VLLM_WORKER_MULTIPROC_METHOD where it is set, else spawn; on CPU, fork in an `asyncrl generator`
    process with one worker that did not write the tiny model itself (it has run no torch computation,
    so no OpenMP threads, whose fork would hang), else spawn. spawn and fork override that variable."""
    vllm_kwargs: dict[str, Any] = {}
    """more vLLM engine arguments (`AsyncEngineArgs`), applied last, e.g.
    `{kernel_config: {enable_flashinfer_autotune: false}}`; not the ones the generator relies on
    (model, logprobs_mode, worker_extension_cls)"""

    @field_validator("vllm_kwargs")
    @classmethod
    def _engine_args_of_its_own(cls, value: dict[str, Any]) -> dict[str, Any]:
        if taken := sorted(set(value) & {"model", "logprobs_mode", "worker_extension_cls"}):
            raise ValueError(f"{', '.join(taken)}: set by the generator itself")
        return value
    enable_prefix_caching: bool = True
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.5
    tensor_parallel_size: Annotated[int, AtLeastOne] = 1
    max_num_seqs: Annotated[int, NonNegative] = 0
    """sequences vLLM runs in one engine step; 0: vLLM's defaults for offline batch inference on this
    device (1024 on a CUDA GPU of 70 GB or more other than an A100, 256 on other GPUs and per rank
    on the CPU), not its engine default of 128, which runs the samples in flight in waves (32
    prompts x 8 samples are 256 sequences)"""
    max_num_batched_tokens: Annotated[int, NonNegative] = 0
    """tokens vLLM schedules in one engine step; 0: vLLM's defaults for offline batch inference on
    this device (16384 on a CUDA GPU of 70 GB or more other than an A100, 8192 on other GPUs, 4096
    per rank on the CPU)"""
    kv_cache_gb: Annotated[float, Positive] = 1.0
    """CPU build only: VLLM_CPU_KVCACHE_SPACE"""
    kv_cache_memory_gb: Annotated[float, NonNegative] = 0.0
    """CUDA: the KV cache's size in GiB, set instead of measured (vLLM's kv_cache_memory_bytes: no
    memory profile, which other processes allocating on the GPU meanwhile would mislead, as when
    several runs start on one GPU); 0: what gpu_memory_utilization leaves after vLLM's profile"""
    sleep: Literal["auto", "on", "off"] = "auto"
    """run.mode=sync on CUDA: put the vLLM engine to sleep (`sleep_level`) while the learner steps,
    so that the learner may use the engine's memory; it wakes for the next weights. auto: on once a
    weight push shows the learner on this engine's GPU (weights.backend=ipc from the same device);
    on: whenever the engine idles in sync mode; off: never. Ignored in async mode and on CPU."""
    sleep_level: Literal[1, 2] = 1
    """1: weights offloaded to host memory and the KV cache freed; 2: both freed (the next push
    overwrites every weight; vLLM keeps the model's buffers)"""
    cpu_threads: Annotated[int, AtLeastOne] = 1
    """CPU build only: OMP threads per engine"""
    cpus: str = ""
    """CPU list this role's processes run on ("0", "0-3,8"); empty: no pinning (asyncrl/launch/affinity.py)"""
    drain_timeout_s: Annotated[float, NonNegative] = 120.0
    """SIGTERM: in-flight groups not done by then are handed back to the buffer"""


class BufferConfig(Section):
    redis_url: str = ""
    """empty: `asyncrl run` starts a local redis-server on a free port"""
    bind_host: str = "127.0.0.1"
    ingest_port: Annotated[int, Port] = 0
    """0: a free port, published in Redis for generators to find"""
    capacity: Annotated[int, AtLeastOne] = 4096
    """undelivered trajectory groups; past it ingest stops pulling (backpressure)"""
    lease_timeout_s: Annotated[float, Positive] = 60.0
    """a leased prompt not finished by then is handed to another generator"""
    max_frame_bytes: Annotated[int, AtLeastOne] = 16 * 1024 * 1024
    check_released: bool = True
    """Refuse groups whose group id the buffer never released (buffers/service.py `check_run`). Off
    only for tests and benchmarks that push synthetic groups straight to the ingest socket."""
    appendfsync: Literal["always", "everysec", "no"] = "everysec"
    prompt_backlog: Annotated[int, AtLeastOne] = 64
    """released-but-unleased prompts kept in the stream at most"""
    redis_retry_s: Annotated[float, Positive] = 600.0
    """every role retries a lost Redis (restart) this long before failing"""
    drain_timeout_s: Annotated[float, Positive] = 10.0
    """SIGTERM: the buffer is gone by then, Redis up or down"""
    retain_trained_s: Annotated[float, NonNegative] = 3600.0
    """trained (acked) trajectory groups older than this leave the trajectories stream, so Redis
    memory stays flat on long runs (`asyncrl inspect` reads the newest); 0 keeps every group"""
    sampling: Literal["fifo", "newest", "replay"] = "fifo"
    """How the learner picks groups (learners/reader.py): oldest first; newest first within the
    staleness bound; or each group reused up to `replay_ratio` times within the staleness bound."""
    replay_ratio: Annotated[int, AtLeastOne] = 1
    cpus: str = ""
    """CPU list of the buffer (and the launcher's local redis-server); empty: no pinning"""


class MixedPrecisionConfig(Section):
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"


QWEN2_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    """LoRA adapters through peft (learners/lora.py); generators always receive merged full weights."""

    enabled: bool = False
    rank: Annotated[int, AtLeastOne] = 8
    alpha: Annotated[float, Positive] = 16.0
    """scale = alpha / rank"""
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """> 0 makes pi_prox (no-grad pass) and pi_theta differ by dropout noise"""
    target_modules: list[str] = Field(default_factory=lambda: list(QWEN2_LORA_TARGETS))
    """Module names (suffixes) that get adapters; default: the attention and MLP projections of Qwen2."""


class LearnerConfig(Section):
    nproc: Annotated[int, AtLeastOne] = 1
    """torchrun ranks (FSDP2)"""
    param_offload: bool = False
    """FSDP2 CPUOffloadPolicy: parameters, gradients and optimizer state on CPU"""
    optimizer_offload: bool = False
    """FSDP2 offloads optimizer state only together with parameters"""
    reshard_after_forward: bool | Literal["auto"] = "auto"
    """FSDP2 frees each layer's gathered compute-dtype parameters after its forward (and gathers them
    again for the backward). auto: true with several ranks, false on one (nothing is sharded there;
    keeping them saves a cast per layer and step at the memory of one compute-dtype copy)."""
    shard_layers: bool | Literal["auto"] = "auto"
    """false: one FSDP2 unit for the whole model instead of one per decoder layer: far fewer hooks and
    collectives per step, for one GPU (nothing to overlap there) with memory for all the gradients.
    auto: true with several ranks, false on one."""
    mixed_precision: MixedPrecisionConfig = Field(default_factory=MixedPrecisionConfig)
    activation_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute each decoder layer's activations in the backward instead of keeping them. auto: on
    only where the micro-batch that fits without it would be shorter than learner.micro_batch_tokens
    asks, or (micro_batch_tokens=0) than 4096 tokens or generator.max_model_len (learners/packing.py)."""
    compile: bool | Literal["auto"] = False
    """torch.compile each decoder layer's forward (in place: parameter names do not change). auto: on
    CUDA for models of at least 0.4B parameters, not yet the default (measured in the benchmark, not in
    a whole run) (1.5B on an H100: 9.8 s a step against 12.8 s at
    8192-token micro-batches; the first step pays ~16 s of compilation, the warm-up step takes it while
    the generators start, and the inductor cache under ~/.cache/asyncrl/inductor keeps it for later runs)."""
    peak_tflops: Annotated[float, NonNegative] = 0.0
    """The device's peak TFLOP/s that the `mfu` metric divides by; 0: a bf16 8192^3 matmul measured once
    per device name at start-up and cached in ~/.cache/asyncrl/peak_flops.json (fp32 on a CPU)."""
    kernel_warmup: Literal["auto", "on", "off"] = "auto"
    """One step on synthetic groups of the run's shape before the first batch, with every learning
    rate at 0 and the optimizer state emptied after it (learners/warmup.py): the first step's kernel
    selection, autotuning and allocations happen while the generators' engines start. auto: on CUDA,
    on a fresh start (never after a resume). On a GPU it shares with a vLLM engine that measures its
    KV cache (generator.kv_cache_memory_gb=0), a warm-up step that overlaps the engine's memory
    profile makes that cache smaller by what the step holds (the memory is handed back after it): set
    generator.kv_cache_memory_gb, or off, where the two starts coincide."""
    keep_logits_gb: Annotated[float, NonNegative] = 4.0
    """Keep the output head's logits (matmul dtype) for the backward instead of recomputing them, when
    all of one micro-batch's completion-token logits fit in this many GiB (0: always recompute)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: Annotated[int, NonNegative] = 0
    min_lr_ratio: Annotated[float, Fraction] = 0.0
    """cosine floor as a fraction of lr"""
    lr: Annotated[float, Positive] = 5e-4
    weight_decay: Annotated[float, NonNegative] = 0.0
    batch_groups: Annotated[int, AtLeastOne] = 8
    """prompt groups a learner step consumes"""
    ppo_epochs: Annotated[int, AtLeastOne] = 1
    """passes over the step's groups"""
    minibatches: Annotated[int, AtLeastOne] = 1
    """Disjoint mini-batches of whole groups per epoch, one optimizer step each (reshuffled every epoch)."""
    micro_batch_tokens: Annotated[int, NonNegative] = 0
    """Tokens (prompt + completion) one micro-batch may hold on one rank; gradients accumulate over the
    micro-batches of a mini-batch. 0: chosen from the model size and device memory (learners/packing.py)."""
    packing: bool = True
    """A micro-batch's sequences in one row, attention kept inside each sequence (no FLOPs on padding)."""
    max_grad_norm: Annotated[float, Positive] = 1.0
    poll_s: Annotated[float, Positive] = 0.5
    """how long rank 0 blocks on Redis before re-checking membership"""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    critic_path: str = ""
    """algorithm.advantage=gae: the value model (learners/critic.py), a full-parameter decoder + value head.
    empty: model.path"""
    critic_lr: Annotated[float, Positive] = 1e-4
    cpus: str = ""
    """CPU list of the learner's ranks (torch threads = CPUs / nproc); empty: no pinning"""


def _registered(family: str) -> Any:
    """The Literal of a registry's names (asyncrl/registry.py), read without importing torch."""
    from asyncrl import registry

    return Literal[getattr(registry, family).names()]


AdvantageName = _registered("ADVANTAGES")
PolicyLossName = _registered("POLICY_LOSSES")
KLEstimatorName = _registered("KL_ESTIMATORS")
AggregationName = _registered("AGGREGATIONS")
RolloutRSName = _registered("ROLLOUT_CORRECTIONS")


# The settings of single losses (algorithm.loss), one section each: algorithm.{mis,sapo,cov,dppo,dro}.


class MisConfig(Section):
    """loss=mis (masked IS): tokens with pi/mu outside [low, high] are dropped"""

    low: Annotated[float, Positive] = 0.5
    high: float = 2.0


class SapoConfig(Section):
    """loss=sapo: the soft gate's temperatures"""

    tau_pos: Annotated[float, Positive] = 1.0
    """gate temperature for A > 0"""
    tau_neg: Annotated[float, Positive] = 1.05
    """gate temperature for A <= 0"""


class CovConfig(Section):
    """loss=clip_cov / kl_cov: the high-covariance tokens they act on"""

    ratio: Annotated[float, Field(gt=0, le=1)] = 0.0002
    """fraction of tokens picked"""
    lb: float = 1.0
    """loss=clip_cov: covariance band (lb, ub) of the tokens that may be detached"""
    ub: float = 5.0
    kl_coef: Annotated[float, NonNegative] = 1.0
    """loss=kl_cov: weight of |log r| on the picked tokens"""


class DppoConfig(Section):
    """loss=dppo_*"""

    ratio_cap: Annotated[float, Field(ge=1)] = 20.0
    """C in sg(min(r, C)); the masks use algorithm.clip_low/high"""


class DroConfig(Section):
    """loss=dro"""

    beta: Annotated[float, NonNegative] = 0.1
    """weight of the (log pi - log mu)^2 leash"""


class AutotuneConfig(Section):
    """algorithm.max_staleness=auto: the learner moves the staleness bound (and with it the buffer's
    admission budget, the groups in flight) within [min, max] (asyncrl/control.py)."""

    enabled: bool = False
    """set by algorithm.max_staleness=auto (algorithm.max_staleness then holds `max`)"""
    min: Annotated[int, NonNegative] = 1
    """the lowest bound, and where the run starts"""
    max: Annotated[int, AtLeastOne] = 8
    wait_high: Annotated[float, Fraction] = 0.1
    """the bound rises while the learner waits for data more than this share of its step, with no
    prompt left unleased (the generators would take more)"""
    patience: Annotated[int, AtLeastOne] = 3
    """steps a condition must hold before the bound moves; after a move it rests bound + 1 steps"""
    ess_floor: Annotated[float, Fraction] = 0.8
    """off-policy guard: a step's ESS (fraction of tokens) below this pulls the bound back"""
    capped_max: Annotated[float, Fraction] = 0.05
    """off-policy guard: a share of tokens with pi/mu at the cap above this pulls the bound back"""
    relax_steps: Annotated[int, AtLeastOne] = 100
    """steps after a guard pull-back before the bound may rise past it again"""
    fleet_min: Annotated[int, NonNegative] = 0
    """fleet_max > 0: generators are added through the elastic path (local and Ray deployments) when
    generation is the bottleneck, up to fleet_max (and never below fleet_min); 0: advice only"""
    fleet_max: Annotated[int, NonNegative] = 0


class AlgorithmConfig(Section):
    advantage: AdvantageName = "grpo"
    """Every algorithm's value, what it is for and its reference: docs/algorithms.md (from asyncrl/registry.py).
    gae trains a critic (learners/critic.py) and remax subtracts the reward of one greedy completion per
    prompt (generated beside the samples, not trained); both work with generator.n=1. The others are
    group baselines."""
    loss: PolicyLossName = "decoupled_ppo"
    clip_low: Annotated[float, NonNegative] = 0.2
    clip_high: Annotated[float, NonNegative] = 0.2
    """> clip_low: DAPO clip-higher"""
    dual_clip: float = 0.0
    """> 1: dual-clip bound on negative-advantage tokens; 0: off"""
    is_cap: Annotated[float, Field(ge=1)] = 2.0
    """C in min(pi_prox / mu, C)"""
    is_level: Literal["token", "sequence"] = "token"
    """truncated IS weight per token or per sequence"""
    mis: MisConfig = Field(default_factory=MisConfig)
    """loss=mis: low, high"""
    kl_coef: Annotated[float, NonNegative] = 0.0
    """KL to the frozen reference (the initial model); 0: no reference is loaded"""
    kl_estimator: KLEstimatorName = "k3"
    kl_in: Literal["loss", "reward"] = "loss"
    """reward: kl_coef * per-token KL subtracted from each token's reward"""
    kl_target: Annotated[float, NonNegative] = 0.0
    """> 0: adaptive coefficient tracking this KL (PPO controller); 0: fixed"""
    kl_horizon: Annotated[int, AtLeastOne] = 10000
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards have zero variance (counted)"""
    overlong_buffer: Annotated[int, NonNegative] = 0
    """DAPO overlong shaping: linear penalty over the last N tokens before max_tokens"""
    overlong_penalty: Annotated[float, NonNegative] = 1.0
    max_staleness: Annotated[int, NonNegative] | Literal["auto"] = 1
    """policy versions a trained token may lag behind the learner; auto: the learner moves the bound
    within algorithm.autotune's [min, max] (docs/staleness.md), and this field then holds the max"""
    autotune: AutotuneConfig = Field(default_factory=AutotuneConfig)
    """max_staleness=auto's limits, its off-policy guard, and fleet advice and action"""
    allow_truncated_sampling: bool = False
    """top_p < 1 / top_k > 0 make behaviour log-probs those of the truncated distribution while the learner's
    are full-softmax: the off-policy losses then see a biased ratio. Allow it only knowingly."""
    aggregation: AggregationName = "token_mean"
    loss_norm_tokens: Annotated[int, NonNegative] = 0
    """seq_mean_token_sum_norm's constant; 0: generator.max_tokens"""
    critic_aggregation: AggregationName = "token_mean"
    """advantage=gae: the value loss's aggregation"""
    gamma: Annotated[float, Fraction] = 1.0
    """Discount (GAE and REINFORCE++), GAE lambda and PPO value clipping (|V - V_old| <= value_clip; 0: off)."""
    lam: Annotated[float, Fraction] = 0.95
    value_clip: Annotated[float, NonNegative] = 0.2
    entropy_coef: Annotated[float, NonNegative] = 0.0
    """loss -= entropy_coef * aggregated exact entropy"""
    rollout_rs: list[RolloutRSName] = Field(default_factory=list)
    """Rollout correction (asyncrl/algorithms/rollout_correction.py): reject tokens / sequences by their pi_prox / mu,
    e.g. rollout_rs=[token_k1,seq_mean_k3] rollout_rs_threshold=[2.0,0.01] (one threshold, or one each)."""
    rollout_rs_threshold: list[float] = Field(default_factory=lambda: [2.0])
    rollout_rs_lower: list[float] = Field(default_factory=list)
    """*_k1 criteria: the ratio's lower bound (one, or one per criterion; 0 for a criterion keeps 1/t),
    for asymmetric bounds [lower, t]; empty: [1/t, t]."""
    is_normalize: bool = False
    """divide the loss's behaviour IS weights by their batch mean (mean 1)"""
    otb_is_weights: bool = False
    """advantage=optimal_token_baseline: scale each token's energy by rho^2, rho the loss's truncated
    behaviour IS weight (min(pi/mu, is_cap) for decoupled_ppo / tis): the baseline for off-policy samples."""
    passk_norm_std: bool = True
    """advantage=grpo_passk: divide the margin by the group's std"""
    sapo: SapoConfig = Field(default_factory=SapoConfig)
    """loss=sapo: tau_pos, tau_neg"""
    cov: CovConfig = Field(default_factory=CovConfig)
    """loss=clip_cov / kl_cov: ratio, lb, ub, kl_coef"""
    dppo: DppoConfig = Field(default_factory=DppoConfig)
    """loss=dppo_*: ratio_cap"""
    dro: DroConfig = Field(default_factory=DroConfig)
    """loss=dro: beta"""
    pf_ppo: Literal["none", "pow", "max_min", "max_random"] = "none"
    """PF-PPO reweighting of each sample's advantage by its reward (pow: |r|^pf_ppo_pow; max_min: only the
    batch's best and worst; max_random: best 0.4, others 0.1), normalised to mean 1 over the step's samples"""
    pf_ppo_pow: Annotated[float, NonNegative] = 2.0

    @model_validator(mode="after")
    def _auto_staleness(self) -> AlgorithmConfig:
        """max_staleness=auto turns algorithm.autotune on and holds its max: every reader of the field
        sees the hard cap; the bound in force is the learner's (asyncrl/control.py). Written around
        validate_assignment, which would run this again."""
        if self.max_staleness == "auto":
            self.autotune.__dict__["enabled"] = True
            self.__dict__["max_staleness"] = self.autotune.max
        return self

    def config_errors(self) -> list[str]:
        """Cross-field mistakes within the algorithm section, one message each."""
        from asyncrl import registry

        errors = []
        n_rs, n_t = len(self.rollout_rs), len(self.rollout_rs_threshold)
        if self.rollout_rs and n_t not in (1, n_rs):
            errors.append(f"algorithm.rollout_rs_threshold must hold one threshold or one per algorithm.rollout_rs "
                          f"criterion ({n_rs}), got {n_t}")
        for name, t in zip(self.rollout_rs, self.rollout_rs_threshold * n_rs if n_t == 1 else
                           self.rollout_rs_threshold, strict=False):
            if name.endswith("k1") and t <= 1:
                errors.append(f"algorithm.rollout_rs_threshold for {name} bounds the ratio to [1/t, t]: it must be "
                              f"> 1, got {t}")
            elif t <= 0:
                errors.append(f"algorithm.rollout_rs_threshold for {name} must be > 0, got {t}")
        errors += self._lower_bound_errors()
        if self.autotune.enabled and not self.autotune.min <= self.autotune.max == self.max_staleness:
            errors.append(f"algorithm.autotune.min ({self.autotune.min}) must be <= algorithm.autotune.max "
                          f"({self.autotune.max}); set algorithm.max_staleness=auto and the limits there")
        if self.autotune.fleet_max and self.autotune.fleet_min > self.autotune.fleet_max:
            errors.append(f"algorithm.autotune.fleet_min ({self.autotune.fleet_min}) must be <= "
                          f"algorithm.autotune.fleet_max ({self.autotune.fleet_max})")
        correction = registry.POLICY_LOSSES.static_meta(self.loss).get("correction")
        if self.max_staleness > 0 and correction not in registry.CORRECTIONS:
            errors.append(f"algorithm.loss={self.loss} does not correct for stale samples (no behaviour "
                          f"correction): set algorithm.max_staleness=0 or use one of {_corrected_losses()}")
        with_w = [n for n in registry.POLICY_LOSSES.names()
                  if registry.POLICY_LOSSES.static_meta(n).get("correction") in registry.IS_WEIGHT_CORRECTIONS]
        if self.is_normalize and correction not in registry.IS_WEIGHT_CORRECTIONS:
            errors.append(f"algorithm.is_normalize=true rescales a behaviour IS weight, which algorithm.loss={self.loss} "
                          f"does not have: use one of {with_w} or set algorithm.is_normalize=false")
        if self.otb_is_weights and not registry.ADVANTAGES.static_meta(self.advantage).get("needs_sum_pi2"):
            errors.append(f"algorithm.otb_is_weights=true weights the optimal token baseline, which "
                          f"algorithm.advantage={self.advantage} is not: set algorithm.advantage=optimal_token_baseline "
                          "or algorithm.otb_is_weights=false")
        if self.otb_is_weights and correction not in registry.IS_WEIGHT_CORRECTIONS:
            errors.append(f"algorithm.otb_is_weights=true takes the loss's behaviour IS weight, which algorithm.loss="
                          f"{self.loss} does not have: use one of {with_w} or set algorithm.otb_is_weights=false")
        if self.cov.lb >= self.cov.ub:
            errors.append(f"algorithm.cov.lb ({self.cov.lb}) must be < algorithm.cov.ub ({self.cov.ub})")
        return errors

    def _lower_bound_errors(self) -> list[str]:
        """algorithm.rollout_rs_lower: one bound or one per criterion, each in (0, t) for a *_k1
        criterion (0: the symmetric 1/t), and only where a *_k1 criterion reads it."""
        lows, n_rs = self.rollout_rs_lower, len(self.rollout_rs)
        if not lows:
            return []
        if not any(name.endswith("k1") for name in self.rollout_rs):
            return [f"algorithm.rollout_rs_lower bounds the ratio of a *_k1 rejection criterion, and "
                    f"algorithm.rollout_rs={self.rollout_rs} has none: add one or set algorithm.rollout_rs_lower=[]"]
        if len(lows) not in (1, n_rs):
            return [f"algorithm.rollout_rs_lower must hold one bound or one per algorithm.rollout_rs criterion "
                    f"({n_rs}), got {len(lows)}"]
        ts = self.rollout_rs_threshold * n_rs if len(self.rollout_rs_threshold) == 1 else self.rollout_rs_threshold
        errors = []
        for name, low, t in zip(self.rollout_rs, lows * n_rs if len(lows) == 1 else lows, ts, strict=False):
            if name.endswith("k1") and low != 0 and not 0 < low < t:
                errors.append(f"algorithm.rollout_rs_lower for {name} must be in (0, {t}) (the upper bound "
                              f"algorithm.rollout_rs_threshold), or 0 for 1/{t}; got {low}")
        return errors


def _corrected_losses() -> list[str]:
    from asyncrl import registry

    return [n for n in registry.POLICY_LOSSES.names()
            if registry.POLICY_LOSSES.static_meta(n).get("correction") in registry.CORRECTIONS]


class WeightsConfig(Section):
    mode: Literal["keep", "abort", "drain"] = "keep"
    sync_every: Annotated[int, AtLeastOne] = 1
    bucket_mb: Annotated[float, Positive] = 64.0
    atomic: bool = True
    """Generators stage all buckets before loading, so a failed broadcast leaves old, whole weights;
    false streams bucket by bucket into the model (less memory, but a failure mid-way is fatal)."""
    join_timeout_s: Annotated[float, Positive] = 30.0
    """members that do not join a new group epoch by then are dropped"""
    sync_timeout_s: Annotated[float, Positive] = 60.0
    """a broadcast that does not finish by then fails the epoch"""
    port: Annotated[int, Port] = 0
    """0: a free port for the weight group's TCPStore"""
    backend: Literal["auto", "nccl", "gloo", "ipc"] = "auto"
    """auto: gloo without CUDA; on CUDA ipc when every generator runs on the learner's node, nccl
    otherwise. ipc: CUDA IPC handles of the learner's bucket buffer for generators on its node (one
    GPU shared by both included): no copy through the host. gloo on CUDA goes through host memory."""
    load: Literal["auto", "direct", "reload"] = "auto"
    """How a generator puts a version into vLLM. direct: one copy per tensor into the model's parameters
    (stacked qkv/gate_up filled from their parts, the tied head re-tied; generators/direct_load.py),
    for dense unquantized models without tensor parallelism; reload: vLLM's generic in-place reload;
    auto: the first version by reload, checked against the direct plan, then direct if they agree."""
    overlap: bool = True
    """With algorithm.max_staleness >= 1 (run.mode=async) the learner starts its next step while the
    generators receive and load the version it just pushed (a second snapshot buffer; a buffer is
    written again only once every member has it). false: every push is waited for."""
    checksum: Literal["auto", "full", "sampled"] = "auto"
    """Per-bucket checksums both ends compare after every sync. full: every byte; sampled: one word per
    4 KiB of each one-tensor bucket of 1 MiB or more, the rest in full (catches lost, stale, shifted
    or truncated buckets at 1/64 of the reads); auto: full on nccl (a GPU reduction), sampled on gloo."""


class CheckpointConfig(Section):
    every: Annotated[int, NonNegative] = 0
    """0: no checkpoints; trajectories are then acked right after their step"""
    dir: str = ""
    """empty: {run_dir}/checkpoints"""
    keep: Annotated[int, AtLeastOne] = 2
    """complete checkpoints kept"""
    resume: Literal["auto", "never", "must"] = "auto"
    """auto: resume the latest complete checkpoint"""
    export_hf: bool = True
    """write {run_dir}/hf-final (safetensors) when the run ends"""


class LoggingConfig(Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    backends: list[Literal["jsonl", "wandb", "tensorboard"]] = Field(default_factory=lambda: ["jsonl"])
    """Learner rank 0 writes every step (the fleet's metrics included) to each backend."""
    wandb_project: str = "asyncrl"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """offline: files under {run_dir}/wandb"""
    prometheus: bool = True
    """a /metrics endpoint in every process"""
    prometheus_host: str = "127.0.0.1"
    prometheus_port: Annotated[int, Port] = 0
    """0: a free port; N: N, or the next free one up to N+63. Published in Redis."""
    lag_history: Annotated[int, NonNegative] = 100
    """batches whose version-lag histogram `asyncrl status` shows"""


class DeployConfig(Section):
    bind_host: str = "127.0.0.1"
    """The interface every server of this run binds (learner weight-group store; the buffer has
    buffer.bind_host). Localhost unless a multi-node run names the node's interface (docs/deploy.md)."""
    advertise_host: str = ""
    """The address other nodes reach this node's servers at, published in Redis for the buffer's
    ingest socket and the weight-group store. Empty: the bind address (buffer.bind_host,
    deploy.bind_host), or this node's host name when that is 0.0.0.0."""
    redis_password_file: str = ""
    """a file holding the Redis password (never on a command line)"""
    run_token_file: str = ""
    """a file holding the run token every generator must present"""
    curve_keys_dir: str = ""
    """`asyncrl keys generate --out DIR`: ZeroMQ CURVE between generators and buffer"""
    slurm_partition: str = ""
    """`asyncrl submit slurm` defaults; --partition etc. override"""
    slurm_time: str = "24:00:00"
    slurm_extra: list[str] = Field(default_factory=list)
    """extra `#SBATCH` lines, e.g. ["--account=rl"]"""


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    deploy: DeployConfig = Field(default_factory=DeployConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / self.run.name

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "checkpoints"

    @property
    def model_path(self) -> str:
        return self.model.path or str(self.run_dir / "tiny-model")

    def tiny_shape(self) -> dict:
        """`model.tiny` as keyword arguments of asyncrl.tools.tiny_model.write_tiny_model."""
        return self.model.tiny.shape()

    def _advantage_meta(self, flag: str) -> bool:
        """A flag of algorithm.advantage's registration (asyncrl/algorithms/advantages.py), read without torch."""
        from asyncrl import registry

        return bool(registry.ADVANTAGES.static_meta(self.algorithm.advantage).get(flag, False))

    def validate(self) -> Config:
        """Cross-field checks; each error names the dotted path and the fix. Types, choices and the
        bounds the fields declare are pydantic's, at load and on every assignment, so none is repeated here."""
        for ok, message in self._sampling_checks() + self._settings_checks():
            if not ok:
                raise ConfigError(message)
        from asyncrl.tasks.registry import config_errors as task_errors  # data.task and its own settings

        for message in task_errors(self):
            raise ConfigError(message)
        for message in self.algorithm.config_errors():
            raise ConfigError(message)
        for message in self._mode_errors() + self._cpus_errors():
            raise ConfigError(message)
        return self

    def _sampling_checks(self) -> list[tuple[bool, str]]:
        """(ok, message) of the samples each group needs: their number, their rewards, their distribution."""
        return [
            # GAE's baseline is the critic and ReMax's the prompt's greedy completion, not the group,
            # so only the group advantages need n > 1.
            (self.generator.n > 1 or self._advantage_meta("critic") or self._advantage_meta("greedy_baseline"),
             f"generator.n must be > 1 for group advantages (algorithm.advantage={self.algorithm.advantage}), "
             f"got {self.generator.n}; algorithm.advantage=gae (a critic) or remax (a greedy baseline) works with n=1"),
            # The overlong penalty shapes each sample's reward by its length in the learner, which knows
            # nothing of the greedy completion's length: its baseline would stay unshaped.
            (not self._advantage_meta("greedy_baseline") or self.algorithm.overlong_buffer == 0,
             f"algorithm.overlong_buffer={self.algorithm.overlong_buffer} shapes the samples' rewards but not the "
             f"greedy baseline of algorithm.advantage={self.algorithm.advantage}: set algorithm.overlong_buffer=0"),
            (self.generator.n > 1 or not self.algorithm.dynamic_sampling,
             "algorithm.dynamic_sampling=true drops groups whose rewards are all equal, which is every group "
             "with generator.n=1: set generator.n > 1 or algorithm.dynamic_sampling=false"),
            (self.generator.temperature > 0, "generator.temperature must be > 0 (behaviour log-probs need a "
             f"proper distribution), got {self.generator.temperature}"),
            (0 < self.generator.top_p <= 1, f"generator.top_p must be in (0, 1], got {self.generator.top_p}"),
            (self.generator.top_k == -1 or self.generator.top_k > 0,
             f"generator.top_k must be -1 (off) or > 0, got {self.generator.top_k}"),
            ((self.generator.top_p == 1.0 and self.generator.top_k == -1) or self.algorithm.allow_truncated_sampling,
             f"generator.top_p={self.generator.top_p} / generator.top_k={self.generator.top_k} truncate the sampling "
             "distribution: behaviour log-probs are then of the truncated, renormalised distribution while the "
             "learner computes full-softmax log-probs, so every importance ratio pi/mu is biased. Use top_p=1.0 "
             "and top_k=-1, or set algorithm.allow_truncated_sampling=true to accept the bias"),
        ]

    def _settings_checks(self) -> list[tuple[bool, str]]:
        """(ok, message) of settings that must agree with one another within or across sections."""
        tiny = self.model.tiny
        return [
            (not (self.reward.function and self.reward.model), "set reward.function or reward.model, not both"),
            (not (self.run.resume and self.run.reset), "run.resume=true continues the run and run.reset=true "
             "clears it: set one of them"),
            (self.learner.batch_groups % self.learner.nproc == 0,
             f"learner.batch_groups ({self.learner.batch_groups}) must be divisible by learner.nproc "
             f"({self.learner.nproc}) so every rank gets whole groups"),
            (self.learner.batch_groups % self.learner.minibatches == 0,
             "learner.batch_groups must be divisible by learner.minibatches"),
            (tiny.shape_ok(), f"model.tiny.hidden_size ({tiny.hidden_size}) must be a multiple of 64 with "
             f"model.tiny.num_heads=0, else of model.tiny.num_heads ({tiny.num_heads}), which must be a multiple "
             f"of model.tiny.num_kv_heads ({tiny.num_kv_heads}); layers and sizes > 0"),
            (self.buffer.replay_ratio == 1 or self.buffer.sampling == "replay",
             f"buffer.replay_ratio={self.buffer.replay_ratio} only takes effect with buffer.sampling=replay "
             f"(got buffer.sampling={self.buffer.sampling})"),
            (not self.learner.optimizer_offload or self.learner.param_offload,
             "learner.optimizer_offload=true needs learner.param_offload=true: FSDP2's CPUOffloadPolicy moves "
             "parameters, gradients and optimizer state together"),
            (self.algorithm.dual_clip == 0 or self.algorithm.dual_clip > 1,
             f"algorithm.dual_clip must be 0 (off) or > 1, got {self.algorithm.dual_clip}"),
            (self.algorithm.mis.low < 1 < self.algorithm.mis.high,
             "algorithm.mis.low must be < 1 < algorithm.mis.high"),
            (not self.learner.lora.enabled or bool(self.learner.lora.target_modules),
             "learner.lora.target_modules must name at least one module (e.g. q_proj,v_proj)"),
        ]

    def _mode_errors(self) -> list[str]:
        """Cross-field checks of run.mode (asyncrl/modes.py)."""
        sync_every, max_staleness = self.weights.sync_every, self.algorithm.max_staleness
        if self.algorithm.autotune.enabled:  # the bound in force may fall to the controller's min
            max_staleness = self.algorithm.autotune.min
            if self.run.mode == "sync":
                return ["run.mode=sync trains each version on its own groups (staleness 0): "
                        "algorithm.max_staleness=auto has nothing to tune there; use run.mode=async"]
        if self.run.mode != "sync":
            # A group starts on the last version pushed; the learner trains up to sync_every - 1 versions
            # past it before the next push, so every group of those steps would be too stale to train.
            if sync_every - 1 > max_staleness:
                return [f"weights.sync_every={sync_every} needs algorithm.max_staleness >= {sync_every - 1} (got "
                        f"{max_staleness}): groups started between pushes would all be dropped as stale"]
            return []
        errors = []
        if sync_every != 1:
            errors.append(f"run.mode=sync needs weights.sync_every=1 (generators wait for the weights of every "
                          f"version), got {sync_every}")
        if self.buffer.sampling == "replay":
            errors.append("run.mode=sync trains each group once with the weights that sampled it: set "
                          "buffer.sampling=fifo (replay would reuse groups of older versions)")
        return errors

    def _cpus_errors(self) -> list[str]:
        """generator/learner/buffer.cpus (asyncrl/launch/affinity.py): syntax and cross-field checks,
        machine-independent (the config may be checked on a login node)."""
        errors = []
        for role in ("generator", "learner", "buffer"):
            text = getattr(self, role).cpus
            try:
                cpus = parse_cpus(text)
            except ValueError as e:
                errors.append(f"{role}.cpus={text!r}: {e}; use a CPU list like \"0\", \"0-3\" or \"0-3,8\" "
                              "(empty: no pinning)")
                continue
            tp = self.generator.tensor_parallel_size
            if role == "generator" and cpus and len(cpus) % tp:
                errors.append(f"generator.cpus={text!r} has {len(cpus)} CPUs, not a multiple of "
                              f"generator.tensor_parallel_size={tp} (each vLLM worker gets an equal share)")
            if role == "learner" and cpus and len(cpus) < self.learner.nproc:
                errors.append(f"learner.cpus={text!r} has {len(cpus)} CPUs for learner.nproc={self.learner.nproc} "
                              "ranks; give at least one CPU per rank")
        return errors


# ---- loading -------------------------------------------------------------------------------------

# Keys that moved into a sub-section, old dotted key -> new. The old ones are still read for one
# release, in a config file and as a `key=value` override alike, each with a one-line deprecation
# message naming the new key; the schema and the configs a run writes have only the new ones.
RENAMED_KEYS = {
    **{f"model.tiny_{key}": f"model.tiny.{key}" for key in ("warm_start_steps", "warm_start_lr", "hidden_size",
                                                             "num_layers", "num_heads", "num_kv_heads",
                                                             "intermediate_size")},
    "algorithm.mis_low": "algorithm.mis.low",
    "algorithm.mis_high": "algorithm.mis.high",
    "algorithm.sapo_tau_pos": "algorithm.sapo.tau_pos",
    "algorithm.sapo_tau_neg": "algorithm.sapo.tau_neg",
    "algorithm.cov_ratio": "algorithm.cov.ratio",
    "algorithm.cov_lb": "algorithm.cov.lb",
    "algorithm.cov_ub": "algorithm.cov.ub",
    "algorithm.cov_kl_coef": "algorithm.cov.kl_coef",
    "algorithm.dppo_ratio_cap": "algorithm.dppo.ratio_cap",
    "algorithm.dro_beta": "algorithm.dro.beta",
}
_said_renamed: set[str] = set()


def _renamed(old: str) -> str:
    """The new key of a renamed one; the deprecation is said once per key and process."""
    new = RENAMED_KEYS[old]
    if old not in _said_renamed:
        _said_renamed.add(old)
        log.warning("config key %s is deprecated and is read until the next release: use %s", old, new)
    return new


def move_renamed_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A config file's mapping with every renamed key moved to its new place (where both are set, the
    new key's value stays)."""
    for old in RENAMED_KEYS:
        section, key = old.split(".")
        node = data.get(section)
        if not isinstance(node, dict) or key not in node:
            continue
        value = node.pop(key)
        *parents, leaf = _renamed(old).split(".")[1:]
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{_renamed(old)}: {part} is not a section in the config file")
        node.setdefault(leaf, value)
    return data



def _bounds(field) -> str:
    """The range declared on a field, "> 0 and <= 1"."""
    lo = hi = ""
    for m in field.metadata:
        if getattr(m, "gt", None) is not None:
            lo = f"> {m.gt:g}"
        elif getattr(m, "ge", None) is not None:
            lo = f">= {m.ge:g}"
        if getattr(m, "lt", None) is not None:
            hi = f"< {m.lt:g}"
        elif getattr(m, "le", None) is not None:
            hi = f"<= {m.le:g}"
    return " and ".join(x for x in (lo, hi) if x)


def _walk(loc: tuple) -> tuple[str, Any, Any]:
    """The dotted path of a pydantic error location (`algorithm.rollout_rs[1]`), the field it falls in
    (None above the fields) and the annotation at that location."""
    path, field, tp = "", None, Config
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            args = typing.get_args(tp)
            tp = args[0] if args else Any
        elif isinstance(tp, type) and issubclass(tp, BaseModel) and part in tp.model_fields:
            field = tp.model_fields[part]
            tp = field.annotation
            path = f"{path}.{part}" if path else str(part)
        else:
            path = f"{path}.{part}" if path else str(part)
            field, tp = None, Any
    return path, field, tp


_EXPECTED = {"int": "an integer", "float": "a number", "bool": "true/false", "string": "a string",
             "list": "a list", "model": "a mapping", "dict": "a mapping"}


def _message(error: dict, prefix: tuple = ()) -> str:
    """One line for pydantic's first error, in the words of the key: `learner.lr must be > 0, got -2.0`."""
    loc, kind, value = (*prefix, *error["loc"]), error["type"], error["input"]
    if kind == "extra_forbidden":
        path, _, parent = _walk(loc[:-1])
        return _unknown_key(path, str(loc[-1]), list(parent.model_fields))
    path, field, tp = _walk(loc)
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal") and field is not None:
        value = float(value) if tp is float else value
        return f"{path} must be {_bounds(field)}, got {value!r}"
    if kind == "literal_error":
        return f"{path}: {value!r} is not one of {list(typing.get_args(tp))}"
    what = next((w for k, w in _EXPECTED.items() if kind.startswith(k + "_")), None)
    if what is not None:
        return f"{path or 'config'}: expected {what}, got {value!r}"
    return f"{path or 'config'}: {error['msg']}, got {value!r}"


def _unknown_key(path: str, key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    prefix = f"{path}." if path else ""
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(valid)}"
    return f"unknown config key '{prefix}{key}'{hint}"


def parse_override_value(text: str) -> Any:
    """The YAML reading of an override's text: `1e-6`, `0x10`, `true`, `null`, `[2, 3]`, `"quoted"`."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    # YAML 1.1 reads `1e-6` as a string; numbers written that way are what users mean.
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return value
    return value


def _is_text(tp: Any) -> bool:
    """A field whose override is its text as typed: a string, or a choice among strings."""
    return tp is str or (typing.get_origin(tp) is Literal and all(isinstance(a, str) for a in typing.get_args(tp)))


def _override_value(text: str, tp: Any) -> Any:
    """An override's text as the input for a field of type `tp`: a text field keeps the text
    (`data.alphabet=0123` stays "0123", not the octal 83; quotes are taken off); a list takes a YAML
    list or comma-separated items, each read by the item type; an optional field takes `null`; any
    other field takes the YAML reading, which pydantic then coerces by the field's type."""
    origin = typing.get_origin(tp)
    if _is_text(tp):
        quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
        parsed = parse_override_value(text) if quoted else None
        return parsed if isinstance(parsed, str) else text
    if origin is list:
        parsed = parse_override_value(text)
        items = parsed if isinstance(parsed, list) else [v.strip() for v in text.split(",") if v.strip()]
        (item_tp,) = typing.get_args(tp)
        return [_override_value(v, item_tp) if isinstance(v, str) else v for v in items]
    if origin in (typing.Union, types.UnionType):
        parsed = parse_override_value(text)
        if parsed is None:
            return None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _override_value(text, args[0]) if len(args) == 1 else parsed
    return parse_override_value(text)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Sets each `section.key=value` in the YAML mapping, its text coerced by the field's type (pydantic's
    lax mode: `1e3` into an integer field is 1000, `yes` into a boolean is true); the result is
    then checked with the file's values."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value (e.g. learner.lr=1e-6)")
        dotted, text = item.split("=", 1)
        dotted = dotted.strip()
        if dotted in RENAMED_KEYS:
            dotted = _renamed(dotted)
        parts = dotted.split(".")
        node, cls = data, Config
        for i, part in enumerate(parts):
            path = ".".join(parts[:i])
            if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
                raise ConfigError(f"override {dotted}: {path} is not a section")
            if part not in cls.model_fields:
                raise ConfigError(_unknown_key(path, part, list(cls.model_fields)))
            tp = cls.model_fields[part].annotation
            if i == len(parts) - 1:
                break
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted}: {'.'.join(parts[:i + 1])} is not a section in the config file")
            cls = tp
        try:
            node[parts[-1]] = TypeAdapter(tp).validate_python(_override_value(text, tp))
        except ValidationError as e:
            raise ConfigError(_message(e.errors()[0], tuple(parts))) from None
    return data


def shipped_configs() -> dict[str, Path]:
    """The configs that ship in the package, by name (the file name without `.yaml`)."""
    return {p.stem: p for p in sorted(PACKAGED_CONFIGS.glob("*.yaml"))}


def config_description(path: Path) -> str:
    """The first sentence of a config's leading comment (cut at its first ': ' when long)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#") or line.startswith("#  "):  # the comment's end, or its command lines
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    sentence = text.split(". ")[0].rstrip(".")
    if len(sentence) > 100 and ": " in sentence:
        sentence = sentence.split(": ")[0]
    return sentence


def resolve_config(path: str | Path | None) -> Path:
    """A config file as given (relative to the working directory), else a shipped config by name
    (`smollm2_arith` or `smollm2_arith.yaml`); None is the embedded default."""
    if not path:
        return DEFAULT_CONFIG
    given = Path(path)
    if given.exists() or len(given.parts) > 1:
        return given
    shipped = shipped_configs()
    name = given.name.removesuffix(".yaml")
    if name in shipped:
        return shipped[name]
    close = difflib.get_close_matches(name, list(shipped), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"config {str(path)!r} is neither a file nor a shipped config ({', '.join(shipped)}: "
                      f"`asyncrl configs` lists them){hint}")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Loads YAML (a file, or a shipped config by name; default: the packaged asyncrl/configs/tiny.yaml),
    applies overrides, type-checks and validates. Relative paths inside a config (`model.path`,
    `run.dir`, `data.path`) are relative to the working directory, wherever the config file lives."""
    import yaml

    path = resolve_config(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping, got {data!r}")
    data = apply_overrides(move_renamed_keys(data), overrides or [])
    try:
        cfg = Config.model_validate(data, strict=True)
    except ValidationError as e:
        raise ConfigError(_message(e.errors()[0])) from None
    return cfg.validate()


def config_schema() -> dict[str, Any]:
    """The config tree's JSON Schema (draft 2020-12, pydantic's): types, choices, declared ranges,
    defaults and each field's description (`asyncrl config schema`). Cross-field checks are in
    Config.validate."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **Config.model_json_schema()}


def to_dict(cfg: Config) -> dict[str, Any]:
    return cfg.model_dump()


def dump_yaml(cfg: Config) -> str:
    import yaml

    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
