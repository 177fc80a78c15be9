"""`asyncrl learner CONFIG` (under torchrun): the FSDP2 learner group.

Rank 0 is the only rank that talks to Redis. Every iteration it decides one command and broadcasts
it to the other ranks, so all ranks stay in lockstep for FSDP collectives:
  TRAIN (a batch of groups follows) | SYNC (push current weights to a changed fleet) | STOP.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from asyncrl.config import Config, ConfigError
from asyncrl.protocol import fleet as fleet_rules
from asyncrl.protocol import schema
from asyncrl.protocol.keys import LEARNER_GROUP, Keys, connect, log_event
from asyncrl.protocol.store import ack_dropped, ensure_groups, group_lag, set_and_notify
from asyncrl.protocol.weight_sync import (
    WeightSender,
    checksum_mode,
    choose_backend,
    pack_buckets,
    plan_buckets,
    to_dtype,
)
from learners import packing
from learners.batch import build_step
from learners.step import batch_targets, logprobs_N, policy_update, rank_micro_batches
from learners.warmup import WARMUP_PROMPT_TOKENS, frozen_training_state, synthetic_groups

log = logging.getLogger(__name__)

TRAIN, SYNC, STOP = 1, 2, 3


def tied_aliases(model) -> set[str]:
    """State-dict names that alias an earlier entry: a tied output head (`lm_head.weight` of SmolLM2
    or Qwen2.5-0.5B) is the input embedding under a second name. Such a tensor goes on the wire and
    into the Hugging Face export once, under its first name: vLLM and transformers tie the head to
    the embedding again from the config (`tie_word_embeddings`), and the second all-gather and copy
    of a vocabulary x hidden matrix (113 MB in fp32 for SmolLM2-135M, a fifth of the model) is saved."""
    seen, aliases = set(), set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            aliases.add(name)
        seen.add(id(t))
    return aliases


def fsdp_switches(lc, world: int) -> tuple[bool, bool]:
    """(reshard_after_forward, shard_layers) of `learner.*` at `world` ranks: `auto` is on with several
    ranks and off on one, where nothing is sharded and the per-layer units only add hooks and casts."""
    def pick(value):
        return world > 1 if value == "auto" else bool(value)

    return pick(lc.reshard_after_forward), pick(lc.shard_layers)


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


def _decode_stored(frame: bytes, kind, what: str):
    """A frame this run left in Redis before a restart; one of another schema version (the run was
    started by another asyncrl) is a clear error, not a crash in the middle of start-up."""
    try:
        return schema.decode(frame, kind)
    except schema.FrameError as e:
        if e.reason != "schema_version":
            raise
        raise RuntimeError(f"Redis holds {what} of another schema version ({e}): this run was started by "
                           f"another asyncrl; resume it with that one, or start a new run (another run.name)") from e


class Learner:
    def __init__(self, cfg: Config):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

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
        mesh = init_device_mesh(self.device.type, (self.world,))
        lc = cfg.learner
        self.lora = lc.lora.enabled  # learners/lora.py: adapters under FSDP2, merged weights on the wire
        model = self._build_model(AutoModelForCausalLM, fully_shard, mesh, trainable=True, lora=self.lora)
        self.model = model
        # With LoRA only the adapters require grad: the optimizer (and its state) holds nothing else.
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lc.lr,
                                           weight_decay=lc.weight_decay, fused=self.cuda and not lc.param_offload)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda)
        from asyncrl.algorithms.losses import AdaptiveKLController

        alg = cfg.algorithm
        self.kl_ctl = AdaptiveKLController(alg.kl_coef, alg.kl_target or None, alg.kl_horizon)
        # The reference is the initial policy, frozen; only loaded when a KL term needs it. With LoRA
        # it is the policy's own frozen base with the adapters switched off (lora.adapters_disabled):
        # exactly the initial policy, and no second copy of the weights, which is what LoRA saves.
        self.ref_model = None
        if alg.kl_coef > 0:
            self.ref_model = model if self.lora else self._build_model(AutoModelForCausalLM, fully_shard, mesh,
                                                                       trainable=False)
            self.ref_checksum = self._ref_checksum()
        # advantage=gae: a value model with its own optimizer and schedule (learners/critic.py); full
        # parameters even when the policy has LoRA.
        self.critic = self.critic_optimizer = self.critic_scheduler = None
        if alg.advantage == "gae":
            from learners.critic import load_value_model

            self.critic = self._shard(load_value_model(lc.critic_path or cfg.model_path), fully_shard, mesh)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=lc.critic_lr,
                                                      weight_decay=lc.weight_decay,
                                                      fused=self.cuda and not lc.param_offload)
            self.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(self.critic_optimizer, self._lr_lambda)
        # Micro-batches: memory is set by their token budget, not by the batch (learners/packing.py).
        compute_dtype = to_dtype(lc.mixed_precision.param_dtype)
        self.micro_batch_tokens = lc.micro_batch_tokens or packing.default_micro_batch_tokens(
            model.config, self.device, compute_dtype, lc.activation_checkpointing)
        self.attention = "padded"
        if lc.packing:
            for m in {id(x): x for x in (model, self.ref_model, self.critic) if x is not None}.values():
                self.attention = packing.packed_attention(m, self.device, compute_dtype)
        if self.rank == 0:
            log.info("micro-batches of at most %d tokens a rank, attention: %s", self.micro_batch_tokens,
                     self.attention)
        self.pad_id = model.config.pad_token_id or 0
        self.version = 0
        self.step = 0
        self.wire_dtype = to_dtype(cfg.model.dtype)
        self.buckets = plan_buckets([(n, self.wire_dtype, shape) for n, shape in self._wire_shapes()],
                                    int(cfg.weights.bucket_mb * 2**20))
        self.resumed_from = self._maybe_resume()
        if self.rank == 0:
            self._init_rank0()

    def _build_model(self, auto_cls, fully_shard, mesh, trainable: bool, lora: bool = False):
        """An FSDP2 model with the verl-style switches of `learner.*`; the reference (not trainable)
        gets the same sharding (none at world size 1) and is held in the compute dtype, with no grads,
        and is never stepped. LoRA adapters go in before `fully_shard` (learners/lora.py says why
        that order)."""
        model = auto_cls.from_pretrained(self.cfg.model_path, dtype=torch.float32)
        model.config.use_cache = False
        if not trainable:
            # Frozen: held in the compute dtype, which is what mixed precision would cast it to on
            # every forward anyway (the same rounding), at half the memory and no per-step cast.
            mp = self.cfg.learner.mixed_precision
            model.requires_grad_(False).eval().to(to_dtype(mp.param_dtype))
        if lora:
            from learners.lora import apply_lora

            model = apply_lora(model, self.cfg.learner.lora)
        return self._shard(model, fully_shard, mesh, trainable)

    def _shard(self, model, fully_shard, mesh, trainable: bool = True):
        """`fully_shard` each decoder layer (`model.model.layers`, or `model.layers` for the critic),
        then the root."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        lc = self.cfg.learner
        if trainable and lc.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mp = lc.mixed_precision
        reshard, shard_layers = fsdp_switches(lc, self.world)
        kwargs = {"mesh": mesh, "reshard_after_forward": reshard}
        if mp.param_dtype != "float32" or mp.reduce_dtype != "float32":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=to_dtype(mp.param_dtype),
                                                       reduce_dtype=to_dtype(mp.reduce_dtype))
        if lc.param_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        layers = model.model.layers if hasattr(model, "model") else model.layers
        # A frozen model on one rank has nothing to shard over: FSDP2 would only add copies.
        shard = trainable or self.world > 1 or lc.param_offload
        for layer in layers:
            if lc.compile:
                # In place (nn.Module.compile): wrapping the layer would put `_orig_mod.` into every
                # parameter name, which the generators' models do not have.
                layer.compile()
            if shard and shard_layers:
                fully_shard(layer, **kwargs)
        if not shard:
            return model.to(self.device)
        fully_shard(model, **kwargs)
        return model

    def _lr_lambda(self, step: int) -> float:
        lc = self.cfg.learner
        if lc.warmup_steps and step < lc.warmup_steps:
            return (step + 1) / lc.warmup_steps
        if lc.lr_schedule == "cosine":
            import math

            total = max(self.cfg.run.max_steps * lc.ppo_epochs * lc.minibatches - lc.warmup_steps, 1)
            progress = min(max(step - lc.warmup_steps, 0) / total, 1.0)
            return lc.min_lr_ratio + (1 - lc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    def _ref_checksum(self) -> float:
        """Sum of this rank's reference shards in float64 (with LoRA: the frozen base parameters);
        all-reduced so every rank agrees."""
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        params = [p for p in self.model.parameters() if not p.requires_grad] if self.lora else \
            self.ref_model.parameters()
        for p in params:
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.detach().double().sum()
        if self.world > 1:
            dist.all_reduce(total)
        return float(total)

    def verify_reference_frozen(self) -> None:
        """The reference must never change; a silent change would make the KL term meaningless."""
        if self.ref_model is not None and self._ref_checksum() != self.ref_checksum:
            raise RuntimeError("the frozen reference model changed during training (checksum mismatch)")

    def _maybe_resume(self):
        from learners import checkpoint

        mode = self.cfg.checkpoint.resume
        path = None if mode == "never" else checkpoint.latest(self.cfg.checkpoint_dir)
        if path is None:
            if mode == "must":
                raise FileNotFoundError(f"checkpoint.resume=must but no complete checkpoint in {self.cfg.checkpoint_dir}")
            return None
        meta = checkpoint.load(path, self.model, self.optimizer, critic=self._critic_parts(),
                               adapters_only=self.lora)
        self.version, self.step = int(meta["version"]), int(meta["step"])
        if "scheduler" in meta:
            self.scheduler.load_state_dict(meta["scheduler"])
        if self.critic_scheduler is not None:
            self.critic_scheduler.load_state_dict(meta["critic_scheduler"])
        if "kl_ctl" in meta:
            self.kl_ctl.load(meta["kl_ctl"])
        log.info("resumed from %s: step=%d version=%d", path, self.step, self.version)
        return path

    # ---- rank 0: Redis, fleet, metrics -------------------------------------------------------------

    def _init_rank0(self) -> None:
        cfg = self.cfg
        self.keys = Keys(cfg.run.name)
        self.client = connect(cfg.buffer.redis_url)
        from asyncrl.protocol.identity import claim

        claim(self.client, self.keys, cfg, "learner")  # a finished or foreign run of this name is refused
        ensure_groups(self.client, self.keys)  # idempotent; the learner may start before the buffer
        self.client.delete(self.keys.stop, self.keys.stop_request)
        from asyncrl.protocol import sampling

        # Refuse to start next to generators that sample differently; publish ours for late ones.
        sampling.check_fleet(self.client, self.keys, cfg.generator)
        sampling.publish(self.client, self.keys, cfg.generator)
        # The version is the checkpoint's (or 0): Redis may hold a later one from before a crash
        # whose update was never persisted.
        epoch0 = 0
        if (frame := self.client.get(self.keys.wgroup)) is not None:
            epoch0 = _decode_stored(frame, schema.GroupEpoch, "the last weight-group epoch").epoch
        host = cfg.deploy.bind_host
        if cfg.weights.backend in ("nccl", "ipc") and not self.cuda:
            raise ConfigError(f"weights.backend={cfg.weights.backend} needs the learner on CUDA; this one runs on "
                              "the CPU (weights.backend=auto or gloo)")
        # Each epoch's backend: auto takes ipc when every member shares this node (and CUDA), else NCCL.
        self.sender = WeightSender(host, cfg.weights.port, choose_backend(cfg.weights.backend, self.cuda, False),
                                   cfg.weights.join_timeout_s, cfg.weights.sync_timeout_s, first_epoch=epoch0,
                                   advertise=cfg.deploy.advertise_host, choose=self._epoch_backend)
        set_and_notify(self.client, self.keys, self.keys.version, self.version, "version")
        self.pending: list[schema.TrajectoryGroup] = []
        self.dropped_stale = 0
        self.idle_s = 0.0
        self.t_start = time.monotonic()
        self.last_fleet_check = 0.0
        self.sync_s = 0.0
        from learners.push import PushQueue

        self.pushes = PushQueue()
        # The next step starts while generators load the last push: only where a lag of one version is allowed.
        self.overlap = cfg.weights.overlap and cfg.run.mode == "async" and cfg.algorithm.max_staleness >= 1
        self.push_wait_s = self.data_wait_s = 0.0  # this step's: waiting for the previous push, for data
        self.last_push = None
        self.metrics_path = cfg.run_dir / "metrics.jsonl"
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        from asyncrl.observe.metrics import LearnerObservability

        self.obs = LearnerObservability(cfg, self.client, self.keys)  # jsonl/wandb/TensorBoard, /metrics
        from learners.evaluation import Evaluator

        self.evaluator = Evaluator(cfg, self.client, start_version=self.version)  # eval rounds every eval.every steps (asyncrl/tasks/evaluation.py)
        log_event(self.client, self.keys, "learner_start", version=self.version, world=self.world,
                  resumed_from=self.resumed_from or "")
        from asyncrl.observe import timeline

        timeline.mark(self.client, self.keys, "learner process", timeline.process_start())
        timeline.mark(self.client, self.keys, "learner ready")
        self.milestones: set[str] = set()  # first batch / step / push, each marked once
        self.unacked: list = []
        self.weight_check = fleet_rules.WeightCheck()  # what we broadcast per version against what generators report
        self.dropped_zero_var = 0
        from asyncrl.observe.selfwatch import SelfWatch

        # Its own stall check (asyncrl/observe/selfwatch.py): a learner started by hand has no launcher watchdog.
        self.watch = SelfWatch("learner", cfg.run.stall_timeout_s, self.client, self.keys,
                               publish=lambda f: self.client.hset(self.keys.learner, mapping=f))
        self.client.hset(self.keys.learner, mapping=self.watch.fields())  # a restart clears an old report
        self._recover_pending()

    def _recover_pending(self) -> None:
        """After a restart, trajectories delivered to us but never acked (their update was not in a
        durable checkpoint) come first, in their original order. They are read and screened exactly
        as a fresh read is (learners/quarantine.py): a poison group left pending by a crash is moved
        aside, not trained first and crashed on again; an entry deleted from the stream is acked; a
        group sampled by versions ahead of this learner's is dropped like the reader drops it. The
        log line says how many of each."""
        quarantine = self._quarantine()
        reply = self.client.xreadgroup(LEARNER_GROUP, "learner-0", {self.keys.trajectories: "0"}, count=100_000)
        entries = reply[0][1] if reply else []
        if not entries:
            return
        moved0, deleted0 = quarantine.num, quarantine.num_deleted
        read = [(entry_id, g) for entry_id, fields in entries if (g := quarantine.entry(entry_id, fields)) is not None]
        screened = quarantine.screen(read)
        keep = [(e, g) for e, g in screened if g.max_version() <= self.version]
        ahead = [e for e, g in screened if g.max_version() > self.version]
        if ahead:
            ack_dropped(self.client, self.keys, ahead)
            self.dropped_stale += len(ahead)
        self.pending.extend(keep)
        quarantined, deleted = quarantine.num - moved0, quarantine.num_deleted - deleted0
        log.warning("%d trajectory groups were delivered before the restart but never acked: re-training %d, "
                    "quarantined %d (see %s), %d deleted from the stream, %d dropped as sampled by versions "
                    "ahead of this learner's %d", len(entries), len(keep), quarantined, self.keys.quarantine,
                    deleted, len(ahead), self.version)
        log_event(self.client, self.keys, "redeliver", num=len(keep), quarantined=quarantined, deleted=deleted,
                  ahead=len(ahead))

    def _quarantine(self):
        """The screen every group passes before a batch (learners/quarantine.py), built on first use."""
        if getattr(self, "quarantine", None) is None:
            from learners.quarantine import Quarantine

            vocab = int(self.model.config.vocab_size)  # rows of the embedding the log-prob gather indexes
            self.quarantine = Quarantine(self.client, self.keys, schema.RunLimits.from_config(self.cfg, vocab))
        return self.quarantine

    def read_fleet(self) -> dict[str, schema.Heartbeat]:
        """One snapshot of the heartbeats (asyncrl/protocol/fleet.py): read once per decision and passed on."""
        return fleet_rules.read_fleet(self.client, self.keys)

    def live_members(self, fleet: dict[str, schema.Heartbeat] | None = None) -> list[str]:
        """The weight-group members of `fleet` (a fresh read when None) that asyncrl/protocol/fleet.py
        admits; each refusal is warned about once per generator and logged as an event."""
        if getattr(self, "admission", None) is None:  # built on first use
            self.admission = fleet_rules.Admission(self.cfg, self.client, self.keys)
        return fleet_rules.live_members(self.read_fleet() if fleet is None else fleet, self.admission)

    def fleet_needs_sync(self, fleet: dict[str, schema.Heartbeat] | None = None) -> bool:
        """The live members differ from the group's, or a failed push dropped the group while members live."""
        live = set(self.live_members(fleet))
        return live != set(self.sender.members) or (bool(live) and self.sender.pg is None)

    def _read_groups(self, need: int) -> None:
        """Tops up self.pending through the reader (learners/reader.py: XREADGROUP, the staleness
        filter, buffer.sampling); groups recovered after a restart are already in self.pending."""
        if getattr(self, "reader", None) is None:
            from learners.reader import TrajectoryReader

            self.reader = TrajectoryReader(self.client, self.keys, self.cfg, known=self.pending,
                                           quarantine=self._quarantine())
        got, dropped = self.reader.read(need, self.version, in_hand=self.pending)
        # Sampling settings, token ids, lengths and ids against the run: a group that fails is
        # quarantined, never trained and never fatal (raising here would crash every restart).
        got = self._quarantine().screen(got)
        if self.cfg.algorithm.dynamic_sampling:
            # DAPO dynamic sampling: a group whose rewards are all equal has zero advantage everywhere
            # and only dilutes the batch; drop it (acked, counted, given back to the admission budget).
            flat = [(e, g) for e, g in got if len({s.reward for s in g.samples}) == 1]
            if flat:
                ack_dropped(self.client, self.keys, [e for e, _ in flat])
                self.dropped_zero_var += len(flat)
                got = [(e, g) for e, g in got if len({s.reward for s in g.samples}) > 1]
        self.pending.extend(got)
        self.dropped_stale += dropped

    def _stop_requested(self) -> bool:
        """`stop_request` (set by `asyncrl stop` or a test): finish like at max_steps, cleanly."""
        if time.monotonic() - getattr(self, "_last_stop_check", 0.0) < 1.0:
            return False
        self._last_stop_check = time.monotonic()
        return bool(self.client.exists(self.keys.stop_request))

    def decide(self) -> tuple[int, bytes]:
        """Rank 0 waits for a full batch, interleaving fleet checks so late joiners get weights."""
        need = self.cfg.learner.batch_groups
        while True:
            if self.step >= self.cfg.run.max_steps or self._stop_requested():
                return STOP, b""
            t0 = time.monotonic()
            if len(self.pending) < need:
                self._read_groups(need - len(self.pending))
            if len(self.pending) >= need:
                batch, self.pending = self.pending[:need], self.pending[need:]
                self._milestone("first batch")
                self.batch_entries = [e for e, _ in batch]
                self.watch.progress()
                self.batch_groups = [g for _, g in batch]
                return TRAIN, msgspec.msgpack.encode([schema.encode(g) for g in self.batch_groups])
            self.idle_s += time.monotonic() - t0
            self.data_wait_s += time.monotonic() - t0
            self.watch.check("no_step", lambda: self._data_wait_reason(need))
            # A push that finished (or failed: the group is dropped, and re-formed just below) while we wait:
            # generators whose load failed hold no version and send nothing until the group is re-formed.
            self._finish_push(block=False)
            if time.monotonic() - self.last_fleet_check > 1.0:
                self.last_fleet_check = time.monotonic()
                if self.fleet_needs_sync():
                    return SYNC, b""

    def _data_wait_reason(self, need: int) -> str:
        """What a learner waiting for data waits on, for its stall report."""
        fleet = self.read_fleet()
        states = ", ".join(f"{g}={hb.state}@v{hb.version}" for g, hb in sorted(fleet.items())) or "none live"
        depth = group_lag(self.client, self.keys.trajectories, LEARNER_GROUP)
        at = self.client.hget(self.keys.metrics, "buffer:updated_at")
        buffer = f"the buffer published {time.time() - float(at):.0f}s ago" if at else "no buffer has published"
        return (f"waiting for data: {len(self.pending)} of learner.batch_groups {need} groups in hand, {depth} "
                f"undelivered in the stream, learner at version {self.version}; {buffer}; generators: {states}")

    # ---- all ranks ---------------------------------------------------------------------------------

    def kernel_warmup(self) -> None:
        """learner.kernel_warmup: one step on synthetic groups (learners/warmup.py); the weights, the
        schedules and the KL controller are unchanged by it, the optimizers as fresh as before."""
        cfg, parts = self.cfg, [(self.optimizer, self.scheduler)]
        if self.critic is not None:
            parts.append((self.critic_optimizer, self.critic_scheduler))
        if cfg.learner.kernel_warmup == "off" or (cfg.learner.kernel_warmup == "auto" and not self.cuda):
            return
        if self.resumed_from is not None or self.step > 0 or any(opt.state for opt, _ in parts):
            return  # resumed: the optimizer's state is the run's own, and the kernels are the first step's cost
        t0 = time.perf_counter()
        g = cfg.generator
        prompt_tokens = max(1, min(WARMUP_PROMPT_TOKENS, g.max_model_len - g.max_tokens))
        groups = synthetic_groups(cfg.learner.batch_groups, g.n, prompt_tokens, g.max_tokens,
                                  self.model.config.vocab_size, cfg.run.seed)
        with frozen_training_state([o for o, _ in parts], [s for _, s in parts], self.kl_ctl):
            self.train_step(groups)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        if self.rank == 0:
            log.info("kernel warm-up: one step on synthetic groups in %.2fs (learning rate 0, optimizer state "
                     "emptied after it)", time.perf_counter() - t0)

    def run(self) -> None:
        self.kernel_warmup()
        while True:
            payload = None
            cmd = 0
            if self.rank == 0:
                cmd, payload = self.decide()
            cmd, payload = _bcast_bytes(payload, self.rank, cmd) if self.world > 1 else (cmd, payload)
            if cmd == STOP:
                break
            if cmd == SYNC:
                self.sync_weights()
                continue
            groups = [schema.decode(f, schema.TrajectoryGroup) for f in msgspec.msgpack.decode(payload)]
            started_at = time.time()
            stats = self.train_step(groups)  # every rank holds the step; the plan splits it
            stats["step_started_at"] = started_at
            if self.release_cache:
                torch.cuda.empty_cache()
            if self.step % 10 == 0:
                self.verify_reference_frozen()
            self.version += 1
            self.step += 1
            if self.rank == 0:  # wakes the buffer's admission and sync-mode generators (asyncrl/protocol/notify.py)
                set_and_notify(self.client, self.keys, self.keys.version, self.version, "version")
            sync_s = 0.0
            if self.version % self.cfg.weights.sync_every == 0:
                sync_s = self.sync_weights()
            if self.rank == 0:
                self._milestone("first step")
                self._finish_push(block=False)  # a push that finished meanwhile: its checksums for the check
                fleet = self.read_fleet()  # one snapshot for the weight check and the step's fleet metrics
                self.verify_fleet_weights(fleet)
                self.after_step(groups, stats, sync_s, fleet)
                self.unacked += self.batch_entries
            every = self.cfg.checkpoint.every
            if every == 0:
                self._ack()  # no checkpoints: the step's update is as durable as it gets
            elif self.step % every == 0 or self.step >= self.cfg.run.max_steps:
                self.save_checkpoint()
        if self.rank == 0:
            self._finish_push()
            self.pushes.close()
        if self.cfg.checkpoint.export_hf:
            from learners.checkpoint import export_hf

            export_hf(self.cfg.run_dir / "hf-final", self.cfg.model_path, self.full_tensors(), self.rank,
                      self.wire_dtype)
        if self.rank == 0:
            from asyncrl.protocol.identity import mark_finished

            pipe = self.client.pipeline(transaction=True)  # the stop key and the run's finished state together
            pipe.set(self.keys.stop, f"{time.time():.3f}")
            mark_finished(pipe, self.keys, self.version)
            pipe.execute()
            log_event(self.client, self.keys, "learner_done", version=self.version)
        dist.barrier()

    def _critic_parts(self):
        return (self.critic, self.critic_optimizer) if self.critic is not None else None

    def _wire_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of what `full_tensors` yields: the base model's names, merged when LoRA,
        each tied tensor once."""
        skip = self._tied_aliases()
        if self.lora:
            from learners.lora import merged_shapes

            return [(n, shape) for n, shape in merged_shapes(self.model) if n not in skip]
        return [(n, tuple(t.shape)) for n, t in self.model.state_dict().items() if n not in skip]

    def _tied_aliases(self) -> set[str]:
        """The second names of tied tensors (the base model's names under LoRA)."""
        if getattr(self, "_aliases", None) is None:
            aliases = tied_aliases(self.model)
            if self.lora:
                from learners.lora import base_name

                aliases = {base_name(n) for n in aliases}
            self._aliases = aliases
        return self._aliases

    def train_step(self, groups: list[schema.TrajectoryGroup]) -> dict:
        """One learner step on all of the step's groups (every rank holds them): the plan
        (learners/packing.py) gives each rank its share of every mini-batch in micro-batches."""
        cfg, lc = self.cfg, self.cfg.learner
        t0 = time.perf_counter()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        step = build_step(groups, device=self.device)
        # The loss normalisers count the policy's tokens (an episode's observations are not trained on).
        plan = packing.plan_step(step.group_sizes, step.lengths, step.policy_len, world=self.world,
                                 minibatches=lc.minibatches, epochs=lc.ppo_epochs, budget=self.micro_batch_tokens,
                                 packed=lc.packing, seed=cfg.run.seed * 1_000_003 + self.step)
        micro = rank_micro_batches(plan, self.rank)
        ref_logp = None
        if self.ref_model is not None:
            from contextlib import nullcontext

            from learners.lora import adapters_disabled

            with adapters_disabled(self.model) if self.lora else nullcontext():
                ref_logp = logprobs_N(self.ref_model, step, micro, cfg, self.pad_id)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step's (first) update uses
        # GAE: the critic scores the behaviour batch before any update; its values give the
        # advantages (policy) and the returns (critic), both fixed for the step's updates.
        values = None
        if self.critic is not None:
            from learners.critic import old_values

            values = old_values(self.critic, step, plan, cfg, self.rank, self.pad_id)
        targets = batch_targets(self.model, step, plan, cfg, self.rank, ref_logp, self.kl_ctl.value, values,
                                self.pad_id)
        st = policy_update(self.model, self.optimizer, step, plan, cfg, targets, self.rank, self.world, self.pad_id,
                           kl_coef=self.kl_ctl.value, scheduler=self.scheduler)
        if self.critic is not None:
            from learners.critic import critic_update

            st["critic_lr"] = self.critic_optimizer.param_groups[0]["lr"]
            st.update(critic_update(self.critic, self.critic_optimizer, step, plan, values, targets.returns_N, cfg,
                                    self.rank, self.world, self.pad_id, scheduler=self.critic_scheduler,
                                    keep_N=targets.keep_N))  # tokens rejection sampling dropped train no value
        # Across ranks: token-weighted means (each rank's stat times its token share), maxima for
        # *_max, sums for the losses (each rank holds its part). Grad norms and whole-step
        # statistics are global already.
        policy_len = step.policy_len
        local_tokens = sum(policy_len[s] for seqs in micro for s in seqs)
        share = local_tokens * self.world / max(step.num_policy_tokens, 1)
        global_stats = ("grad_norm", "value_grad_norm", "critic_lr", "value_explained_var", "value_mean",
                        "returns_mean")
        summed = ("loss", "value_loss")
        names = sorted(k for k in st if k not in global_stats)
        weight = {k: (1.0 if k in summed else share / self.world) for k in names}
        means = torch.tensor([st[k] * weight[k] for k in names if not k.endswith("_max")], device=self.device)
        maxes = torch.tensor([st[k] for k in names if k.endswith("_max")], device=self.device)
        if self.world > 1:
            dist.all_reduce(means)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        out = dict(zip([k for k in names if not k.endswith("_max")], means.tolist(), strict=True))
        out.update(zip([k for k in names if k.endswith("_max")], maxes.tolist(), strict=True))
        if "kl" in out:
            out["kl_coef"] = self.kl_ctl.value
            out["ref_checksum"] = self.ref_checksum
            self.kl_ctl.update(out["kl"], step.num_seqs)  # the controller's horizon counts samples
        out["lr"] = lr
        out.update({k: st[k] for k in global_stats if k in st})
        step_s = time.perf_counter() - t0
        real = sum(step.lengths)
        processed = plan.processed_tokens(step.lengths, lc.packing)
        out.update(updates=float(plan.num_updates), micro_batches=float(plan.micro_batches(self.rank)),
                   pad_frac=1.0 - real * lc.ppo_epochs / max(processed, 1), real_tokens_per_s=real / max(step_s, 1e-9),
                   micro_batch_tokens=float(self.micro_batch_tokens))
        if self.cuda:
            out["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return {**out, "tokens": float(step.num_policy_tokens), "step_s": step_s}

    def verify_fleet_weights(self, fleet: dict[str, schema.Heartbeat]) -> None:
        """The weights each generator reports holding must be the ones we sent for that version
        (asyncrl/protocol/fleet.py `WeightCheck`). A mismatch is an error event, not silence."""
        for gid, version, got, sent in self.weight_check.check(fleet, self.version):
            log.error("generator %s reports version %d with checksums %s, learner sent %s", gid, version, got, sent)
            self._event("weights_mismatch", id=gid, version=version)

    def _ack(self) -> None:
        if self.rank == 0 and self.unacked:
            self.client.xack(self.keys.trajectories, LEARNER_GROUP, *self.unacked)
            self.unacked = []

    def save_checkpoint(self) -> None:
        from learners import checkpoint

        t0 = time.perf_counter()
        meta = {"version": self.version, "step": self.step, "time": time.time(),
                "scheduler": self.scheduler.state_dict(), "kl_ctl": self.kl_ctl.state()}
        if self.critic_scheduler is not None:
            meta["critic_scheduler"] = self.critic_scheduler.state_dict()
        if self.rank == 0:
            meta["cursor"] = {k.decode(): v.decode() for k, v in self.client.hgetall(self.keys.cursor).items()}
        path = checkpoint.save(self.cfg.checkpoint_dir, self.step, self.model, self.optimizer, meta,
                               self.cfg.checkpoint.keep, critic=self._critic_parts(), adapters_only=self.lora)
        # Only now is the update durable: ack the trajectories that shaped it.
        self._ack()
        if self.rank == 0:
            self._event("checkpoint", step=self.step, version=self.version, path=str(path),
                        seconds=f"{time.perf_counter() - t0:.3f}")

    def full_tensors(self):
        """(name, full tensor) in state-dict order; a collective on every rank (FSDP2 all-gather).
        With LoRA: the merged weights under the base model's names (learners/lora.py)."""
        skip = self._tied_aliases()  # the same on every rank, so the all-gathers stay in step
        if self.lora:
            from learners.lora import merged_tensors

            yield from ((n, t) for n, t in merged_tensors(self.model) if n not in skip)
            return
        for name, t in self.model.state_dict().items():
            if name in skip:
                continue
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            yield name, full.detach()

    def _epoch_backend(self, members: list[str]) -> str:
        """weights.backend for an epoch of `members` (`{generator}.{worker}`): see `choose_backend`."""
        if self.cfg.weights.backend != "auto" or not self.cuda:
            return choose_backend(self.cfg.weights.backend, self.cuda, False)
        fleet, here = self.read_fleet(), fleet_rules.node_id()
        ids = {m.rsplit(".", 1)[0] for m in members}
        local = bool(ids) and all(gid in fleet and fleet[gid].node == here for gid in ids)
        return choose_backend("auto", True, local)

    def sync_weights(self) -> float:
        """Pushes the current weights to the fleet (every learner rank takes part in the gathers) and
        returns the seconds this held the learner up: gathering and staging the version, and waiting
        for the previous push. The send itself runs on the push thread (learners/push.py) and is
        collected at the next push, after a step, or before the fleet changes."""
        t0 = time.perf_counter()
        do_send = torch.tensor([0], dtype=torch.long)
        if self.rank == 0:
            members = self.live_members()
            if set(members) != set(self.sender.members) or self.sender.pg is None:
                self._finish_push()  # the push in flight belongs to the old group: it ends first
                # `alive` re-reads the fleet while the epoch's members join
                self.sender.open_epoch(members, self._publish_epoch, self._event, alive=self.live_members)
            do_send[0] = 1 if self.sender.members else 0
        if self.world > 1:
            dist.broadcast(do_send, src=0)
        if not int(do_send[0]):
            return 0.0
        tensors = self.full_tensors()
        if self.rank != 0:
            for _ in tensors:  # take part in every all-gather, in the same order as rank 0
                pass
            return time.perf_counter() - t0
        checksum = checksum_mode(self.cfg.weights.checksum, self.sender.backend)
        # gloo moves host memory: on CUDA the buckets are packed on the CPU (one copy out of the GPU);
        # NCCL and ipc pack on the GPU.
        send_dev = self.device if self.sender.backend in ("nccl", "ipc") else torch.device("cpu")
        if not self.overlap:
            self._push_now(tensors, checksum, send_dev)
            self.sync_s = time.perf_counter() - t0
            return self.sync_s
        try:
            staged = self.sender.stage(self.buckets, pack_buckets(self.buckets, tensors, send_dev), checksum,
                                       slot=self.pushes.next_slot)
        except RuntimeError as e:  # out of memory for the second buffer, say: this version is not pushed
            staged = None
            self._finish_push()
            self._push_failed(self.version, f"staging: {type(e).__name__}: {e}")
        finally:
            for _ in tensors:  # every all-gather is joined, whatever happened (other ranks are in them)
                pass
        if staged is not None:
            self._finish_push()  # the previous version's send: every member has it before this one is announced
        if staged is None or self.sender.pg is None:  # the group was dropped: the next fleet check re-forms it
            self.sync_s = time.perf_counter() - t0
            return self.sync_s
        ann = self._announcement(checksum)
        self.pushes.submit(self.version, self._send, ann, staged)
        self.sync_s = time.perf_counter() - t0
        return self.sync_s

    def _announcement(self, checksum: str) -> schema.WeightAnnouncement:
        return schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=self.version,
                                         epoch=self.sender.epoch, buckets=self.buckets, announced_at=time.time(),
                                         checksum=checksum)

    def _push_now(self, tensors, checksum: str, send_dev: torch.device) -> None:
        """Without the overlap (run.mode=sync, staleness 0, weights.overlap=false): the push on this
        thread, waited for (`WeightSender.broadcast`). Over gloo and NCCL the buckets stream (each
        gathered and packed while earlier ones are on the wire, a large tensor sent from its own
        storage); over ipc the version is staged into the one buffer members read from."""
        self._finish_push()
        ann = self._announcement(checksum)
        t_start = time.time()
        try:
            set_and_notify(self.client, self.keys, self.keys.wsync, schema.encode(ann), "weights")
            sums = self.sender.broadcast(self.buckets, pack_buckets(self.buckets, tensors, send_dev), checksum,
                                         version=ann.version)
        except RuntimeError as e:  # SyncTimeout too: a member died mid-push, a load failed, out of memory
            self._push_failed(ann.version, f"{type(e).__name__}: {e}")
            return
        finally:
            for _ in tensors:  # every all-gather is joined, whatever happened (other ranks are in them)
                pass
        from learners.push import PushResult

        self._pushed(PushResult(ann.version, sums, "", t_start, time.time(), 0.0))

    def _send(self, ann: schema.WeightAnnouncement, staged) -> list[int]:
        """On the push thread: announce (the wake-up lets generators join at once instead of at their
        next poll), then send."""
        set_and_notify(self.client, self.keys, self.keys.wsync, schema.encode(ann), "weights")
        return self.sender.send(self.buckets, staged, ann.version)

    def _milestone(self, what: str, t: float | None = None) -> None:
        """Marks a start-up milestone once (asyncrl/observe/timeline.py); after the first push, prints
        the timeline."""
        if what in self.milestones:
            return
        from asyncrl.observe import timeline

        self.milestones.add(what)
        timeline.mark(self.client, self.keys, what, t)
        if what == "first push":
            marks = timeline.parse(self.client.hgetall(self.keys.timeline))
            print(f"startup: {timeline.describe(marks)}", flush=True)

    def _finish_push(self, block: bool = True) -> None:
        """Collects the push in flight (waiting for it when `block`): its checksums go to the weight
        check; a failure (a member died mid-push, a timeout) drops the group, which the next fleet
        check re-forms from the live heartbeats."""
        done = self.pushes.collect(block)
        if done is None:
            return
        self.push_wait_s += done.waited_s
        if done.sums is None:
            self._push_failed(done.version, done.error)
        else:
            self._pushed(done)

    def _pushed(self, done) -> None:
        self.last_push = done
        self.last_checksums = done.sums
        self.weight_check.sent(done.version, done.sums)
        self._event("sync", version=done.version, epoch=self.sender.epoch,
                    seconds=f"{done.done_at - done.started_at:.4f}", members=len(self.sender.members))
        if done.version > 0:  # version 0 is the weights the generators started from
            self._milestone("first push", done.done_at)

    def _push_failed(self, version: int, error: str) -> None:
        log.error("weight sync of version %d failed: %s; dropping the group", version, error)
        self._event("sync_failed", version=version, epoch=self.sender.epoch, error=error[:200])
        self.sender.drop_group()

    def _publish_epoch(self, info: schema.GroupEpoch) -> None:
        set_and_notify(self.client, self.keys, self.keys.wgroup, schema.encode(info), "weights")

    def _event(self, kind: str, **fields) -> None:
        log_event(self.client, self.keys, kind, **fields)

    def _verify_last_push(self, fleet: dict[str, schema.Heartbeat],
                          timeout_s: float = 30.0) -> dict[str, schema.Heartbeat]:
        """After the last step's push, wait (bounded) until every live generator reports holding it,
        so that the final version is verified too: `verify_fleet_weights` runs right after the
        broadcast, before a generator has loaded it and said so in its heartbeat (a 2-step CPU run
        of SmolLM2 verified 2 of its 3 pushes). Returns the last fleet snapshot it read."""
        self._finish_push()
        check = self.weight_check
        if self.version not in check.synced:
            return fleet  # not pushed (weights.sync_every) or the push failed
        deadline = time.monotonic() + min(timeout_s, self.cfg.weights.sync_timeout_s)
        ids = {member.rsplit(".", 1)[0] for member in self.sender.members}  # who was sent it
        while not all((gid, self.version) in check.verified for gid in ids):
            if time.monotonic() >= deadline:
                log.warning("not every generator reported version %d within %.0fs of the last push", self.version,
                            timeout_s)
                break
            time.sleep(0.1)
            fleet = self.read_fleet()
            self.verify_fleet_weights(fleet)
        return fleet

    def after_step(self, groups: list[schema.TrajectoryGroup], stats: dict, sync_s: float,
                   fleet: dict[str, schema.Heartbeat]) -> None:
        """The step's row; `fleet` is the heartbeat snapshot read after the step (its weight check
        ran on it), used for the generator metrics."""
        if self.step >= self.cfg.run.max_steps:
            fleet = self._verify_last_push(fleet)
        trained_version = self.version - 1
        lags = []
        for g in groups:
            for s in g.samples:
                lags.extend((trained_version - schema.unpack_i32(s.versions)).tolist())
        rewards = [s.reward for g in groups for s in g.samples]
        if getattr(self, "gen_rate", None) is None:
            from asyncrl.observe.metrics import FleetTokenRate

            self.gen_rate = FleetTokenRate(start=self.t_start)
        counters = {gid: float(hb.tokens) for gid, hb in fleet.items()}
        if self.resumed_from and not self.gen_rate.counters:
            self.gen_rate.counters = dict(counters)  # made before this learner started: not in its window
        gen_tps = self.gen_rate.update(counters, time.monotonic())
        if getattr(self, "learn_rate", None) is None:
            from asyncrl.observe.metrics import WindowRate

            self.learn_rate = WindowRate(start=self.t_start)
        learn_tps = self.learn_rate.add(stats["tokens"], time.monotonic())
        elapsed = time.monotonic() - self.t_start
        depth = group_lag(self.client, self.keys.trajectories, LEARNER_GROUP)
        row = {
            "step": self.step, "version": self.version, "time": time.time(), "elapsed_s": elapsed,
            "reward_mean": sum(rewards) / len(rewards), "reward_max": max(rewards),
            "lag_mean": sum(lags) / max(len(lags), 1), "lag_max": max(lags) if lags else 0,
            "lag_hist": {str(k): lags.count(k) for k in sorted(set(lags))},
            "dropped_stale": self.dropped_stale, "dropped_zero_var": self.dropped_zero_var,
            "quarantined": self._quarantine().num,
            "num_groups": len(groups),
            "gen_tokens_per_s": gen_tps, "learner_tokens_per_s": learn_tps,
            "learner_step_tokens_per_s": stats["tokens"] / max(stats["step_s"], 1e-9),
            "sync_s": sync_s, "buffer_depth": depth, "idle_ratio": self.idle_s / max(elapsed, 1e-9),
            "num_generators": len(fleet), "weights_verified": self.weight_check.num_verified,
            "weights_mismatch": self.weight_check.num_mismatch,
            "generators_in_batch": sorted({g.generator_id for g in groups}),
            **{k: v for k, v in stats.items() if k not in ("tokens",)}, "tokens": stats["tokens"],
            "sample_age_s": time.time() - min(g.created_at for g in groups),
            # Where the learner's time went since the last row: computing the step, waiting for a batch,
            # waiting for the previous push (within sync_s, which adds gathering and staging this one).
            "compute_s": stats["step_s"], "data_wait_s": self.data_wait_s, "push_wait_s": self.push_wait_s,
        }
        if (push := self.last_push) is not None:  # the push collected since the last row: when it started, was done
            row.update(push_version=push.version, push_started_at=push.started_at, push_done_at=push.done_at,
                       push_s=push.done_at - push.started_at)
        self.data_wait_s = self.push_wait_s = 0.0
        self.last_push = None
        baselines = [g.baseline_reward for g in groups if g.baseline_reward is not None]
        if baselines:  # advantage=remax: the greedy completions' rewards the samples were measured against
            row["baseline_reward_mean"] = sum(baselines) / len(baselines)
        from asyncrl.observe.episodes import episode_metrics

        row.update(episode_metrics(groups))  # episode/*: multi-turn episodes' turns, tool calls, environment time
        row.update(self.evaluator.after_step(self.step, self.version))  # eval/* of a round that finished
        self.obs.on_step(row, rewards, fleet)  # adds reward quantiles, dropped fraction, fleet metrics
        self.client.hset(self.keys.learner, mapping={"step": self.step, "version": self.version,
                                                     "idle_ratio": row["idle_ratio"], "updated_at": time.time(),
                                                     "tokens_per_s": row["learner_tokens_per_s"],
                                                     **{k: row[k] for k in ("compute_s", "data_wait_s", "sync_s",
                                                                            "push_wait_s")}})
        print(f"step={self.step:4d} version={self.version:4d} reward={row['reward_mean']:.3f} "
              f"lag={row['lag_mean']:.2f}/{row['lag_max']} dropped_stale={self.dropped_stale} "
              f"dropped_frac={row['dropped_frac']:.3f} "
              f"gen_tok/s={gen_tps:8.1f} learn_tok/s={row['learner_tokens_per_s']:8.1f} "
              f"compute_s={row['compute_s']:.3f} wait_s={row['data_wait_s']:.3f} "
              f"sync_s={sync_s:.3f} depth={depth} loss={stats['loss']:+.4f}", flush=True)


def main(cfg: Config) -> None:
    learner = Learner(cfg)
    try:
        learner.run()
    finally:
        dist.destroy_process_group()
