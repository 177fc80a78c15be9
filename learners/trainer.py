"""`asyncrl learner CONFIG` (under torchrun): the FSDP2 learner group.

Rank 0 is the only rank that talks to Redis. Every iteration it decides one command and broadcasts
it to the other ranks, so all ranks stay in lockstep for FSDP collectives:
  TRAIN (a batch of groups follows) | SYNC (push current weights to a changed fleet) | STOP.

The loop ties the learner's parts together, each in a module of its own: what is trained
(learners/setup.py), the feed of batches (learners/feed.py, learners/fleet.py), the step
(learners/train.py), the weight pushes (learners/push.py) and the step's row (learners/step_metrics.py).
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from asyncrl.config import Config
from asyncrl.observe import timeline
from asyncrl.observe.selfwatch import SelfWatch
from asyncrl.protocol import identity, schema
from asyncrl.protocol.keys import log_event
from asyncrl.protocol.store import set_and_notify
from learners.autotune import AutoTune
from learners.checkpoint import export_hf
from learners.feed import Feed, ack_checkpointed, open_run
from learners.fleet import Fleet
from learners.push import Milestones, Pusher
from learners.push import decode_stored as _decode_stored
from learners.setup import Parts, fsdp_switches, tied_aliases
from learners.step_metrics import StepMetrics
from learners.train import kernel_warmup, train_step

__all__ = ["Learner", "main", "fsdp_switches", "tied_aliases", "_decode_stored"]

log = logging.getLogger(__name__)

TRAIN, SYNC, STOP = 1, 2, 3


def _bcast_bytes(payload: bytes | None, rank: int, cmd: int = 0) -> tuple[int, bytes]:
    """Rank 0 sends (cmd, payload) to every rank; others return what they got. No pickle."""
    head = torch.tensor([cmd, len(payload) if payload else 0], dtype=torch.long)
    dist.broadcast(head, src=0)
    cmd, n = int(head[0]), int(head[1])
    if n == 0:
        return cmd, b""
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if rank == 0 else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return cmd, buf.numpy().tobytes()


class Learner:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.cuda = torch.cuda.is_available()
        # generator.sleep: a sync-mode engine on this GPU wakes into the memory this step used; hand back
        # what the caching allocator keeps after each step, or its KV cache may not fit again.
        self.release_cache = self.cuda and cfg.run.mode == "sync" and cfg.generator.sleep != "off"
        backend = "nccl" if self.cuda else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timedelta(hours=2))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        torch.manual_seed(cfg.run.seed)
        self.parts = Parts(cfg, self.rank, self.world, self.device, init_device_mesh(self.device.type, (self.world,)))
        self.resumed_from, self.version, self.step = self.parts.resume()
        self.checkpointed_step = self.step  # the step the newest checkpoint holds (or the start)
        # Rank 0's alone (the other ranks never talk to Redis): set by `_init_rank0`.
        self.client = self.keys = None
        self.fleet: Fleet | None = None
        self.feed: Feed | None = None
        self.metrics: StepMetrics | None = None
        self.milestones: Milestones | None = None
        self.watch: SelfWatch | None = None
        if self.rank == 0:
            self.pusher = self._init_rank0()
        else:
            self.pusher = Pusher(cfg, self.parts, self.version)

    def _init_rank0(self) -> Pusher:
        """Claims the run's Redis, opens the weight sender and takes back what a restart left
        delivered but unacked; returns rank 0's pusher."""
        cfg = self.cfg
        self.client, self.keys = client, keys = open_run(cfg)
        self.fleet = Fleet(cfg, client, keys)
        self.milestones = Milestones(client, keys)
        pusher = Pusher(cfg, self.parts, self.version, client, keys, self.fleet, self.milestones)
        set_and_notify(client, keys, keys.version, self.version, "version")
        self.metrics = StepMetrics(cfg, client, keys, self.version, self.resumed_from is not None, time.monotonic())
        log_event(client, keys, "learner_start", version=self.version, world=self.world,
                  resumed_from=self.resumed_from or "")
        timeline.mark(client, keys, "learner process", timeline.process_start())
        timeline.mark(client, keys, "learner ready")
        # Its own stall check (asyncrl/observe/selfwatch.py): a learner started by hand has no launcher watchdog.
        self.watch = SelfWatch("learner", cfg.run.stall_timeout_s, client, keys,
                               publish=lambda f: client.hset(keys.learner, mapping=f))
        client.hset(keys.learner, mapping=self.watch.fields())  # a restart clears an old report
        if self.resumed_from is not None:
            ack_checkpointed(client, keys, self.resumed_from)  # before the recovery path could re-train them
        self.feed = Feed(cfg, client, keys, self.fleet, int(self.parts.model.config.vocab_size), self.version)
        self.autotune = AutoTune(cfg, client, keys, self.feed.reader)  # algorithm.max_staleness=auto, fleet advice
        return pusher

    def decide(self) -> tuple[int, bytes, list]:
        """Rank 0 waits for a full batch, interleaving fleet checks so late joiners get weights.
        Returns the command, its payload, and the stream entries of a TRAIN's batch (acked once the
        update they shaped is durable)."""
        need, feed = self.cfg.learner.batch_groups, self.feed
        while True:
            if self.step >= self.cfg.run.max_steps or feed.stop_requested():
                return STOP, b"", []
            t0 = time.monotonic()
            batch = feed.take(need, self.version)
            if batch is not None:
                self.milestones.mark("first batch")
                self.watch.progress()
                return TRAIN, msgspec.msgpack.encode([schema.encode(g) for _, g in batch]), [e for e, _ in batch]
            feed.idle_s += time.monotonic() - t0
            feed.data_wait_s += time.monotonic() - t0
            self.watch.check("no_step", lambda: feed.data_wait_reason(need, self.version))
            # A push that finished (or failed: the group is dropped, and re-formed just below) while we wait:
            # generators whose load failed hold no version and send nothing until the group is re-formed.
            self.pusher.finish_push(block=False)
            if feed.fleet_check_due() and self.fleet.needs_sync(self.pusher.sender):
                return SYNC, b"", []

    def run(self) -> None:
        kernel_warmup(self.parts, self.resumed_from is not None, self.step)
        while True:
            payload, cmd, entries = None, 0, []
            if self.rank == 0:
                cmd, payload, entries = self.decide()
            cmd, payload = _bcast_bytes(payload, self.rank, cmd) if self.world > 1 else (cmd, payload)
            if cmd == STOP:
                if self.cfg.checkpoint.every and self.checkpointed_step != self.step:
                    self.save_checkpoint()  # stop_request between checkpoints: lose no step
                break
            if cmd == SYNC:
                self.pusher.sync_weights(self.version)
                continue
            groups = [schema.decode(f, schema.TrajectoryGroup) for f in msgspec.msgpack.decode(payload)]
            self._step(groups, entries)
        self._finish()

    def _step(self, groups: list[schema.TrajectoryGroup], entries: list) -> None:
        """One step on every rank: the update, the version, its push, rank 0's weight check and row,
        then the acks or the checkpoint that make the update durable."""
        started_at = time.time()
        stats = train_step(self.parts, groups, self.step)  # every rank holds the step; the plan splits it
        stats["step_started_at"] = started_at
        if self.release_cache:
            torch.cuda.empty_cache()
        if self.step % 10 == 0:
            self.parts.verify_reference_frozen()
        self.version += 1
        self.step += 1
        if self.rank == 0:  # wakes the buffer's admission and sync-mode generators (asyncrl/protocol/notify.py)
            set_and_notify(self.client, self.keys, self.keys.version, self.version, "version")
        sync_s = 0.0
        if self.version % self.cfg.weights.sync_every == 0:
            sync_s = self.pusher.sync_weights(self.version)
        if self.rank == 0:
            self.milestones.mark("first step")
            self.pusher.finish_push(block=False)  # a push that finished meanwhile: its checksums for the check
            fleet = self.fleet.read_fleet()  # one snapshot for the weight check and the step's fleet metrics
            self.fleet.verify_fleet_weights(fleet, self.version)
            self.after_step(groups, stats, sync_s, fleet)
            self.feed.unacked += entries
        every = self.cfg.checkpoint.every
        if every == 0:
            self._ack()  # no checkpoints: the step's update is as durable as it gets
        elif self.step % every == 0 or self.step >= self.cfg.run.max_steps:
            self.save_checkpoint()

    def _finish(self) -> None:
        """After the last step: the last push collected, the final export, the run marked finished."""
        if self.rank == 0:
            self.pusher.close()
        if self.cfg.checkpoint.export_hf:
            export_hf(self.cfg.run_dir / "hf-final", self.cfg.model_path, self.parts.full_tensors(), self.rank,
                      self.pusher.wire_dtype)
        if self.rank == 0:
            pipe = self.client.pipeline(transaction=True)  # the stop key and the run's finished state together
            pipe.set(self.keys.stop, f"{time.time():.3f}")
            identity.mark_finished(pipe, self.keys, self.version)
            pipe.execute()
            log_event(self.client, self.keys, "learner_done", version=self.version)
        dist.barrier()

    def after_step(self, groups: list[schema.TrajectoryGroup], stats: dict, sync_s: float,
                   fleet: dict[str, schema.Heartbeat]) -> None:
        """The step's row (learners/step_metrics.py); after the last step, once the fleet reports
        holding its push (or a bounded wait is over)."""
        if self.step >= self.cfg.run.max_steps:
            fleet = self.pusher.verify_last_push(fleet, self.version)
        stats.update(self.autotune.on_step(groups, stats, sync_s, len(fleet), self.feed.data_wait_s))
        self.metrics.after_step(self.step, self.version, groups, stats, sync_s, fleet, self.feed, self.pusher)

    def _ack(self) -> None:
        if self.rank == 0:
            self.feed.ack()

    def save_checkpoint(self) -> None:
        t0 = time.perf_counter()
        meta = {"version": self.version, "step": self.step, "time": time.time(), **self.parts.training_state()}
        if self.rank == 0:
            meta["cursor"] = {k.decode(): v.decode() for k, v in self.client.hgetall(self.keys.cursor).items()}
            # The entries this checkpoint makes durable: a resume acks them again (learners/feed.py).
            meta["acked_entries"] = [e.decode() if isinstance(e, bytes) else str(e) for e in self.feed.unacked]
        path = self.parts.save(self.step, meta)
        self.checkpointed_step = self.step
        # Only now is the update durable: ack the trajectories that shaped it.
        self._ack()
        if self.rank == 0:
            log_event(self.client, self.keys, "checkpoint", step=self.step, version=self.version, path=str(path),
                      seconds=f"{time.perf_counter() - t0:.3f}")


def main(cfg: Config) -> None:
    learner = Learner(cfg)
    try:
        learner.run()
    finally:
        dist.destroy_process_group()
