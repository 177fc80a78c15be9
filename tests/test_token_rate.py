"""The fleet's generated tokens/s: a rate over a sliding window of wall time from published counters."""

from __future__ import annotations

from asyncrl.observe.metrics import FleetTokenRate, WindowRate


def test_groups_longer_than_a_step_still_give_the_rate():
    # One generator finishing a 400-token group every 4 s; the learner steps every second. A rate
    # over the last heartbeat interval reads 0 on three steps of four; the window does not.
    rate = FleetTokenRate(start=0.0, window_s=8.0)
    seen = []
    for t in range(1, 17):
        tokens = 400.0 * (t // 4)
        seen.append(rate.update({"g0": tokens}, float(t)))
    assert all(r > 0 for r in seen[3:])
    assert abs(seen[-1] - (1600 - 800) / 8) < 1e-9  # tokens of the last 8 s / 8 s
    assert abs(seen[3] - 400 / 4) < 1e-9  # before a full window: since the start


def test_fleet_sum_joins_and_restarts():
    rate = FleetTokenRate(start=0.0, window_s=100.0)
    assert rate.update({"g0": 100.0}, 10.0) == 10.0
    # g1 appears with 50 tokens (it started after the last update): counted whole.
    assert rate.update({"g0": 200.0, "g1": 50.0}, 20.0) == 250.0 / 20.0
    # g0 restarted (its counter went down): its 30 new tokens count, not -170.
    assert rate.update({"g0": 30.0, "g1": 50.0}, 30.0) == 280.0 / 30.0
    # g1's heartbeat expired for a moment and came back: nothing counted twice.
    rate.update({"g0": 30.0}, 40.0)
    assert rate.update({"g0": 30.0, "g1": 60.0}, 50.0) == 290.0 / 50.0
    assert FleetTokenRate(start=5.0).update({}, 5.0) == 0.0


def test_one_short_step_is_no_spike():
    # 1000 tokens a step; steps take 1 s except one of 0.05 s. Per step time that step reads 20,000
    # tokens/s, 20x its neighbours; over a window of wall time it stays near 1,000.
    rate, now, seen = WindowRate(start=0.0, window_s=5.0), 0.0, []
    for i in range(12):
        now += 0.05 if i == 8 else 1.0
        seen.append(rate.add(1000.0, now))
    assert max(seen[5:]) / min(seen[5:]) < 1.3
    assert abs(seen[-1] - 6000.0 / (now - 6.0)) < 1e-6  # left edge: the newest sample >= 5 s old (t=6)
