"""A Ray job the cluster cannot hold stops at once with one line saying what it needs and what the
cluster has, instead of waiting for its last placement group forever (the shortfall's wording here;
the submission on a real Ray head in tests/test_deploy_ray.py)."""

from __future__ import annotations

from asyncrl.launch.deploy_ray import shortfall


def test_shortfall_names_what_the_run_needs_and_what_the_cluster_has():
    assert shortfall({"CPU": 2.0, "GPU": 0.0}, {"CPU": 2.0}) is None
    assert shortfall({"CPU": 3.0, "GPU": 0.0}, {"CPU": 2.0}) == "the run needs CPU=3; the cluster has CPU=2 GPU=0"
    assert shortfall({"CPU": 1.0, "GPU": 4.0}, {"CPU": 8.0, "GPU": 2.0}) == \
        "the run needs CPU=1 GPU=4; the cluster has CPU=8 GPU=2"
