"""The generation engine interface (`Engine`, a typing.Protocol) and what it returns. The backends,
`vllm` (generators/vllm_engine.py) and `hf` (generators/hf_engine.py), are chosen by
`generator.backend` in generators/backends.py.

The generator process (generators/main.py and the parts it ties) uses nothing of an engine beyond this interface.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypedDict, runtime_checkable


@dataclass
class SampleOut:
    """One completion: its tokens, the behaviour log-prob of each, the policy version each was
    sampled under, and why it ended ("stop", "length"; "abort" only inside an engine)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""


class WeightUpdateStats(TypedDict, total=False):
    pause_s: float  # generation paused for the update (the whole call for the HF backend)
    wait_s: float  # of which waiting for in-flight work to reach a safe point (drain: to finish)
    receive_s: float  # receiving and loading the tensors
    load_s: float
    stage_s: float  # vLLM staged receive: the transfer before the pause
    checksums: list[int]  # one per bucket, compared by the learner with what it sent
    wake_s: float  # vLLM sleep mode: waking the engine before the load
    handle_s: float  # ipc, within receive_s: waiting for the learner's buffer handle (and opening it)
    checksum_s: float  # ipc, within receive_s: the checksums of the learner's buffer on the device
    finish_s: float  # ipc, within receive_s: the device finishing its reads, and the confirmation
    load_path: str  # vLLM: "direct" (one copy per tensor, generators/direct_load.py) or "reload"


@runtime_checkable
class Engine(Protocol):
    num_workers: int  # worker processes (tensor-parallel ranks) that take part in the weight group

    async def generate_group(self, prompt_ids: list[int], n: int, version: Callable[[], int],
                             temperature: float | None = None, max_tokens: int | None = None) -> list[SampleOut]:
        """`n` completions of one prompt; each token stamped with `version()` at the time it was sampled.
        `temperature` None: generator.temperature; 0.0: greedy (evaluation, advantage=remax's baselines).
        `max_tokens` None: generator.max_tokens (an episode's turn asks for what its budget has left)."""
        ...

    async def join(self, epoch_frame: bytes, generator_id: str, timeout_s: float) -> bool:
        """Joins the learner's weight group of this epoch (a schema.GroupEpoch frame)."""
        ...

    async def update_weights(self, announcement_frame: bytes, mode: str, timeout_s: float) -> WeightUpdateStats:
        """Receives the announced version (a schema.WeightAnnouncement frame) and loads it; `mode`
        (weights.mode) says what in-flight sequences do: keep, abort or drain."""
        ...

    async def idle(self) -> None:
        """run.mode=sync: the generator has nothing to do until the next weights (generator.sleep)."""
        ...

    def shutdown(self) -> None:
        ...
