import msgspec
import pytest

from asyncrl import schema
from tests.helpers import make_group


def test_roundtrip_and_packed_arrays():
    g = make_group()
    frame = schema.encode(g)
    back = schema.decode(frame, schema.TrajectoryGroup)
    assert back == g
    assert list(schema.unpack_i32(back.samples[0].versions)) == [0, 0, 0]
    assert isinstance(back.samples[0].completion_ids, bytes)


@pytest.mark.parametrize("mutate,reason", [
    (lambda g: setattr(g.samples[0], "versions", b"\x00\x00\x00"), "bad_array"),
    (lambda g: setattr(g.samples[1], "logprobs", schema.pack_f32([-1.0])), "length_mismatch"),
    (lambda g: setattr(g.samples[0], "logprobs", schema.pack_f32([0.5, -1, -1])), "bad_logprob"),
    (lambda g: setattr(g.samples[0], "reward", float("nan")), "bad_reward"),
    (lambda g: setattr(g, "samples", []), "no_samples"),
    (lambda g: setattr(g, "group_id", ""), "empty_id"),
    (lambda g: setattr(g, "schema_version", 99), "schema_version"),
])
def test_invalid_groups_are_rejected_with_a_reason(mutate, reason):
    g = make_group()
    mutate(g)
    with pytest.raises(schema.FrameError) as e:
        schema.decode(schema.encode(g), schema.TrajectoryGroup)
    assert e.value.reason == reason


def test_wrong_types_and_oversize_frames():
    with pytest.raises(schema.FrameError) as e:
        schema.decode(msgspec.msgpack.encode({"type": "trajectory_group", "group_id": 3}), schema.TrajectoryGroup)
    assert e.value.reason == "schema"
    with pytest.raises(schema.FrameError) as e:
        schema.decode(b"x" * 100, schema.TrajectoryGroup, max_bytes=10)
    assert e.value.reason == "too_large"
