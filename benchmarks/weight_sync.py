"""Weight push over the project's weight group vs a raw gloo broadcast of the same bytes, same run.

    python benchmarks/weight_sync.py --out runs/weight_sync.json [--sizes 10,100,500] [--receivers 1,2,3]

For each model size (millions of fp32 parameters, in transformer-like tensors) and receiver count:
  ours     = group epoch already open; announcement planned; FSDP-free gather stand-in (the tensors
             are already full); pack into `--bucket-mb` buckets; broadcast bucket by bucket with
             full checksums on both ends; receivers consume named views (what the vLLM worker
             extension hands to reload_weights);
  sampled  = the same with weights.checksum=sampled (gloo's default: one word per 4 KiB of each
             large bucket);
  raw      = one ProcessGroupGloo broadcast of a single flat uint8 buffer of the same total size,
             received into a fresh buffer each time (what a receiver that hands the weights on to a
             loader must allocate);
  raw_warm = the same into one receive buffer kept across pushes: no page faults, gloo's wire alone.
Same process layout and the same gloo process-group type on the same sockets for all three. One
warm-up round, then `--repeats` rounds whose order rotates; medians, and the spread of the per-round
ratios.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
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
    from asyncrl.protocol.weight_sync import WeightReceiver, new_group

    recv = WeightReceiver(f"r{rank}")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    raw_pg, warm = None, None
    while True:
        job = anns.get()
        if job is None:
            return
        kind, payload = job
        if kind == "raw":
            nbytes, reuse = payload
            if raw_pg is None:
                raw_pg = new_group(dist.PrefixStore("raw", store), rank, world, "gloo", 300)
            if reuse:  # one buffer kept across pushes: no page faults, the wire alone
                if warm is None:
                    warm = torch.empty(nbytes, dtype=torch.uint8)
                buf = warm
            else:  # a fresh buffer per push, as a receiver that hands the weights on must have
                buf = torch.empty(nbytes, dtype=torch.uint8)
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            raw_pg.broadcast([buf], opts).wait()
            del buf
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
    from asyncrl.protocol.schema import SCHEMA_VERSION, WeightAnnouncement
    from asyncrl.protocol.weight_sync import WeightSender, new_group, pack_buckets, plan_buckets

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
    raw_pg = None
    flat = torch.ones(nbytes, dtype=torch.uint8)  # written: an untouched buffer reads as one shared zero page
    version = 0

    def push_ours(checksum: str) -> float:
        nonlocal version
        version += 1
        ann = WeightAnnouncement(schema_version=SCHEMA_VERSION, version=version, epoch=sender.epoch,
                                 buckets=buckets, announced_at=time.time(), checksum=checksum)
        for q in queues:
            q.put(("ours", ann))
        t0 = time.perf_counter()
        sender.broadcast(buckets, pack_buckets(buckets, iter(tensors.items()), torch.device("cpu")), checksum)
        for _ in range(num_receivers):
            done.get(timeout=600)
        return time.perf_counter() - t0

    def push_raw(reuse: bool) -> float:
        nonlocal raw_pg
        for q in queues:
            q.put(("raw", (nbytes, reuse)))
        if raw_pg is None:  # built once, after the receivers were told to build theirs
            raw_pg = new_group(dist.PrefixStore("raw", sender.store), 0, world, "gloo", 300)
        t0 = time.perf_counter()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        raw_pg.broadcast([flat], opts).wait()
        for _ in range(num_receivers):
            done.get(timeout=600)
        return time.perf_counter() - t0

    pushes = {"ours": lambda: push_ours("full"), "sampled": lambda: push_ours("sampled"),
              "raw": lambda: push_raw(False), "raw_warm": lambda: push_raw(True)}
    # One warm-up round (builds the raw group, the warm buffers, the allocators' pools), not
    # counted; then rounds whose order rotates, so no path always runs first or on another's leftovers.
    for push in pushes.values():
        push()
    times: dict[str, list[float]] = {k: [] for k in pushes}
    order = list(pushes)
    for rep in range(repeats):
        for k in order[rep % len(order):] + order[: rep % len(order)]:
            times[k].append(pushes[k]())
    for q in queues:
        q.put(None)
    for p in procs:
        p.join(timeout=60)
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {"params_M": millions, "receivers": num_receivers, "GB": nbytes / 1e9, "buckets": len(buckets)}
    for k in pushes:
        row[f"{k}_s"] = med[k]
        row[f"{k}_GBps"] = nbytes / 1e9 / med[k]
        row[f"{k}_all_s"] = times[k]
    for ours, prefix in (("ours", "ratio"), ("sampled", "sampled_ratio")):
        for base, suffix in (("raw", ""), ("raw_warm", "_warm")):
            name = prefix + suffix
            pairs = sorted(b / o for o, b in zip(times[ours], times[base], strict=True))
            row[name] = med[base] / med[ours]  # ours / raw in throughput: raw time over ours
            row[f"{name}_min"], row[f"{name}_max"] = pairs[0], pairs[-1]  # spread over the rounds
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10,100,500")
    ap.add_argument("--receivers", default="1,2,3")
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="weight_sync.json")
    args = ap.parse_args()
    rows = []
    print(f"{'params':>7} {'recv':>4} {'GB':>6} {'full s':>7} {'smpl s':>7} {'raw s':>7} {'warm s':>7} "
          f"{'full/raw':>8} {'full/warm':>9} {'(rounds)':>11} {'smpl/raw':>8} {'smpl/warm':>9} {'(rounds)':>11}")
    for m in map(int, args.sizes.split(",")):
        for r in map(int, args.receivers.split(",")):
            row = run_case(m, r, args.bucket_mb, args.repeats)
            rows.append(row)
            print(f"{m:>6}M {r:>4} {row['GB']:>6.2f} {row['ours_s']:>7.3f} {row['sampled_s']:>7.3f} "
                  f"{row['raw_s']:>7.3f} {row['raw_warm_s']:>7.3f} {row['ratio']:>8.2f} {row['ratio_warm']:>9.2f} "
                  f"{row['ratio_warm_min']:>5.2f}-{row['ratio_warm_max']:<5.2f} {row['sampled_ratio']:>8.2f} "
                  f"{row['sampled_ratio_warm']:>9.2f} "
                  f"{row['sampled_ratio_warm_min']:>5.2f}-{row['sampled_ratio_warm_max']:<5.2f}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "bucket_mb": args.bucket_mb, "repeats": args.repeats, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
