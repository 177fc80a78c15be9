"""The private torch APIs behind asyncrl/protocol/torch_private.py: all present in the installed torch, and
each call still works through its public fallback when its private name is gone."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from asyncrl.protocol import torch_private, weight_sync


def test_every_private_api_used_is_in_the_installed_torch():
    assert torch_private.problems() == [], (torch.__version__, torch_private.problems())


def _broadcast_works(pg) -> bool:
    t = torch.arange(4, dtype=torch.float32)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([t], opts).wait()
    return t.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("without", [False, True])
def test_gloo_group_with_and_without_the_private_options(monkeypatch, caplog, without):
    if without:
        monkeypatch.setattr(dist.ProcessGroupGloo, "_Options", None)
    with caplog.at_level(logging.WARNING, logger="asyncrl.protocol.torch_private"):
        pg = torch_private.gloo_group(dist.HashStore(), 0, 1, timedelta(seconds=30), threads=3)
    assert _broadcast_works(pg)
    assert ("_Options" in caplog.text) is without, caplog.text


def test_storage_use_count_counts_views_and_reuse_stops_without_it(monkeypatch):
    base = torch.empty(64, dtype=torch.uint8)
    assert torch_private.storage_use_count(base) == 2  # `base` and the temporary storage object
    assert weight_sync._unshared(base)
    view = base[:8]
    assert torch_private.storage_use_count(base) == 3 and not weight_sync._unshared(base)
    del view
    assert weight_sync._unshared(base)
    monkeypatch.setattr(torch._C, "_storage_Use_Count", None)
    assert torch_private.storage_use_count(base) is None
    assert not weight_sync._unshared(base)  # without a count nothing is reused


@pytest.mark.parametrize("without", [False, True])
def test_foreach_norm_and_scale_match_the_per_tensor_result(monkeypatch, without):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g, dtype=torch.float64) for n in (1, 7, 300)]
    expected_norms = [t.norm(2).item() for t in tensors]
    scaled = [t * 0.25 for t in tensors]
    if without:
        monkeypatch.setattr(torch, "_foreach_norm", None)
        monkeypatch.setattr(torch, "_foreach_mul_", None)
    norms = torch_private.foreach_norm(tensors, 2.0)
    assert [n.item() for n in norms] == pytest.approx(expected_norms, rel=1e-12)
    torch_private.foreach_mul_(tensors, torch.tensor(0.25, dtype=torch.float64))
    for got, want in zip(tensors, scaled, strict=True):
        assert torch.equal(got, want)


def test_version_note_names_an_untested_release(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "9.9.0+cpu")
    assert "9.9.0" in torch_private.version_note()
    monkeypatch.setattr(torch, "__version__", f"{torch_private.TESTED[-1]}.0+cpu")
    assert torch_private.version_note() is None
