"""Every message that crosses a process boundary, and its validation.

Imported by all roles; imports nothing heavy (no torch, no vLLM). Frames are msgpack (msgspec),
never pickle. Token ids, log-probs and versions travel as little-endian packed arrays
(int32 / float32 / int32) in `bytes` fields, not as lists of Python numbers.
"""

from __future__ import annotations

import math
import re
import sys

import msgspec
import numpy as np

# 2: every weight broadcast ends in an all-reduce that each member joins (asyncrl/protocol/transports/collective.py
# `all_received`). Generators report theirs in their heartbeat; the learner leaves generators of
# another version out of its weight groups (asyncrl/protocol/fleet.py `admitted`).
SCHEMA_VERSION = 2
# 3: a trajectory group of multi-turn episodes (docs/agentic.md). Its samples carry a loss mask (the
# policy's tokens among the tokens after the prompt, observations between them) and an EpisodeInfo.
# Only trajectory groups use it; a single-turn group stays version 2, so its frames are unchanged.
EPISODE_SCHEMA_VERSION = 3

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")


class FrameError(ValueError):
    """A frame that failed to decode or validate. `reason` is a short stable label for metrics."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def pack_i32(values) -> bytes:
    return np.asarray(values, dtype=I32).tobytes()


def pack_f32(values) -> bytes:
    return np.asarray(values, dtype=F32).tobytes()


def unpack_i32(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=I32)


def unpack_f32(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=F32)


class SamplingInfo(msgspec.Struct, frozen=True):
    """The sampling settings a group was generated with; the learner refuses groups that disagree."""

    temperature: float
    top_p: float
    top_k: int


class EpisodeInfo(msgspec.Struct, frozen=True):
    """How a multi-turn episode went (schema version 3): what the agentic metrics read."""

    turns: int  # assistant turns
    tool_calls: int = 0  # well-formed tool calls the environment ran
    tool_errors: int = 0  # malformed or failed tool calls (each answered with an error observation)
    env_s: float = 0.0  # seconds spent in the environment's steps, all turns
    end_reason: str = ""  # done | max_turns | max_tokens | env_timeout | env_error:<Type>


class Sample(msgspec.Struct):
    completion_ids: bytes  # int32 LE, every token after the prompt (one episode: turns and observations)
    logprobs: bytes  # float32 LE, behaviour log-prob of each token after temperature (0.0 where the mask is 0)
    versions: bytes  # int32 LE, policy version that produced each token (observations: the turn's before)
    reward: float
    finish_reason: str = ""
    # Schema version 3 only: uint8 per token, 1 for a token the policy sampled (trained on), 0 for
    # one the environment or the chat template added. Empty (version 2): every token is the policy's.
    loss_mask: bytes = b""
    episode: EpisodeInfo | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.completion_ids) // 4

    def policy_mask(self) -> np.ndarray:
        """1 for each token the policy sampled, 0 for the others (uint8, num_tokens of them)."""
        if not self.loss_mask:
            return np.ones(self.num_tokens, dtype=np.uint8)
        return np.frombuffer(self.loss_mask, dtype=np.uint8)

    @property
    def num_policy_tokens(self) -> int:
        return int(self.policy_mask().sum()) if self.loss_mask else self.num_tokens


class TrajectoryGroup(msgspec.Struct, tag="trajectory_group"):
    """All `n` samples for one prompt: the unit the buffer stores and the learner trains on."""

    schema_version: int
    group_id: str
    prompt_id: str
    generator_id: str
    prompt_ids: bytes  # int32 LE
    samples: list[Sample]
    sampling: SamplingInfo
    created_at: float  # wall-clock seconds when the group finished
    reward_errors: int = 0
    # The reward of one greedy (temperature 0) completion of the prompt, which is not one of the
    # samples: the baseline of advantage estimators with `greedy_baseline` (remax); None otherwise.
    # Optional with a default, so frames without it decode as before (no schema version change).
    baseline_reward: float | None = None
    # The prompt's entry id in the prompts stream (its lease, `{ms}-{seq}`). The buffer acks it in the
    # same script that stores the group, and refuses a group whose lease is gone (acked by an earlier
    # copy, or reclaimed and re-released): exactly-once without keeping dedupe keys for ever
    # (asyncrl/protocol/store.py). "" (older writers): dedupe by group id alone. Optional, as above.
    lease_id: str = ""

    def min_version(self) -> int:
        return min(int(unpack_i32(s.versions).min()) for s in self.samples if s.num_tokens)

    def max_version(self) -> int:
        return max(int(unpack_i32(s.versions).max()) for s in self.samples if s.num_tokens)

    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)


class PromptTask(msgspec.Struct, tag="prompt_task"):
    """One released prompt, leased by a generator from the prompts stream."""

    schema_version: int
    group_id: str  # unique per release: `{prompt_id}@{epoch}` so reclaims dedupe
    prompt_id: str
    prompt: str
    answer: str
    released_at: float


class TensorMeta(msgspec.Struct, frozen=True):
    name: str
    dtype: str  # torch dtype name without the "torch." prefix
    shape: list[int]
    offset: int  # byte offset inside its bucket
    nbytes: int


class Bucket(msgspec.Struct, frozen=True):
    nbytes: int
    tensors: list[TensorMeta]


class WeightAnnouncement(msgspec.Struct, tag="weight_announcement"):
    """Announced before every broadcast: what the flat buckets that follow contain."""

    schema_version: int
    version: int
    epoch: int
    buckets: list[Bucket]
    announced_at: float
    checksum: str = "full"  # how both ends checksum each bucket (asyncrl/protocol/weight_buckets.py bucket_checksum)


class GroupEpoch(msgspec.Struct, tag="group_epoch"):
    """A weight broadcast group. Rank 0 is the learner; members[i] joins as rank i + 1."""

    schema_version: int
    epoch: int
    addr: str
    port: int
    members: list[str]
    backend: str  # "gloo", "nccl" or "ipc"
    opened_at: float


class IpcExport(msgspec.Struct, tag="ipc_export"):
    """weights.backend=ipc: where one version's buckets are, as a CUDA IPC handle of the learner's flat
    bucket buffer (torch's tensor reduction, its fields spelled out: no pickle). Written for each member
    to the epoch's store (`ipc/{version}/{member}`); a member opens it, reads the buckets at
    `weight_buckets.flat_offsets`, loads them and confirms (`done/{version}/{member}`)."""

    schema_version: int
    version: int
    device_uuid: str  # the learner's GPU: the member maps it to its own device index
    handle: bytes  # cudaIpcMemHandle of the allocation holding the buffer
    storage_size: int  # bytes of the buffer's storage
    storage_offset: int  # bytes from the allocation's start to the storage
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    nbytes: int  # of the flat buffer: every bucket, ALIGN-aligned, in announcement order


class EvalTask(msgspec.Struct, tag="eval_task"):
    """One held-out prompt of an evaluation round, leased by a generator from `eval_prompts`."""

    schema_version: int
    round_id: str  # `v{version}`: one round per learner version
    version: int  # the learner version the round evaluates; generators wait until they hold it
    prompt_id: str
    prompt: str
    answer: str
    k: int  # samples at the training temperature for mean@k (besides the one greedy sample)
    released_at: float
    # Return the greedy answer's text in the result (the first `eval.show` prompts of a round, for
    # `asyncrl report`). A default, so frames without it decode as before (no schema version change).
    show: bool = False


class EvalResult(msgspec.Struct, tag="eval_result"):
    """A generator's score of one EvalTask, appended to `eval_results` for learner rank 0 to aggregate."""

    schema_version: int
    round_id: str
    version: int
    prompt_id: str
    generator_id: str
    greedy_correct: bool
    greedy_reward: float
    sample_correct: bytes  # int32 LE, 0/1 per sample at the training temperature (k of them)
    sample_rewards: bytes  # float32 LE, k of them
    min_version: int  # the lowest policy version that produced a token of this result
    num_tokens: int
    finished_at: float
    # A task with an environment: the greedy episode's assistant turns and well-formed tool calls (0, 0
    # for single completions, and in results of code before these fields).
    greedy_turns: int = 0
    greedy_tool_calls: int = 0
    # The greedy answer, decoded (an episode: its turns, each marked `[assistant]` or `[environment]`),
    # for a task with `show`; None for the others and from code before this field.
    greedy_text: str | None = None


Message = TrajectoryGroup | PromptTask | WeightAnnouncement | GroupEpoch | IpcExport | EvalTask | EvalResult

_encoder = msgspec.msgpack.Encoder()
_decoders = {
    cls: msgspec.msgpack.Decoder(cls)
    for cls in (TrajectoryGroup, PromptTask, WeightAnnouncement, GroupEpoch, IpcExport, EvalTask, EvalResult)
}


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


MAX_ID_CHARS = 512  # group / prompt / generator ids, finish reasons: Redis keys are built from ids
MAX_SAMPLES = 4096  # samples in one group


def decode(data: bytes, cls: type, max_bytes: int = sys.maxsize, max_tokens: int | None = None):
    """Decodes and validates one frame of type `cls`; raises FrameError with a reason label (only that)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise FrameError("not_bytes", f"frame is {type(data).__name__}")
    if len(data) > max_bytes:
        raise FrameError("too_large", f"{len(data)} bytes > max_frame_bytes {max_bytes}")
    try:
        message = _decoders[cls].decode(data)
    except msgspec.ValidationError as e:
        raise FrameError("schema", str(e)) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        raise FrameError("decode", str(e)) from None
    accepted = (SCHEMA_VERSION, EPISODE_SCHEMA_VERSION) if isinstance(message, TrajectoryGroup) else (SCHEMA_VERSION,)
    if message.schema_version not in accepted:
        raise FrameError("schema_version", f"got {message.schema_version}, expected "
                         f"{' or '.join(map(str, accepted))}")
    if isinstance(message, TrajectoryGroup):
        validate_group(message, max_tokens=max_tokens)
    return message


def _finite(x: float) -> bool:
    return math.isfinite(x)


def validate_group(group: TrajectoryGroup, max_tokens: int | None = None) -> None:
    """Semantic checks msgpack types cannot express; raises FrameError."""
    if not group.group_id or not group.prompt_id:
        raise FrameError("empty_id", "group_id and prompt_id must be non-empty")
    for name in ("group_id", "prompt_id", "generator_id"):
        if len(getattr(group, name)) > MAX_ID_CHARS:
            raise FrameError("bad_id", f"{name} longer than {MAX_ID_CHARS} characters")
    if not group.samples:
        raise FrameError("no_samples", f"group {group.group_id} has no samples")
    if len(group.samples) > MAX_SAMPLES:
        raise FrameError("too_many_samples", f"{len(group.samples)} samples > {MAX_SAMPLES}")
    sp = group.sampling
    if not (_finite(sp.temperature) and sp.temperature > 0 and _finite(sp.top_p) and 0 < sp.top_p <= 1
            and (sp.top_k == -1 or sp.top_k > 0)):
        raise FrameError("bad_sampling", f"temperature={sp.temperature} top_p={sp.top_p} top_k={sp.top_k}")
    if not (_finite(group.created_at) and group.created_at > 0):
        raise FrameError("bad_timestamp", f"created_at={group.created_at}")
    if group.baseline_reward is not None and not math.isfinite(group.baseline_reward):
        raise FrameError("bad_baseline", f"baseline_reward {group.baseline_reward}")
    if not 0 <= group.reward_errors <= len(group.samples):
        raise FrameError("bad_count", f"reward_errors={group.reward_errors} for {len(group.samples)} samples")
    if len(group.prompt_ids) == 0 or len(group.prompt_ids) % 4:
        raise FrameError("bad_array", "prompt_ids must be a non-empty packed int32 array")
    if np.any(unpack_i32(group.prompt_ids) < 0):
        raise FrameError("bad_array", "prompt_ids has negative token ids")
    for i, s in enumerate(group.samples):
        if len(s.finish_reason) > MAX_ID_CHARS:
            raise FrameError("bad_id", f"sample {i} finish_reason longer than {MAX_ID_CHARS} characters")
        for name in ("completion_ids", "logprobs", "versions"):
            if len(getattr(s, name)) % 4:
                raise FrameError("bad_array", f"sample {i} {name} length {len(getattr(s, name))} is not a multiple of 4")
        n = len(s.completion_ids)
        if len(s.logprobs) != n or len(s.versions) != n:
            raise FrameError(
                "length_mismatch",
                f"sample {i}: {n // 4} tokens, {len(s.logprobs) // 4} logprobs, {len(s.versions) // 4} versions",
            )
        if n == 0:
            raise FrameError("empty_sample", f"sample {i} has no tokens")
        if max_tokens is not None and n // 4 > max_tokens:
            raise FrameError("too_long", f"sample {i} has {n // 4} tokens > {max_tokens}")
        if not math.isfinite(s.reward):
            raise FrameError("bad_reward", f"sample {i} reward {s.reward}")
        _validate_episode(group.schema_version, i, s)
        lp = unpack_f32(s.logprobs)
        if not np.all(np.isfinite(lp)) or np.any(lp > 1e-4):
            raise FrameError("bad_logprob", f"sample {i} has non-finite or positive log-probs")
        if np.any(unpack_i32(s.versions) < 0) or np.any(unpack_i32(s.completion_ids) < 0):
            raise FrameError("bad_array", f"sample {i} has negative token ids or versions")


def _validate_episode(schema_version: int, i: int, s: Sample) -> None:
    """A version-2 sample has no episode fields; a version-3 one has a loss mask of one 0/1 byte per
    token with at least one policy token (the first turn is the policy's), and sane episode counts."""
    if schema_version != EPISODE_SCHEMA_VERSION:
        if s.loss_mask or s.episode is not None:
            raise FrameError("schema_version", f"sample {i} carries episode fields (loss_mask, episode), which need "
                             f"schema_version {EPISODE_SCHEMA_VERSION}, not {schema_version}")
        return
    if len(s.loss_mask) != s.num_tokens:
        raise FrameError("bad_mask", f"sample {i}: loss_mask of {len(s.loss_mask)} bytes for {s.num_tokens} tokens")
    mask = s.policy_mask()
    if np.any(mask > 1):
        raise FrameError("bad_mask", f"sample {i}: loss_mask values other than 0 and 1")
    if not mask.any():
        raise FrameError("bad_mask", f"sample {i}: loss_mask has no policy token")
    e = s.episode
    if e is not None:
        if min(e.turns, e.tool_calls, e.tool_errors) < 0 or not (math.isfinite(e.env_s) and e.env_s >= 0):
            raise FrameError("bad_episode", f"sample {i}: episode {e}")
        if len(e.end_reason) > MAX_ID_CHARS:
            raise FrameError("bad_id", f"sample {i} end_reason longer than {MAX_ID_CHARS} characters")


# ---- validation against the run ----------------------------------------------------------------------


class RunLimits(msgspec.Struct, frozen=True):
    """What a group must agree with to be trainable in this run; the wire checks above cannot know it.
    `vocab_size` None: unknown here (a buffer without the model folder), not checked.
    `needs_baseline`: the run's advantage estimator takes each group's greedy baseline (remax)."""

    vocab_size: int | None
    sampling: SamplingInfo
    max_tokens: int
    max_model_len: int
    needs_baseline: bool = False

    @classmethod
    def from_config(cls, cfg, vocab_size: int | None) -> RunLimits:
        from asyncrl.registry import ADVANTAGES  # the standard library only: reads the decorators' source
        from asyncrl.tasks.registry import has_environment  # the standard library only, until a task is asked

        g = cfg.generator
        # An episode's tokens after the prompt (turns and observations) are bounded by env.max_tokens
        # (0: the model length), not by one turn's generator.max_tokens.
        max_tokens = (cfg.env.max_tokens or g.max_model_len) if has_environment(cfg) else g.max_tokens
        return cls(vocab_size=vocab_size, sampling=SamplingInfo(float(g.temperature), float(g.top_p), int(g.top_k)),
                   max_tokens=max_tokens, max_model_len=g.max_model_len,
                   needs_baseline=bool(ADVANTAGES.static_meta(cfg.algorithm.advantage).get("greedy_baseline")))


def split_group_id(group_id: str) -> tuple[str, int] | None:
    """`{prompt_id}@e{epoch}` (how the buffer names each release) -> (prompt_id, epoch), else None."""
    prompt_id, sep, epoch = group_id.rpartition("@e")
    if not sep or not prompt_id or not epoch.isdigit():
        return None
    return prompt_id, int(epoch)


_LEASE_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")


def validate_for_run(group: TrajectoryGroup, limits: RunLimits) -> None:
    """Checks a well-formed group against the run (buffer at ingest, learner before training); raises
    FrameError. Why each: a token id past the vocabulary is an IndexError in the learner's gather;
    other sampling settings make every importance ratio silently wrong; a sequence past
    max_model_len is one no generator of this run can have produced; a group without the greedy
    baseline its estimator subtracts has no advantage (a generator of another config made it)."""
    parts = split_group_id(group.group_id)
    if parts is None or parts[0] != group.prompt_id:
        raise FrameError("bad_group_id", f"group_id {group.group_id!r} is not {group.prompt_id!r}@e<epoch>")
    s, want = group.sampling, limits.sampling
    if (s.temperature, s.top_p, s.top_k) != (want.temperature, want.top_p, want.top_k):
        raise FrameError("sampling_mismatch", f"sampled with temperature={s.temperature} top_p={s.top_p} "
                         f"top_k={s.top_k}, the run with temperature={want.temperature} top_p={want.top_p} "
                         f"top_k={want.top_k}")
    if group.lease_id and _LEASE_ID.fullmatch(group.lease_id) is None:
        raise FrameError("bad_lease_id", f"lease_id {group.lease_id[:40]!r} is not a stream entry id")
    if limits.needs_baseline and group.baseline_reward is None:
        raise FrameError("no_baseline", "algorithm.advantage needs the group's greedy baseline_reward; it has none")
    prompt = unpack_i32(group.prompt_ids)
    if len(prompt) >= limits.max_model_len:
        raise FrameError("too_long", f"prompt of {len(prompt)} tokens >= generator.max_model_len {limits.max_model_len}")
    vocab = limits.vocab_size
    if vocab is not None and int(prompt.max()) >= vocab:
        raise FrameError("token_id", f"prompt token id {int(prompt.max())} >= vocabulary size {vocab}")
    for i, sample in enumerate(group.samples):
        ids = unpack_i32(sample.completion_ids)
        if len(ids) > limits.max_tokens or len(prompt) + len(ids) > limits.max_model_len:
            raise FrameError("too_long", f"sample {i}: {len(prompt)} + {len(ids)} tokens, limits generator.max_tokens "
                             f"{limits.max_tokens} / generator.max_model_len {limits.max_model_len}")
        if vocab is not None and int(ids.max()) >= vocab:
            raise FrameError("token_id", f"sample {i} token id {int(ids.max())} >= vocabulary size {vocab}")


# ---- generator heartbeat ---------------------------------------------------------------------------


class Heartbeat(msgspec.Struct):
    """What a generator publishes about itself every `generator.heartbeat_s`, as the Redis hash
    `gen:{id}` with a TTL (generator.heartbeat_ttl_s): the learner forms weight groups from these
    and verifies the weights they report; metrics, status, the watchdog and the sampling check read
    them too (asyncrl/protocol/fleet.py `read_fleet`).

    A hash, not a frame, so that `redis-cli HGETALL` reads it: every value is a string there,
    `checksums` comma-joined. Every field but `id` has a default, so a heartbeat written by an older
    generator (or forged by a test with a few fields) parses; one without `schema_version` is
    version 1, which reported none."""

    id: str
    state: str = ""  # waiting_weights | generating | syncing | draining
    version: int = -1  # the policy version it holds; -1: none
    epoch: int = -1  # the weight-group epoch it is a member of; -1: none
    workers: int = 1  # vLLM workers, one weight-group member `{id}.{rank}` each
    tokens: int = 0  # completion tokens of the groups it pushed
    baseline_tokens: int = 0  # of the greedy completions behind algorithm.advantage=remax
    groups: int = 0
    tokens_per_s: float = 0.0  # over the last 30 s
    idle_ratio: float = 0.0
    idle_s: float = 0.0
    reward_errors: int = 0
    sync_s_total: float = 0.0
    last_pause_s: float = 0.0
    num_syncs: int = 0
    sampling_temperature: float | None = None  # asyncrl/protocol/sampling.py; None from a build that reports none
    sampling_top_p: float | None = None
    sampling_top_k: int | None = None
    checksums: list[int] = msgspec.field(default_factory=list)  # of the buckets of `version` it received
    pid: int | None = None
    host: str = ""
    node: str = ""  # hostname/boot id (asyncrl/protocol/fleet.py node_id): weights.backend=auto picks ipc on a shared node
    updated_at: float = 0.0  # wall-clock seconds
    schema_version: int = 1
    token_proof: str = ""  # asyncrl/protocol/security.py token_proof; empty in a run without a run token
    stall: str = ""  # its own stall report (asyncrl/observe/selfwatch.py): the STALL line; empty while it moves
    stall_what: str = ""
    stall_since: float = 0.0  # wall-clock seconds of its last progress, while stalled

    def to_hash(self) -> dict[str, str | int | float]:
        """The Redis hash mapping: unset optional fields are left out, checksums comma-joined."""
        out = {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}
        out["checksums"] = ",".join(map(str, self.checksums))
        if not self.token_proof:
            del out["token_proof"]
        return out

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> Heartbeat:
        """Parses one `HGETALL` reply; raises FrameError("heartbeat", ...) on a malformed one.
        Fields it does not know (from a newer generator) are ignored."""
        try:
            fields = {k.decode(): v.decode() for k, v in raw.items()}
            fields["checksums"] = [x for x in fields.get("checksums", "").split(",") if x]
            hb = msgspec.convert(fields, cls, strict=False)
        except (UnicodeDecodeError, msgspec.ValidationError) as e:
            raise FrameError("heartbeat", str(e)) from None
        if not hb.id:
            raise FrameError("heartbeat", "no id")
        return hb
