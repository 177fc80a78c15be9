"""Weight push over the project's weight group vs a raw gloo broadcast of the same bytes, same run.

    python benchmarks/weight_sync.py --out runs/weight_sync.json [--sizes 10,100,500] [--receivers 1,2,3]

For each model size (millions of fp32 parameters, in transformer-like tensors) and receiver count:
  ours = group epoch already open; announcement planned; FSDP-free gather stand-in (the tensors are
         already full); pack into `--bucket-mb` buckets; broadcast bucket by bucket; receivers
         consume named views (what the vLLM worker extension hands to reload_weights);
  raw  = one ProcessGroupGloo broadcast of a single flat uint8 buffer of the same total size.
Both use the same gloo process group type on the same sockets, so the ratio isolates our overhead
(planning, packing copies, per-bucket round trips, views).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def tensors_for(millions: int) -> dict[str, torch.Tensor]:
    """Square-ish weight matrices of 4M params (2048 x 2048) plus a remainder vector."""
    total = millions * 1_000_000
    out, i = {}, 0
    while total >= 2048 * 2048:
        out[f"layers.{i}.weight"] = torch.empty(2048, 2048).uniform_()
        total -= 2048 * 2048
        i += 1
    if total:
        out["tail.bias"] = torch.empty(total).uniform_()
    return out


def receiver(rank: int, world: int, port: int, epochs, anns, done):
    from asyncrl.weight_sync import WeightReceiver, new_group

    recv = WeightReceiver(f"r{rank}")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    raw_pg = None
    while True:
        job = anns.get()
        if job is None:
            return
        kind, payload = job
        if kind == "raw":
            nbytes, tag = payload
            if raw_pg is None or raw_pg[0] != world:
                raw_pg = (world, new_group(dist.PrefixStore(f"raw/{tag}", store), rank, world, "gloo", 300))
            buf = torch.empty(nbytes, dtype=torch.uint8)
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            raw_pg[1].broadcast([buf], opts).wait()
            done.put(rank)
        elif kind == "join":
            assert recv.join(payload, 120)
            done.put(rank)
        elif kind == "ours":
            consumed = 0
            for _, view in recv.receive(payload, torch.device("cpu"), 300):
                consumed += view.numel()
            done.put(rank)


def run_case(millions: int, num_receivers: int, bucket_mb: float, repeats: int) -> dict:
    from asyncrl.schema import SCHEMA_VERSION, WeightAnnouncement
    from asyncrl.weight_sync import WeightSender, new_group, pack_buckets, plan_buckets

    ctx = mp.get_context("spawn")
    sender = WeightSender("127.0.0.1", 0, "gloo", join_timeout_s=120, sync_timeout_s=300)
    world = num_receivers + 1
    queues = [ctx.Queue() for _ in range(num_receivers)]
    done = ctx.Queue()
    procs = [ctx.Process(target=receiver, args=(r + 1, world, sender.port, None, queues[r], done))
             for r in range(num_receivers)]
    for p in procs:
        p.start()
    tensors = tensors_for(millions)
    nbytes = sum(t.numel() * 4 for t in tensors.values())

    def publish(info):
        for q in queues:
            q.put(("join", info))

    members = sender.open_epoch([f"r{r + 1}" for r in range(num_receivers)], publish, lambda *a, **k: None)
    assert len(members) == num_receivers
    for _ in range(num_receivers):
        done.get(timeout=120)
    # Receivers joined in rank order r1..rN = members order, so ranks match.
    buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], int(bucket_mb * 2**20))
    ours, raw = [], []
    raw_pg = None
    flat = torch.empty(nbytes, dtype=torch.uint8)
    for rep in range(repeats):
        ann = WeightAnnouncement(schema_version=SCHEMA_VERSION, version=rep + 1, epoch=sender.epoch, buckets=buckets,
                                 announced_at=time.time())
        for q in queues:
            q.put(("ours", ann))
        t0 = time.perf_counter()
        sender.broadcast(buckets, pack_buckets(buckets, iter(tensors.items()), torch.device("cpu")))
        for _ in range(num_receivers):
            done.get(timeout=600)
        ours.append(time.perf_counter() - t0)
        for q in queues:
            q.put(("raw", (nbytes, 0)))
        if raw_pg is None:  # built once, after the receivers were told to build theirs
            raw_pg = new_group(dist.PrefixStore("raw/0", sender.store), 0, world, "gloo", 300)
        t0 = time.perf_counter()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        raw_pg.broadcast([flat], opts).wait()
        for _ in range(num_receivers):
            done.get(timeout=600)
        raw.append(time.perf_counter() - t0)
    for q in queues:
        q.put(None)
    for p in procs:
        p.join(timeout=60)
    best_ours, best_raw = min(ours), min(raw)
    return {"params_M": millions, "receivers": num_receivers, "GB": nbytes / 1e9, "buckets": len(buckets),
            "ours_s": best_ours, "raw_s": best_raw, "ours_GBps": nbytes / 1e9 / best_ours,
            "raw_GBps": nbytes / 1e9 / best_raw, "ratio": best_raw / best_ours}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10,100,500")
    ap.add_argument("--receivers", default="1,2,3")
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="weight_sync.json")
    args = ap.parse_args()
    rows = []
    print(f"{'params':>7} {'recv':>4} {'GB':>6} {'ours s':>8} {'raw s':>8} {'ours GB/s':>9} {'raw GB/s':>9} {'ours/raw':>8}")
    for m in map(int, args.sizes.split(",")):
        for r in map(int, args.receivers.split(",")):
            row = run_case(m, r, args.bucket_mb, args.repeats)
            rows.append(row)
            print(f"{m:>6}M {r:>4} {row['GB']:>6.2f} {row['ours_s']:>8.3f} {row['raw_s']:>8.3f} "
                  f"{row['ours_GBps']:>9.2f} {row['raw_GBps']:>9.2f} {row['ratio']:>8.2f}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "bucket_mb": args.bucket_mb, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
