"""Reward scoring off the event loop: a slow reward (sleeping as a model or a remote check would, or
busy in pure Python) leaves the loop ticking, results and error counts stay those of score_group."""

import asyncio
import importlib
import threading
import time

from asyncrl.tasks.rewards import RewardPool, UserReward, score_group


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
        bound = 0.3 if fn is _slow_sleep else 1.0  # busy threads share the interpreter with the loop
        assert gap < bound, f"{fn.__name__}: the loop stood still {gap:.2f}s"

    async def on_the_loop():  # what scoring on the loop does: the ticker waits for all four samples
        return score_group(_reward(_slow_sleep), texts, "7", row)

    gap, _ = asyncio.run(_max_gap_while(on_the_loop))
    assert gap > 1.2


_running = {"now": 0, "most": 0}
_lock = threading.Lock()


def _counting(completion: str, answer: str, **row) -> float:
    with _lock:
        _running["now"] += 1
        _running["most"] = max(_running["most"], _running["now"])
    time.sleep(0.2)
    with _lock:
        _running["now"] -= 1
    return float(completion == answer)


def test_groups_beyond_the_workers_wait_their_turn():
    pool = RewardPool(_reward(_counting), workers=2)

    async def six_groups():
        return await asyncio.gather(*(pool.score(["7"], "7", {"group_id": f"g{i}"}) for i in range(6)))

    out = asyncio.run(six_groups())
    pool.shutdown()
    assert out == [([1.0], 0)] * 6
    loaded = importlib.import_module("tests.test_reward_pool")  # the copy reward.function imported
    assert loaded._running["most"] == 2  # never more than reward.workers at once, and both used
