"""Shared fixtures: a real redis-server per test, a tiny model per session, config factories."""

from __future__ import annotations

import os
import shutil

import pytest

from asyncrl.config import load_config
from asyncrl.launch.redis_server import LocalRedis

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def redis_server(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is required (apt-get install -y redis-server)")
    server = LocalRedis(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from asyncrl.tools.tiny_model import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0, warm_start_steps=30))


@pytest.fixture
def make_cfg(tmp_path, tiny_model):
    def make(*overrides, redis=None):
        base = [f"run.dir={tmp_path / 'runs'}", f"model.path={tiny_model}"]
        if redis is not None:
            base.append(f"buffer.redis_url={redis.url}")
        return load_config(None, base + list(overrides))

    return make


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip, with the reason, where torch sees no CUDA device."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if not torch.cuda.is_available():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)"))
