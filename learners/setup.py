"""The learner's trained parts, built on every rank: the policy (FSDP2, LoRA), the frozen reference,
the critic, their optimizers and learning-rate schedules, the KL controller, and the resume from the
latest checkpoint.
"""

from __future__ import annotations

import logging
import math
import os
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM

from asyncrl.algorithms.losses import AdaptiveKLController
from asyncrl.config import Config
from asyncrl.protocol.weight_sync import to_dtype
from learners import checkpoint, packing
from learners.critic import load_value_model
from learners.flops import ModelFlops, device_peak_flops
from learners.lora import adapters_disabled, apply_lora, base_name, merged_shapes, merged_tensors

log = logging.getLogger("learners.trainer")  # the learner's records keep the one name they have always had


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


AUTO_COMPILE_PARAMS = 400_000_000  # learner.compile=auto compiles models at least this large, on CUDA


def compile_wanted(setting, device: torch.device, model) -> bool:
    """learner.compile: `auto` is on CUDA for models of at least AUTO_COMPILE_PARAMS parameters (below,
    steps are short and the ~15 s of compilation outweighs what it saves in a short run)."""
    if setting != "auto":
        return bool(setting)
    return device.type == "cuda" and sum(p.numel() for p in model.parameters()) >= AUTO_COMPILE_PARAMS


