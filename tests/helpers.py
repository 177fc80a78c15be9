"""Small builders shared by tests (not fixtures)."""

import time

from asyncrl import schema


def make_group(group_id="p0@e0", num_samples=4, num_tokens=3, version=0, reward=0.5, generator_id="gt"):
    samples = [
        schema.Sample(completion_ids=schema.pack_i32([5 + i] * num_tokens),
                      logprobs=schema.pack_f32([-0.5] * num_tokens),
                      versions=schema.pack_i32([version] * num_tokens), reward=reward + 0.1 * i,
                      finish_reason="length")
        for i in range(num_samples)
    ]
    return schema.TrajectoryGroup(schema_version=schema.SCHEMA_VERSION, group_id=group_id,
                                  prompt_id=group_id.split("@")[0], generator_id=generator_id,
                                  prompt_ids=schema.pack_i32([13, 14, 83]), samples=samples,
                                  sampling=schema.SamplingInfo(1.0, 1.0, -1), created_at=time.time())
