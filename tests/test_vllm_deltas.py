"""generators/vllm_engine.py append_delta: vLLM's DELTA outputs become a sample's tokens, behaviour
log-probs and version stamps, including the shapes vLLM releases before 0.26 give an aborted request
(weights.mode=abort): a closing delta of no tokens that carries the request's whole log-prob history,
alone or merged by vLLM into the delta still waiting for the consumer."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.logprobs import FlatLogprobs, Logprob  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402

from generators.engines import SampleOut  # noqa: E402
from generators.vllm_engine import append_delta  # noqa: E402


def logprobs(kind: str, token_ids: list[int], values: list[float]):
    """The sampled token's log-prob at each position (SamplingParams.logprobs=0), as vLLM returns them."""
    positions = [{t: Logprob(logprob=v, rank=1)} for t, v in zip(token_ids, values, strict=True)]
    if kind == "list":
        return positions
    flat = FlatLogprobs()
    flat.extend(positions)
    return flat


def delta(kind: str, token_ids, history_ids, history_values, finish=None) -> CompletionOutput:
    """A delta of `token_ids` whose log-probs are vLLM's `history[-len(token_ids):]` (all of it for 0)."""
    n = len(token_ids)
    ids, values = (history_ids[-n:], history_values[-n:]) if n else (history_ids, history_values)
    return CompletionOutput(index=0, text="", token_ids=list(token_ids), cumulative_logprob=None,
                            logprobs=logprobs(kind, ids, values), finish_reason=finish)


@pytest.mark.parametrize("kind", ["flat", "list"])
def test_deltas_append_tokens_logprobs_and_versions(kind):
    s = SampleOut()
    append_delta(s, delta(kind, [7, 8], [7, 8], [-0.1, -0.2]), 3)
    append_delta(s, delta(kind, [9], [7, 8, 9], [-0.1, -0.2, -0.3], finish="length"), 4)
    assert s.token_ids == [7, 8, 9] and s.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert s.versions == [3, 3, 4] and s.finish_reason == "length"


@pytest.mark.parametrize("kind", ["flat", "list"])
def test_an_aborts_empty_delta_with_the_whole_history_adds_nothing(kind):
    s = SampleOut()
    append_delta(s, delta(kind, [7, 8], [7, 8], [-0.1, -0.2]), 0)
    append_delta(s, delta(kind, [], [7, 8], [-0.1, -0.2], finish="abort"), 0)
    assert s.token_ids == [7, 8] and s.logprobs == pytest.approx([-0.1, -0.2]) and s.versions == [0, 0]
    assert s.finish_reason == "abort"


@pytest.mark.parametrize("kind", ["flat", "list"])
def test_an_abort_merged_into_the_pending_delta_keeps_the_deltas_own_logprobs(kind):
    """vLLM's own merge (RequestOutput.add, aggregate=True) of a pending delta and the abort's."""
    ids, values = [7, 8, 9, 10], [-0.1, -0.2, -0.3, -0.4]
    s = SampleOut()
    append_delta(s, delta(kind, ids[:2], ids[:2], values[:2]), 0)
    pending = RequestOutput("r", None, [1, 2], None, [delta(kind, ids[2:], ids, values)], finished=False)
    pending.add(RequestOutput("r", None, [1, 2], None, [delta(kind, [], ids, values, finish="abort")],
                              finished=True), aggregate=True)
    merged = pending.outputs[0]
    assert list(merged.token_ids) == [9, 10] and len(merged.logprobs) == 6  # 2 of its own, then the history
    append_delta(s, merged, 0)
    assert s.token_ids == ids and s.logprobs == pytest.approx(values) and s.versions == [0] * 4
    assert s.finish_reason == "abort"
