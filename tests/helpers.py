"""Small builders shared by tests (not fixtures)."""

import contextlib
import os
import sys
import time

from asyncrl.protocol import schema


@contextlib.contextmanager
def gloo_group(rank: int, port: int, q=None, world_size: int = 2):
    """A gloo process group for a spawned test rank; the rank's process ends with the block.

    On a clean exit every rank waits at a barrier, destroys the group, flushes `q` (the queue it
    reports through) and leaves with `os._exit(0)`. The interpreter's own teardown is skipped on
    purpose: FSDP modules keep the group alive in reference cycles, and gloo's threads destroyed
    during finalization, in no set order, can abort the process ("terminate called without an
    active exception"). An exception propagates as usual and fails the rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        yield
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    if q is not None:
        q.close()
        q.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make_group(group_id="p0@e0", num_samples=4, num_tokens=3, version=0, reward=0.5, generator_id="gt",
               lease_id=""):
    samples = [
        schema.Sample(completion_ids=schema.pack_i32([5 + i] * num_tokens),
                      logprobs=schema.pack_f32([-0.5] * num_tokens),
                      versions=schema.pack_i32([version] * num_tokens), reward=reward + 0.1 * i,
                      finish_reason="length")
        for i in range(num_samples)
    ]
    return schema.TrajectoryGroup(schema_version=schema.SCHEMA_VERSION, group_id=group_id,
                                  prompt_id=group_id.split("@")[0], generator_id=generator_id,
                                  prompt_ids=schema.pack_i32([13, 14, 83]), samples=samples,
                                  sampling=schema.SamplingInfo(1.0, 1.0, -1), created_at=time.time(),
                                  lease_id=lease_id)


class Procs:
    """Role processes started as a user would, each in its own session, logs in `log_dir`."""

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.procs = {}
        self.logs = {}

    def spawn(self, name, argv):
        import subprocess

        self.logs[name] = open(self.log_dir / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(argv, stdout=self.logs[name], stderr=subprocess.STDOUT,
                                            start_new_session=True)
        return self.procs[name]

    def log(self, name):
        return (self.log_dir / f"{name}.log").read_text()

    def kill(self, name, sig=9):
        from asyncrl.launch.launcher import kill_tree

        kill_tree(self.procs[name].pid, sig)
        self.procs[name].wait(timeout=60)

    def close(self):
        from asyncrl.launch.launcher import kill_tree

        for p in self.procs.values():
            if p.poll() is None:
                kill_tree(p.pid, 9)
        for f in self.logs.values():
            f.close()


def fixed_groups(num, seed=0, n=4):
    """`num` valid trajectory groups of random tokens for the tiny model's vocabulary (versions 0)."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(num):
        samples = []
        for _ in range(n):
            k = rng.randint(2, 6)
            samples.append(schema.Sample(completion_ids=schema.pack_i32([rng.randint(3, 97) for _ in range(k)]),
                                         logprobs=schema.pack_f32([-rng.uniform(0.5, 5) for _ in range(k)]),
                                         versions=schema.pack_i32([0] * k), reward=float(rng.random() > 0.5)))
        out.append(schema.TrajectoryGroup(schema_version=schema.SCHEMA_VERSION, group_id=f"p{i}@e0", prompt_id=f"p{i}",
                                          generator_id="fixed", prompt_ids=schema.pack_i32([13, 14, 15, 83]),
                                          samples=samples, sampling=schema.SamplingInfo(1.0, 1.0, -1),
                                          created_at=time.time()))
    return out


def aggregate(loss_BT, mask_BT, mode: str, norm_tokens: int | None = None):
    """`mode` (algorithm.aggregation) over this batch alone (`norm_tokens` defaults to T): the whole
    batch that the learner's parts (`aggregate_normalised`) must add up to."""
    from asyncrl.algorithms.aggregation import aggregate_normalised

    return aggregate_normalised(loss_BT, mask_BT, mode, int(mask_BT.sum().item()), loss_BT.shape[0],
                                loss_BT.shape[1] if norm_tokens is None else norm_tokens)


def token_logprobs(logits_BTV, targets_BT, temperature: float, chunk: int = 1024):
    """log softmax(logits / temperature) at `targets`, in fp32 over row chunks: the plain full-logits
    reference the learner's log-probs are checked against."""
    import torch

    flat = logits_BTV.reshape(-1, logits_BTV.shape[-1])
    tgt = targets_BT.reshape(-1)
    out = []
    for i in range(0, flat.shape[0], chunk):
        rows = flat[i:i + chunk].float() / temperature
        out.append(rows.gather(1, tgt[i:i + chunk, None]).squeeze(1) - torch.logsumexp(rows, dim=-1))
    return torch.cat(out).view_as(targets_BT)