def keep_compile_cache() -> None:
    """Compiled kernels cached across runs (TORCHINDUCTOR_CACHE_DIR, unless set: ~/.cache/asyncrl/inductor),
    and room for the graphs of every decoder layer and micro-batch shape before dynamo gives up on one."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asyncrl" / "inductor"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))


def generator_share(cfg: Config, device: torch.device, model_params: int) -> int:
    """Bytes a local generator's engine on this GPU will hold that it does not hold yet. `asyncrl run`
    puts its engines on the first GPU, beside learner rank 0, and tells the learner so
    (ASYNCRL_LOCAL_ENGINES); a learner started otherwise (by hand, Slurm, Ray) has its GPUs to itself.
    The share: generator.kv_cache_memory_gb + the weights + 2 GiB, or gpu_memory_utilization of the
    device, less what other processes hold now."""
    g = cfg.generator
    local_engines = int(os.environ.get("ASYNCRL_LOCAL_ENGINES", "0") or 0)
    if device.type != "cuda" or (device.index or 0) != 0 or not local_engines or g.num_generators == 0:
        return 0
    free, total = torch.cuda.mem_get_info(device)
    share = int(g.kv_cache_memory_gb * 2**30 + model_params * 2 + 2 * 2**30) if g.kv_cache_memory_gb else \
        int(g.gpu_memory_utilization * total)
    others = total - free - torch.cuda.memory_reserved(device) - 2**29  # less this process's CUDA context
    return max(0, share - max(0, others))


def memory_needs(cfg: Config, trainable: list, world: int, config, generator_bytes: int = 0) -> packing.MemoryNeeds:
    """What a rank still allocates besides the activations once its models are loaded: each trainable
    parameter shard's gradient and two AdamW moments (none on the device with param_offload), the
    gathered compute-dtype copies FSDP2 keeps without resharding, the output head's chunk workspace,
    the kept logits (learner.keep_logits_gb) and `generator_bytes`."""
    lc = cfg.learner
    dtype = to_dtype(lc.mixed_precision.param_dtype)
    reshard, _ = fsdp_switches(lc, world)
    pending = 0
    for m in trainable:
        params = list(m.parameters())
        if not lc.param_offload:
            for p in params:
                if p.requires_grad:
                    local = p.to_local() if hasattr(p, "to_local") else p
                    pending += 3 * local.numel() * local.element_size()
        if not reshard and dtype != torch.float32:
            pending += sum(p.numel() for p in params) * dtype.itemsize
    reserve = packing.head_workspace_bytes(config, dtype) + int(lc.keep_logits_gb * 2**30) + generator_bytes
    return packing.MemoryNeeds(pending=pending, reserve=reserve)


class Parts:
    """What the learner trains and holds, the same on every rank (each holding its shards)."""

    def __init__(self, cfg: Config, rank: int, world: int, device: torch.device, mesh):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.cuda = device.type == "cuda"
        lc, alg = cfg.learner, cfg.algorithm
        self.lora = lc.lora.enabled  # learners/lora.py: adapters under FSDP2, merged weights on the wire
        self.model = model = self._build_model(mesh, trainable=True, lora=self.lora)
        # With LoRA only the adapters require grad: the optimizer (and its state) holds nothing else.
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lc.lr,
                                           weight_decay=lc.weight_decay, fused=self.cuda and not lc.param_offload)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda)
        self.kl_ctl = AdaptiveKLController(alg.kl_coef, alg.kl_target or None, alg.kl_horizon)
        # The reference is the initial policy, frozen; only loaded when a KL term needs it. With LoRA
        # it is the policy's own frozen base with the adapters switched off (lora.adapters_disabled):
        # exactly the initial policy, and no second copy of the weights, which is what LoRA saves.
        self.ref_model = None
        self.ref_checksum = 0.0
        if alg.kl_coef > 0:
            self.ref_model = model if self.lora else self._build_model(mesh, trainable=False)
            self.ref_checksum = self._ref_checksum()
        self._build_critic(mesh)
        compute_dtype = to_dtype(lc.mixed_precision.param_dtype)
        self.micro_batch_tokens, self.activation_checkpointing = self._size_micro_batches(compute_dtype)
        # The `mfu` metric: the step's model FLOPs (learners/flops.py) over the device's peak.
        self.policy_flops = ModelFlops.of(model)
        self.critic_flops = ModelFlops.of(self.critic, with_head=False) if self.critic is not None else None
        self.peak_flops, peak_source = device_peak_flops(device, lc.peak_tflops)
        self.attention = "padded"
        if lc.packing:
            for m in {id(x): x for x in (model, self.ref_model, self.critic) if x is not None}.values():
                self.attention = packing.packed_attention(m, device, compute_dtype)
        if rank == 0:
            log.info("micro-batches of at most %d tokens a rank, attention: %s, activation checkpointing: %s, "
                     "compiled layers: %s, peak %.0f TFLOP/s (%s)", self.micro_batch_tokens, self.attention,
                     self.activation_checkpointing, self.compiled, self.peak_flops / 1e12, peak_source)
        self.pad_id = model.config.pad_token_id or 0
        self.aliases = self._tied_aliases()

    def _size_micro_batches(self, compute_dtype: torch.dtype) -> tuple[int, bool]:
        """(tokens per micro-batch, activation checkpointing), the same on every rank (the plan depends
        on them): learner.micro_batch_tokens or what the memory free now holds (learners/packing.py),
        checkpointing `auto` switched on here where the micro-batch fits only with it."""
        lc, g = self.cfg.learner, self.cfg.generator
        trainable = [m for m in (self.model, self.critic) if m is not None]
        if not self.cuda:
            tokens, ckpt = lc.micro_batch_tokens or 8192, lc.activation_checkpointing is True
        else:
            num_params = sum(p.numel() for p in self.model.parameters())
            needs = memory_needs(self.cfg, trainable, self.world, self.model.config,
                                 generator_share(self.cfg, self.device, num_params))
            free, _ = torch.cuda.mem_get_info(self.device)
            tokens, ckpt = packing.choose_micro_batch(free, self.model.config, compute_dtype,
                                                      lc.activation_checkpointing, needs, lc.micro_batch_tokens,
                                                      max(packing.MIN_AUTO_TOKENS, g.max_model_len))
        if self.world > 1:
            both = torch.tensor([tokens, -int(ckpt)], device=self.device)
            dist.all_reduce(both, op=dist.ReduceOp.MIN)
            tokens, ckpt = int(both[0]), bool(both[1] < 0)
        if ckpt and lc.activation_checkpointing == "auto":
            for m in trainable:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return tokens, ckpt

    def _build_critic(self, mesh) -> None:
        """advantage=gae: a value model with its own optimizer and schedule (learners/critic.py); full
        parameters even when the policy has LoRA."""
        cfg, lc = self.cfg, self.cfg.learner
        self.critic = self.critic_optimizer = self.critic_scheduler = None
        if cfg.algorithm.advantage != "gae":
            return
        self.critic = self._shard(load_value_model(lc.critic_path or cfg.model_path), mesh)
        self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=lc.critic_lr,
                                                  weight_decay=lc.weight_decay,
                                                  fused=self.cuda and not lc.param_offload)
        self.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(self.critic_optimizer, self._lr_lambda)

    def _build_model(self, mesh, trainable: bool, lora: bool = False):
        """An FSDP2 model with the verl-style switches of `learner.*`; the reference (not trainable)
        gets the same sharding (none at world size 1) and is held in the compute dtype, with no grads,
        and is never stepped. LoRA adapters go in before `fully_shard` (learners/lora.py says why
        that order)."""
        model = AutoModelForCausalLM.from_pretrained(self.cfg.model_path, dtype=torch.float32)
        model.config.use_cache = False
        if not trainable:
            # Frozen: held in the compute dtype, which is what mixed precision would cast it to on
            # every forward anyway (the same rounding), at half the memory and no per-step cast.
            mp = self.cfg.learner.mixed_precision
            model.requires_grad_(False).eval().to(to_dtype(mp.param_dtype))
        if lora:
            model = apply_lora(model, self.cfg.learner.lora)
        return self._shard(model, mesh, trainable)

    def _shard(self, model, mesh, trainable: bool = True):
        """`fully_shard` each decoder layer (`model.model.layers`, or `model.layers` for the critic),
        then the root."""
        lc = self.cfg.learner
        if trainable and lc.activation_checkpointing is True:
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
        self.compiled = compile_wanted(lc.compile, self.device, model)
        if self.compiled:
            keep_compile_cache()
        for layer in layers:
            if self.compiled:
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

    def reference(self):
        """The context the reference's forward runs in: with LoRA, the policy with its adapters off."""
        return adapters_disabled(self.model) if self.lora else nullcontext()

    def optimizers(self) -> list[tuple]:
        """(optimizer, scheduler) of the policy, and of the critic when there is one."""
        parts = [(self.optimizer, self.scheduler)]
        if self.critic is not None:
            parts.append((self.critic_optimizer, self.critic_scheduler))
        return parts

    def critic_parts(self):
        return (self.critic, self.critic_optimizer) if self.critic is not None else None

    def resume(self) -> tuple[str | None, int, int]:
        """(the checkpoint resumed from or None, its version, its step), per `checkpoint.resume`."""
        mode = self.cfg.checkpoint.resume
        path = None if mode == "never" else checkpoint.latest(self.cfg.checkpoint_dir)
        if path is None:
            if mode == "must":
                raise FileNotFoundError(f"checkpoint.resume=must but no complete checkpoint in {self.cfg.checkpoint_dir}")
            return None, 0, 0
        meta = checkpoint.load(path, self.model, self.optimizer, critic=self.critic_parts(),
                               adapters_only=self.lora)
        version, step = int(meta["version"]), int(meta["step"])
        if "scheduler" in meta:
            self.scheduler.load_state_dict(meta["scheduler"])
        if self.critic_scheduler is not None:
            self.critic_scheduler.load_state_dict(meta["critic_scheduler"])
        if "kl_ctl" in meta:
            self.kl_ctl.load(meta["kl_ctl"])
        log.info("resumed from %s: step=%d version=%d", path, step, version)
        return path, version, step

    def training_state(self) -> dict:
        """The schedules' and the KL controller's state, for a checkpoint's meta."""
        state = {"scheduler": self.scheduler.state_dict(), "kl_ctl": self.kl_ctl.state()}
        if self.critic_scheduler is not None:
            state["critic_scheduler"] = self.critic_scheduler.state_dict()
        return state

    def save(self, step: int, meta: dict):
        """A checkpoint of step `step` (a collective on every rank); returns its path."""
        return checkpoint.save(self.cfg.checkpoint_dir, step, self.model, self.optimizer, meta,
                               self.cfg.checkpoint.keep, critic=self.critic_parts(), adapters_only=self.lora)

    def wire_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of what `full_tensors` yields: the base model's names, merged when LoRA,
        each tied tensor once."""
        skip = self.aliases
        if self.lora:
            return [(n, shape) for n, shape in merged_shapes(self.model) if n not in skip]
        return [(n, tuple(t.shape)) for n, t in self.model.state_dict().items() if n not in skip]

    def _tied_aliases(self) -> set[str]:
        """The second names of tied tensors (the base model's names under LoRA)."""
        aliases = tied_aliases(self.model)
        return {base_name(n) for n in aliases} if self.lora else aliases

    def full_tensors(self):
        """(name, full tensor) in state-dict order; a collective on every rank (FSDP2 all-gather).
        With LoRA: the merged weights under the base model's names (learners/lora.py)."""
        skip = self.aliases  # the same on every rank, so the all-gathers stay in step
        if self.lora:
            yield from ((n, t) for n, t in merged_tensors(self.model) if n not in skip)
            return
        for name, t in self.model.state_dict().items():
            if name in skip:
                continue
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            yield name, full.detach()
