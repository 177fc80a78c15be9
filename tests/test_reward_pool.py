"""Reward scoring off the event loop: a slow reward (sleeping as a model or a remote check would, or
busy in pure Python) leaves the loop ticking, results and error counts stay those of score_group."""

import asyncio
import time

from asyncrl.rewards import RewardPool, UserReward, score_group


def _slow_sleep(completion: str, answer: str, **row) -> float:
    time.sleep(0.4)
    if completion == "boom":
        raise ValueError("bad sample")
    return float(completion == answer)


def _slow_python(completion: str, answer: str, **row) -> float:
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.4:
        n += 1
    return float(completion == answer)


async def _max_gap_while(score) -> tuple[float, object]:
    """Runs `score()` beside a 10 ms ticker; returns the ticker's longest gap and the score."""
    gaps, done = [], asyncio.Event()

    async def ticker():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    result = await score()
    done.set()
    await tick
    return max(gaps), result


def _reward(fn):
    return UserReward(f"tests.test_reward_pool:{fn.__name__}")  # as reward.function loads it


def test_a_slow_reward_does_not_stall_the_loop():
    texts, row = ["7", "boom", "8", "7"], {"prompt": "3+4", "prompt_id": "p", "group_id": "g"}
    for fn in (_slow_sleep, _slow_python):
        reward = _reward(fn)
        pool = RewardPool(reward, workers=2)
        gap, (rewards, errors) = asyncio.run(_max_gap_while(lambda p=pool: p.score(texts, "7", row)))
        pool.shutdown()
        want = score_group(reward, texts, "7", row)
        assert (rewards, errors) == want and want[1] == (1 if fn is _slow_sleep else 0), fn.__name__
        assert gap < 0.3, f"{fn.__name__}: the loop stood still {gap:.2f}s"

    async def on_the_loop():  # what scoring on the loop does: the ticker waits for all four samples
        return score_group(_reward(_slow_sleep), texts, "7", row)

    gap, _ = asyncio.run(_max_gap_while(on_the_loop))
    assert gap > 1.2


def test_groups_beyond_the_workers_wait_their_turn():
    pool = RewardPool(_reward(_slow_sleep), workers=2)

    async def four_groups():
        t0 = time.perf_counter()
        out = await asyncio.gather(*(pool.score(["7"], "7", {"group_id": f"g{i}"}) for i in range(4)))
        return time.perf_counter() - t0, out

    seconds, out = asyncio.run(four_groups())
    pool.shutdown()
    assert out == [([1.0], 0)] * 4
    assert 0.75 < seconds < 1.6  # two at a time: two rounds of 0.4 s
