"""Malformed frames through the real socket (each kind counted by reason, the service never stops),
and property-based fuzzing of the decoder + validation: nothing but FrameError, ever."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.protocol import schema
from tests.buffer_support import buffer_cfg, push, start_thread, stream_group_ids, wait_for
from tests.helpers import make_group

MAX_FRAME = 64 * 1024
MAX_TOKENS = 16


def _raw(**changes) -> bytes:
    """A valid group as a plain msgpack map with `changes` applied (dotted: 'samples.0.reward')."""
    d = msgspec.msgpack.decode(schema.encode(make_group("bad@e0")))
    for path, value in changes.items():
        try:
            node, parts = d, path.split(".")
            for p in parts[:-1]:
                node = node[int(p)] if isinstance(node, list) else node[p]
            last = parts[-1]
            if value is _DELETE:
                del node[last]
            elif isinstance(node, list):
                node[int(last)] = value
            else:
                node[last] = value
        except (KeyError, IndexError, TypeError, ValueError):
            continue  # an earlier change removed this path (fuzzing only): nothing to replace
    return msgspec.msgpack.encode(d)


_DELETE = object()
NAN = float("nan")

MALFORMED = {
    "decode": [b"\xc1 is never valid msgpack" * 10, schema.encode(make_group("t@e0"))[:-7], b""],
    "schema": [_raw(group_id=17), _raw(type="prompt_task"), _raw(samples="nope"), _raw(prompt_ids=_DELETE),
               _raw(**{"samples.0.reward": "high"}), msgspec.msgpack.encode([1, 2, 3])],
    "schema_version": [_raw(schema_version=99)],
    "length_mismatch": [_raw(**{"samples.0.logprobs": schema.pack_f32([-0.1])})],
    "bad_array": [_raw(**{"samples.1.versions": b"\x00\x00\x00"}), _raw(prompt_ids=b""),
                  _raw(**{"samples.0.versions": schema.pack_i32([0, -1, 0])}),
                  _raw(prompt_ids=schema.pack_i32([5, -3]))],
    "bad_logprob": [_raw(**{"samples.0.logprobs": schema.pack_f32([-0.5, NAN, -0.5])}),
                    _raw(**{"samples.2.logprobs": schema.pack_f32([-0.5, 0.7, -0.5])}),
                    _raw(**{"samples.3.logprobs": schema.pack_f32([float("-inf"), -1, -1])})],
    "empty_sample": [_raw(**{"samples.0.completion_ids": b"", "samples.0.logprobs": b"", "samples.0.versions": b""})],
    "no_samples": [_raw(samples=[])],
    "empty_id": [_raw(group_id="")],
    "bad_id": [_raw(group_id="x" * 600)],
    "too_long": [schema.encode(make_group("long@e0", num_tokens=MAX_TOKENS + 1))],
    "too_large": [schema.encode(make_group("huge@e0", num_samples=64, num_tokens=200))],
    "bad_reward": [_raw(**{"samples.0.reward": float("inf")})],
    "bad_sampling": [_raw(sampling={"temperature": 0.0, "top_p": 1.0, "top_k": -1}),
                     _raw(sampling={"temperature": 1.0, "top_p": 1.5, "top_k": -1})],
    "bad_timestamp": [_raw(created_at=NAN)],
    "bad_count": [_raw(reward_errors=-1)],
}


def _cfg(tmp_path, redis, name):
    return buffer_cfg(tmp_path, redis, f"run.name={name}", f"buffer.max_frame_bytes={MAX_FRAME}",
                      f"generator.max_tokens={MAX_TOKENS}")


def test_every_kind_of_malformed_frame_is_counted_by_reason(tmp_path, redis_server):
    assert len(MALFORMED) >= 10
    assert len(MALFORMED["too_large"][0]) > MAX_FRAME
    svc, t = start_thread(_cfg(tmp_path, redis_server, "malformed"))
    try:
        frames = [f for fs in MALFORMED.values() for f in fs]
        good = [schema.encode(make_group(f"ok{i}@e0")) for i in range(3)]
        push(svc.ingest_addr, frames[:10] + good + frames[10:])
        assert wait_for(lambda: svc.counters.get("frames", 0) == len(frames) + 3)
        assert t.is_alive(), "a bad frame must never stop the service"
        rejects = {k[len("reject:"):]: v for k, v in svc.counters.items() if k.startswith("reject:")}
        assert rejects == {reason: len(fs) for reason, fs in MALFORMED.items()}
        assert sorted(stream_group_ids(svc.client, svc.keys)) == ["ok0@e0", "ok1@e0", "ok2@e0"]
        svc.publish_metrics()
        for reason, fs in MALFORMED.items():
            assert int(svc.client.hget(svc.keys.metrics, f"buffer:reject:{reason}")) == len(fs)
    finally:
        svc.stop()
        t.join(10)


def _check(frame: bytes) -> None:
    """The property: a frame either decodes to a valid group or raises FrameError; nothing else."""
    try:
        group = schema.decode(frame, schema.TrajectoryGroup, MAX_FRAME, max_tokens=MAX_TOKENS)
    except schema.FrameError as e:
        assert e.reason
        return
    schema.validate_group(group, max_tokens=MAX_TOKENS)  # what decoded is valid, by construction
    assert group.min_version() >= 0


VALID = [schema.encode(make_group(f"v{i}@e0", num_samples=1 + i % 4, num_tokens=1 + i % 5)) for i in range(8)]
FUZZ = settings(max_examples=1500, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(st.binary(max_size=4096))
def test_fuzz_random_bytes(data):
    _check(data)


@FUZZ
@given(st.sampled_from(VALID), st.lists(st.tuples(st.sampled_from(["flip", "cut", "insert", "delete"]),
                                                  st.integers(0, 10_000), st.integers(0, 255)), min_size=1,
                                        max_size=8))
def test_fuzz_mutated_valid_frames(frame, edits):
    buf = bytearray(frame)
    for op, pos, byte in edits:
        pos %= max(len(buf), 1)
        if op == "flip" and buf:
            buf[pos] ^= 1 << (byte % 8)
        elif op == "cut":
            del buf[pos:]
        elif op == "insert":
            buf.insert(pos, byte)
        elif op == "delete" and buf:
            del buf[pos]
    _check(bytes(buf))


MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
FIELDS = ["schema_version", "group_id", "prompt_id", "generator_id", "prompt_ids", "samples", "sampling",
          "created_at", "reward_errors", "type", "samples.0.completion_ids", "samples.0.logprobs",
          "samples.0.versions", "samples.0.reward", "samples.1.finish_reason", "samples.0", "sampling.top_k",
          "sampling.temperature"]


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(FIELDS), MSGPACK_VALUES), min_size=1, max_size=4))
def test_fuzz_structured_field_replacements(changes):
    _check(_raw(**dict(changes)))


@pytest.mark.parametrize("seed", [0])
def test_socket_fuzz_of_hundreds_of_frames_to_the_running_service(tmp_path, redis_server, seed):
    rng = random.Random(seed)
    frames = []
    for i in range(400):
        base = bytearray(schema.encode(make_group(f"fz{i % 150}@e0", num_tokens=1 + i % 6)))
        kind = rng.random()
        if kind < 0.3:
            pass  # valid (some ids repeat: duplicates)
        elif kind < 0.6:
            for _ in range(rng.randint(1, 6)):
                base[rng.randrange(len(base))] = rng.randrange(256)
        elif kind < 0.8:
            del base[rng.randrange(len(base)):]
        else:
            base = bytearray(rng.randbytes(rng.randint(0, 3000)))
        frames.append(bytes(base))
    svc, t = start_thread(_cfg(tmp_path, redis_server, "sockfuzz"))
    try:
        push(svc.ingest_addr, frames)
        assert wait_for(lambda: svc.counters.get("frames", 0) == len(frames), 30)
        assert t.is_alive()
        rejects = sum(v for k, v in svc.counters.items() if k.startswith("reject:"))
        added, dupes = svc.counters.get("groups", 0), svc.counters.get("dedupes", 0)
        assert rejects + added + dupes == len(frames)
        ids = stream_group_ids(svc.client, svc.keys)
        assert len(ids) == len(set(ids)) == added
        assert 0 < added and 0 < rejects
    finally:
        svc.stop()
        t.join(10)
