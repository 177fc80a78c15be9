import msgspec
import pytest

from asyncrl.protocol import schema
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


def test_a_frame_of_another_schema_version_left_in_redis_stops_a_resume_with_a_clear_error():
    """learners/trainer.py reads the last epoch and the unacked trajectories back on a resume; frames
    written by another asyncrl (schema version 1) give an error that says what to do, not a crash."""
    from learners.trainer import _decode_stored

    group = make_group()
    assert _decode_stored(schema.encode(group), schema.TrajectoryGroup, "a group") == group
    group.schema_version = 1
    with pytest.raises(RuntimeError, match="another schema version .* resume it with that one, or start a new run"):
        _decode_stored(schema.encode(group), schema.TrajectoryGroup, "an unacked trajectory group")
    group.schema_version = schema.SCHEMA_VERSION
    group.samples = []
    with pytest.raises(schema.FrameError):  # any other bad frame is not a version question
        _decode_stored(schema.encode(group), schema.TrajectoryGroup, "a group")
