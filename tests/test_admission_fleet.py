"""Admission counts from the weights the fleet holds: while a generator still holds the version
before the learner's, the buffer releases one step's worth less, so no released group can be
trained past the staleness bound. A real redis-server and the buffer service's release path."""

from __future__ import annotations

from asyncrl.keys import Keys
from asyncrl.store import ensure_groups
from buffers.service import BufferService, admission_budget, fleet_behind
from tests.buffer_support import buffer_cfg


def _service(tmp_path, redis_server, *overrides) -> BufferService:
    cfg = buffer_cfg(tmp_path, redis_server, "run.name=fleet", "learner.batch_groups=4", *overrides)
    svc = BufferService(cfg)
    ensure_groups(svc.client, svc.keys)  # what setup() does before the ingest socket
    svc.client.hset(svc.keys.cursor, mapping={"epoch": 0, "index": 0, "released": 0})
    return svc


def _released(svc: BufferService) -> int:
    return svc.client.xlen(svc.keys.prompts)


def test_a_generator_one_version_behind_holds_back_one_step(tmp_path, redis_server):
    svc = _service(tmp_path, redis_server, "algorithm.max_staleness=1", "buffer.prompt_backlog=1000")
    keys = Keys("fleet")
    client = svc.client
    client.set(keys.version, 3)
    client.hset(keys.gen("g0"), mapping={"id": "g0", "version": 3})
    client.hset(keys.gen("g1"), mapping={"id": "g1", "version": 2})  # its sync of version 3 is still out
    assert fleet_behind(client, keys, 3)
    svc.release_prompts()
    assert _released(svc) == admission_budget(2, 1, 4, 0) == 16
    client.hset(keys.gen("g1"), "version", 3)  # the sync landed
    assert not fleet_behind(client, keys, 3)
    svc.release_prompts()
    assert _released(svc) == admission_budget(3, 1, 4, 0) == 20


def test_a_generator_far_behind_or_without_weights_does_not_starve_the_pipe(tmp_path, redis_server):
    svc = _service(tmp_path, redis_server, "algorithm.max_staleness=1", "buffer.prompt_backlog=1000")
    keys = Keys("fleet")
    svc.client.set(keys.version, 5)
    svc.client.hset(keys.gen("stuck"), mapping={"id": "stuck", "version": 1})
    svc.client.hset(keys.gen("new"), mapping={"id": "new", "version": -1})
    assert not fleet_behind(svc.client, keys, 5)
    svc.release_prompts()
    assert _released(svc) == admission_budget(5, 1, 4, 0)


def test_sync_mode_releases_exactly_one_batch_per_version_whatever_the_fleet_holds(tmp_path, redis_server):
    svc = _service(tmp_path, redis_server, "run.mode=sync", "buffer.prompt_backlog=1000")
    keys = Keys("fleet")
    svc.client.set(keys.version, 2)
    svc.client.hset(keys.gen("g0"), mapping={"id": "g0", "version": 1})
    svc.release_prompts()
    assert _released(svc) == admission_budget(2, 0, 4, 0) == 12
