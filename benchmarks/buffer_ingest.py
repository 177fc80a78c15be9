"""Buffer ingest throughput: ZeroMQ -> decode + validation -> atomic dedupe + XADD to Redis, next to
`redis-benchmark` (pipelined XADD / SET of the same number of bytes) on the same redis-server, same run.

    python benchmarks/buffer_ingest.py [--out runs/bench/buffer_ingest.json] [--tokens 128 1024 8192]

Payloads: one TrajectoryGroup of 8 samples x T tokens (int32 ids, float32 log-probs, int32 versions).
Ours: a pusher process sends pre-encoded frames as fast as ZeroMQ takes them; this process runs the
real `BufferService.ingest()` until every group is in the stream. Timed from the first group
ingested to the last. The redis-server has AOF on (appendfsync everysec), as in a run.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import multiprocessing as mp
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.config import load_config  # noqa: E402
from asyncrl.launch.redis_server import LocalRedis  # noqa: E402
from asyncrl.protocol import schema

NUM_GROUPS = {128: 4000, 1024: 1500, 8192: 150}
MAX_ARG = 120_000  # Linux caps one command-line argument at 128 KiB: larger payloads use SET -d


def make_frame(group_id: str, num_tokens: int, num_samples: int = 8) -> bytes:
    samples = [schema.Sample(completion_ids=schema.pack_i32([(7 * i + j) % 50_000 for j in range(num_tokens)]),
                             logprobs=schema.pack_f32([-0.25] * num_tokens), versions=schema.pack_i32([3] * num_tokens),
                             reward=0.5, finish_reason="length") for i in range(num_samples)]
    return schema.encode(schema.TrajectoryGroup(
        schema_version=schema.SCHEMA_VERSION, group_id=group_id, prompt_id=group_id.split("@")[0],
        generator_id="bench", prompt_ids=schema.pack_i32(list(range(64))), samples=samples,
        sampling=schema.SamplingInfo(1.0, 1.0, -1), created_at=time.time()))


def _pusher(addr: str, num_tokens: int, num: int, tag: str) -> None:
    import zmq

    frames = [make_frame(f"{tag}-{i}@e0", num_tokens) for i in range(num)]
    s = zmq.Context().socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 256)
    s.setsockopt(zmq.LINGER, -1)
    s.connect(addr)
    for f in frames:
        s.send(f, copy=False)
    s.close()


def bench_ours(redis: LocalRedis, num_tokens: int, num: int, run_dir: str) -> dict:
    from buffers.service import BufferService

    cfg = load_config(None, [f"run.dir={run_dir}", f"run.name=bench{num_tokens}", f"buffer.redis_url={redis.url}",
                             f"buffer.capacity={num + 1}", f"generator.max_tokens={num_tokens}",
                             f"generator.max_model_len={num_tokens + 65}", "buffer.check_released=false",  # synthetic ids
                             "model.path=/nonexistent"])
    svc = BufferService(cfg)
    svc.setup()
    frame_bytes = len(make_frame("x@e0", num_tokens))
    proc = mp.get_context("spawn").Process(target=_pusher, args=(svc.ingest_addr, num_tokens, num, f"t{num_tokens}"))
    proc.start()
    t0 = None
    while svc.counters.get("groups", 0) < num:
        added = svc.ingest(max_frames=256, timeout_ms=100)
        if added and t0 is None:
            t0 = time.perf_counter()
            first = added
    dt = time.perf_counter() - t0
    proc.join()
    assert svc.client.xlen(svc.keys.trajectories) == num and not any(k.startswith("reject") for k in svc.counters)
    # The first batch landed at t0: rate over the remaining groups.
    groups = num - first
    svc.sock.close(0)
    redis_client = svc.client
    redis_client.flushall()
    return {"groups_per_s": groups / dt, "mb_per_s": groups * frame_bytes / dt / 1e6, "frame_bytes": frame_bytes}


def redis_benchmark(redis: LocalRedis, command: list[str], num: int, size: int) -> dict:
    out = subprocess.run(["redis-benchmark", "-h", "127.0.0.1", "-p", str(redis.port), "-P", "16", "-n", str(num),
                          "--csv", *command], capture_output=True, text=True, check=True).stdout
    rows = list(csv.reader(io.StringIO(out)))
    rps = float(rows[-1][1])
    subprocess.run(["redis-cli", "-p", str(redis.port), "flushall"], capture_output=True, check=True)
    return {"ops_per_s": rps, "mb_per_s": rps * size / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 8192])
    ap.add_argument("--out", default="runs/bench/buffer_ingest.json")
    args = ap.parse_args()
    if shutil.which("redis-benchmark") is None:
        raise SystemExit("redis-benchmark not found (Debian: apt-get install -y redis-tools)")
    results = []
    with tempfile.TemporaryDirectory() as tmp, LocalRedis(Path(tmp) / "redis", appendfsync="everysec") as redis:
        for t in args.tokens:
            num = NUM_GROUPS.get(t, 500)
            ours = bench_ours(redis, t, num, tmp)
            size = ours["frame_bytes"]
            setb = redis_benchmark(redis, ["-t", "set", "-d", str(size)], num, size)
            row = {"tokens": t, "samples": 8, "frame_bytes": size, "groups": num, "ours_groups_per_s": ours["groups_per_s"],
                   "ours_mb_per_s": ours["mb_per_s"], "set_mb_per_s": setb["mb_per_s"]}
            if size <= MAX_ARG:
                payload = "x" * size
                xadd = redis_benchmark(redis, ["xadd", "bench:stream", "*", "data", payload], num, size)
                row["xadd_mb_per_s"] = xadd["mb_per_s"]
            raw = row.get("xadd_mb_per_s", row["set_mb_per_s"])
            row["raw_mb_per_s"], row["ratio"] = raw, row["ours_mb_per_s"] / raw
            results.append(row)
    print(f"{'tokens':>6} {'frame kB':>9} {'ours groups/s':>14} {'ours MB/s':>10} {'XADD MB/s':>10} {'SET MB/s':>9} "
          f"{'ours/raw':>8}")
    for r in results:
        xadd = f"{r['xadd_mb_per_s']:10.1f}" if "xadd_mb_per_s" in r else f"{'n/a':>10}"
        print(f"{r['tokens']:6d} {r['frame_bytes'] / 1e3:9.1f} {r['ours_groups_per_s']:14.1f} {r['ours_mb_per_s']:10.1f} "
              f"{xadd} {r['set_mb_per_s']:9.1f} {r['ratio']:8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
                               "cpus": mp.cpu_count(), "command": " ".join(sys.argv), "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
