"""The vLLM backend: one AsyncLLM engine (continuous batching), same code on the CPU build and CUDA."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable

from asyncrl.config import Config
from asyncrl.launch.leaving import child_pids, kill_children
from generators.engines import SampleOut, WeightUpdateStats

log = logging.getLogger(__name__)


def cpu_env_defaults(cfg: Config) -> None:
    """CPU-build settings that must be in the environment before vLLM is imported."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(cfg.generator.kv_cache_gb))))
    # Several engines share a few cores here: let the OS schedule them instead of pinning all to core 0.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.generator.cpu_threads))
    # With one worker, vLLM's CPU build runs it inside the engine core process (its "uni" executor)
    # when this is 0; at 1 it forces its multiprocessing executor, which spawns the worker as a third
    # process. AsyncLLM runs its engine core in a process of its own either way. Measured on one CPU
    # with the tiny model: the engine up in 10.7 s against 19.5 s (a spawned process re-imports vLLM
    # and torch), and no engine core spinning on sched_yield beside its worker for the same core.
    # Tensor parallelism keeps the multiprocessing executor: it binds each worker's OpenMP threads.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if cfg.generator.tensor_parallel_size == 1 else "1")


# Set by `asyncrl generator` (generators/entry.py) where nothing in its process has computed with torch.
TORCH_UNUSED = False


def cpu_engine_fork(cfg: Config) -> bool:
    """Whether the CPU build's engine core process is forked from this one rather than spawned (a
    spawned one imports torch and vLLM again: 8 of the tiny engine's 11 s to come up on two cores).
    A fork is safe only while this process has never run torch's OpenMP threads: a child forked after
    that hangs in its first parallel region. So `auto` forks in an `asyncrl generator` process that did
    not write the tiny model (the only torch computation it runs before its engine), with one worker
    (the executor vLLM runs in-process)."""
    start = cfg.generator.engine_start
    return start == "fork" or (start == "auto" and TORCH_UNUSED and cfg.generator.tensor_parallel_size == 1)


def signals_stay_in_forked_children() -> None:
    """Once per process: a child forked from here (vLLM's engine core with engine_start=fork) starts
    with the default SIGTERM and SIGINT and no wakeup fd. It would otherwise inherit Python's wakeup
    fd, the socket on which this process's event loop learns of its own signals: vLLM's SIGTERM to
    its engine core at shutdown would reach the generator's loop as a second SIGTERM of its own (and
    cut its drain short). vLLM's engine core installs its own handlers once it runs."""
    global _SIGNALS_RESET_AT_FORK
    if _SIGNALS_RESET_AT_FORK:
        return
    os.register_at_fork(after_in_child=_default_signals)
    _SIGNALS_RESET_AT_FORK = True


_SIGNALS_RESET_AT_FORK = False


def _default_signals() -> None:
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
    except ValueError:  # forked from a thread other than the main one: no handlers of this process's to drop
        pass


STAGE_POLL_S = 0.002  # first interval at which update_weights asks the workers whether staging is done
STAGE_POLL_MAX_S = 0.02  # the interval doubles up to this
STAGED_JOIN_S = 5.0  # how long the paused load waits for a staging thread that has not finished
SHUTDOWN_GRACE_S = 1.0  # what vLLM's shutdown waits for its engine core before it SIGKILLs it


def import_vllm(cfg: Config) -> bool:
    """Sets the environment vLLM reads at import, then imports it (seconds on CPU); True on CPU.
    Idempotent: `asyncrl generator` calls it before waiting for the tiny model, the engine again."""
    import torch

    # Asked through NVML, torch's CUDA check leaves the CUDA runtime of this process uninitialised: the
    # plain check initialises it, and an engine core forked after that cannot use CUDA ("Cannot
    # re-initialize CUDA in forked subprocess").
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    on_cpu = not torch.cuda.is_available()
    # An engine process that dies of a signal (a crash in a native kernel) prints every thread's
    # Python stack into the generator's log instead of vanishing with "engine core exited unexpectedly".
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    if on_cpu:
        cpu_env_defaults(cfg)
    else:
        start = cfg.generator.engine_start
        if start == "auto":
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        else:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = start
    import vllm  # noqa: F401
    import vllm.v1.engine.async_llm  # noqa: F401

    inspect_models_in_a_fork()
    return on_cpu


def inspect_models_in_a_fork() -> None:
    """vLLM inspects a model's class (`_ModelInfo`: its capabilities) in a fresh interpreter,
    `python -m vllm.model_executor.models.registry`, so that its own process never initialises CUDA;
    where that answer is not cached yet (a new VLLM_CACHE_ROOT, a new vLLM) the child imports torch
    and vLLM again: 15-25 s of a cold start, before the engine even begins. This process has imported
    both already and leaves CUDA alone (its CUDA check goes through NVML), so a fork of it gives the
    same answer in about a second; the child sends it back as the JSON vLLM's own cache file holds.
    Anything unexpected (another vLLM, an answer that is not a `_ModelInfo`) goes to vLLM's way."""
    try:
        from vllm.model_executor.models import registry
    except ImportError:
        return
    original = getattr(registry, "_run_in_subprocess", None)
    info_cls = getattr(registry, "_ModelInfo", None)
    if original is None or info_cls is None or getattr(original, "asyncrl_fork", False):
        return

    def run_in_fork(fn):
        import dataclasses
        import json

        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: answer, write, leave without running any of the parent's exit handlers
            code = 1
            try:
                os.close(r)
                info = fn()
                if isinstance(info, info_cls):
                    with os.fdopen(w, "w") as out:
                        json.dump(dataclasses.asdict(info), out)
                    code = 0
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r) as inp:
            text = inp.read()
        _, status = os.waitpid(pid, 0)
        if status == 0 and text:
            try:
                fields = json.loads(text)
                for f in dataclasses.fields(info_cls):  # JSON has lists only
                    if isinstance(fields.get(f.name), list) and "tuple" in str(f.type).lower():
                        fields[f.name] = tuple(fields[f.name])
                return info_cls(**fields)
            except (TypeError, ValueError) as e:
                log.warning("model inspection in a fork gave %s: vLLM's own subprocess instead", e)
        return original(fn)

    run_in_fork.asyncrl_fork = True
    registry._run_in_subprocess = run_in_fork


def sleep_enabled(cfg: Config, on_cpu: bool) -> bool:
    """Whether the engine is built for vLLM's sleep mode (generator.sleep): sync mode on CUDA only. In
    async mode the engine never idles for a learner step; the CPU build has no sleep mode."""
    return cfg.run.mode == "sync" and cfg.generator.sleep != "off" and not on_cpu


def append_delta(s: SampleOut, c, version: int) -> None:
    """Appends one DELTA `CompletionOutput` to its sample: tokens, behaviour log-probs, version stamps.

    The delta's log-probs are its first len(token_ids) positions. vLLM releases before 0.26 slice a
    delta's log-probs as `[-len(token_ids):]`, which for a delta of no tokens (the closing output of
    an aborted request, weights.mode=abort) is the request's whole history; when the consumer lags,
    vLLM merges that delta into the pending one, whose own log-probs then come first."""
    n = len(c.token_ids)
    if n:
        lps = c.logprobs or []
        if len(lps) > n:
            lps = lps[:n]
        flat = getattr(lps, "logprobs", None)  # FlatLogprobs: logprobs=0 -> one per position
        if flat is not None and len(flat) == n:
            s.logprobs.extend(flat)
        else:
            s.logprobs.extend(lp[tid].logprob for tid, lp in zip(c.token_ids, lps, strict=True))
        s.token_ids.extend(c.token_ids)
        s.versions.extend([version] * n)
    if c.finish_reason:
        s.finish_reason = c.finish_reason


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this x86 CPU computes in bf16 natively (AVX512-BF16 or AMX-BF16). Elsewhere (no
    /proc/cpuinfo, another architecture) True: vLLM's own choice stands."""
    try:
        with open(cpuinfo) as f:
            text = f.read(1 << 16)
    except OSError:
        return True
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    return flags is None or not {"avx", "sse2"} & set(flags) or bool({"avx512_bf16", "amx_bf16"} & set(flags))


def engine_dtype(cfg: Config, on_cpu: bool) -> str:
    """`generator.dtype`, except that `auto` on an x86 CPU without bf16 instructions is float32: vLLM's
    `auto` takes bf16 for a float32 model on every x86 CPU, which one without them emulates several
    times slower (SmolLM2-135M's two-step CPU run: 173 s in bf16, 76 s in float32)."""
    if cfg.generator.dtype == "auto" and on_cpu and not cpu_has_bf16():
        return "float32"
    return cfg.generator.dtype


def engine_args(cfg: Config, model_path: str, on_cpu: bool) -> dict:
    """vLLM's engine arguments from the generator's settings; `generator.vllm_kwargs` applied last."""
    g = cfg.generator
    kwargs = dict(
        model=model_path,
        dtype=engine_dtype(cfg, on_cpu),
        seed=cfg.run.seed,
        max_model_len=g.max_model_len,
        enforce_eager=g.enforce_eager,
        enable_prefix_caching=g.enable_prefix_caching,
        tensor_parallel_size=g.tensor_parallel_size,
        gpu_memory_utilization=g.gpu_memory_utilization,
        # Behaviour log-probs after temperature/top-p/top-k: the distribution actually sampled from.
        logprobs_mode="processed_logprobs",
        worker_extension_cls="generators.worker_extension.AsyncRLWorkerExtension",
        disable_log_stats=True,
    )
    if not g.torch_compile and not g.enforce_eager:
        # Full graphs for decode-only batches; batches with a prefill run eager. Plain FULL would also
        # replay graphs for mixed prefill-decode batches wherever the attention backend claims it can
        # (FlashAttention 3 does), and on vLLM 0.25 those corrupt generation: the sampling policy
        # drifted from the trained one (sampled-token entropy 2.0-5.5 nats against the learner's 0.1-1.5).
        kwargs["compilation_config"] = {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY"}
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = int(g.kv_cache_gb * 2**30)
    elif g.kv_cache_memory_gb:
        kwargs["kv_cache_memory_bytes"] = int(g.kv_cache_memory_gb * 2**30)
    kwargs.update({k: v for k in ("max_num_seqs", "max_num_batched_tokens") if (v := getattr(g, k))})
    return {**kwargs, **g.vllm_kwargs}


class VllmEngine:
    def __init__(self, cfg: Config, model_path: str):
        on_cpu = import_vllm(cfg)
        from vllm import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.executor import Executor

        kwargs = engine_args(cfg, model_path, on_cpu)
        self._init_sleep(cfg, on_cpu)
        if self.sleep_mode:  # vLLM's sleep mode needs its memory pool from the start
            kwargs["enable_sleep_mode"] = True
        t0 = time.perf_counter()
        self._children_before = child_pids()  # what shutdown must not kill: not the engine's
        # The batch sizes of vLLM's offline `LLM` for this device where the config leaves them at 0:
        # the engine's own default (128 sequences, 2048 tokens a step) cuts a step's samples into waves.
        args = AsyncEngineArgs(**kwargs)
        vllm_config = args.create_engine_config(UsageContext.LLM_CLASS)
        if on_cpu and cpu_engine_fork(cfg):
            # vLLM's CPU platform has just set spawn while it built the configuration.
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork") == "fork":
            signals_stay_in_forked_children()
        self.engine = AsyncLLM(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config),
                               log_requests=args.enable_log_requests, log_stats=not args.disable_log_stats,
                               usage_context=UsageContext.LLM_CLASS)
        self.num_workers = cfg.generator.tensor_parallel_size
        sched = self.engine.vllm_config.scheduler_config
        log.info("vLLM engine up in %.1fs (model=%s, cpu=%s, engine core by %s, max_num_seqs=%d, "
                 "max_num_batched_tokens=%d)", time.perf_counter() - t0, model_path, on_cpu,
                 os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork"), sched.max_num_seqs,
                 sched.max_num_batched_tokens)
        self.cfg = cfg
        self.loaded_version: int | None = None  # None: the weights on disk (the generator's version applies)
        self.weights_backend = "gloo"  # the weight group's, from the last join
        self.num_resubmitted = 0  # weights.mode=abort: partial sequences continued after an update
        self._resumed = asyncio.Event()  # cleared during an abort-mode update
        self._resumed.set()

    def _init_sleep(self, cfg: Config, on_cpu: bool) -> None:
        """generator.sleep's state: whether the engine may sleep at all (sync mode, CUDA), and its state."""
        self.sleep_mode = sleep_enabled(cfg, on_cpu)
        self.asleep = False
        self.shares_gpu = False  # the last push came over ipc from a learner on this engine's GPU
        self.num_sleeps = 0
        self._active = 0  # generate_group calls and weight loads running: no sleep meanwhile
        self._sleep_lock = asyncio.Lock()

    async def idle(self) -> None:
        """run.mode=sync, nothing leased or in flight: sleeps the engine (generator.sleep_level) so that
        a learner on this GPU may use its memory while it steps. generator.sleep=auto sleeps only once a
        push has come over ipc from this GPU. The next group or weight update wakes it (`_awake`)."""
        if not self.sleep_mode or self.asleep or self._active:
            return
        if self.cfg.generator.sleep == "auto" and not self.shares_gpu:
            return
        async with self._sleep_lock:
            if self.asleep or self._active:
                return
            t0 = time.perf_counter()
            await self.engine.sleep(level=self.cfg.generator.sleep_level)
            self.asleep = True
            self.num_sleeps += 1
            if self.num_sleeps == 1:
                log.info("engine asleep between batches (generator.sleep=%s, level %d): %.3fs to sleep",
                         self.cfg.generator.sleep, self.cfg.generator.sleep_level, time.perf_counter() - t0)

    async def _awake(self) -> float:
        """Wakes a sleeping engine (weights and KV cache); the seconds it took, 0.0 when awake. Takes
        the lock even when awake: an `idle` that is putting the engine to sleep must finish first."""
        if not self.sleep_mode:
            return 0.0
        async with self._sleep_lock:
            if not self.asleep:
                return 0.0
            t0 = time.perf_counter()
            await self.engine.wake_up()
            self.asleep = False
            return time.perf_counter() - t0

    def sampling_params(self, n: int, temperature: float | None = None, max_tokens: int | None = None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        g = self.cfg.generator
        temperature = g.temperature if temperature is None else temperature  # 0.0: greedy (evaluation)
        extra = {}
        if "flat_logprobs" in getattr(SamplingParams, "__struct_fields__", ()):  # one flat float list, not a dict per token
            extra["flat_logprobs"] = True
        return SamplingParams(n=n, temperature=temperature, top_p=g.top_p, top_k=max(g.top_k, 0),
                              max_tokens=g.max_tokens if max_tokens is None else max_tokens, logprobs=0,
                              output_kind=RequestOutputKind.DELTA,
                              detokenize=False, **extra)  # we decode for rewards ourselves; the engine need not

    def _stamp(self, version: Callable[[], int]) -> int:
        # The version of the weights loaded in the engine once it has taken an update: exact even for
        # tokens that arrive between resume_generation() and the generator raising its own version.
        return self.loaded_version if self.loaded_version is not None else version()

    async def _stream(self, prompt_ids: list[int], params, version: Callable[[], int],
                      samples: list[SampleOut]) -> None:
        """Runs one request; child `c.index` appends to samples[c.index]."""
        from vllm.inputs import TokensPrompt

        async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                              request_id=uuid.uuid4().hex):
            v = self._stamp(version)
            for c in out.outputs:
                append_delta(samples[c.index], c, v)

    async def _resubmit(self, prompt_ids: list[int], s: SampleOut, version: Callable[[], int],
                        temperature: float | None, max_tokens: int) -> None:
        """weights.mode=abort: continues a sequence cut off by an update, its tokens so far as the prompt.

        The tokens already generated keep their behaviour log-probs and versions; the continuation is
        sampled (and stamped) under the new weights, and the sample is the two parts concatenated.
        """
        remaining = max_tokens - len(s.token_ids)
        if remaining <= 0:
            s.finish_reason = "length"
            return
        s.finish_reason = ""
        self.num_resubmitted += 1
        await self._stream(prompt_ids + s.token_ids, self.sampling_params(1, temperature, remaining), version, [s])

    async def generate_group(self, prompt_ids: list[int], n: int, version: Callable[[], int],
                             temperature: float | None = None, max_tokens: int | None = None) -> list[SampleOut]:
        """Samples `n` completions; each token is stamped with the policy version it was sampled under."""
        samples = [SampleOut() for _ in range(n)]
        max_tokens = self.cfg.generator.max_tokens if max_tokens is None else max_tokens
        self._active += 1
        try:
            await self._awake()
            await self._stream(prompt_ids, self.sampling_params(n, temperature, max_tokens), version, samples)
            while todo := [s for s in samples if s.finish_reason == "abort"]:
                await self._resumed.wait()  # resubmitting during the update would only be aborted again
                await asyncio.gather(*(self._resubmit(prompt_ids, s, version, temperature, max_tokens)
                                       for s in todo))
        finally:
            self._active -= 1
        return samples

    async def join(self, epoch_frame: bytes, generator_id: str, timeout_s: float) -> bool:
        from asyncrl.protocol import schema

        self.weights_backend = schema.decode(epoch_frame, schema.GroupEpoch).backend
        results = await self.engine.collective_rpc("asyncrl_join", args=(epoch_frame, generator_id, timeout_s))
        return all(results)

    async def _stage(self, announcement_frame: bytes, timeout_s: float) -> None:
        """Receives the weights into host memory in every worker while the engine goes on generating
        (generators/worker_extension.py asyncrl_stage). Raises, before anything is paused, when a
        worker could not start, failed, or is not done within `timeout_s`: the engine then keeps its
        weights and goes on generating. Polls from STAGE_POLL_S, doubling up to STAGE_POLL_MAX_S
        (each poll is a utility call through the engine core's loop)."""
        if not all(await self.engine.collective_rpc("asyncrl_stage", args=(announcement_frame, timeout_s))):
            raise RuntimeError("weight receive failed in a worker: an earlier staging thread is still running")
        deadline, wait = time.monotonic() + timeout_s, STAGE_POLL_S
        while True:
            states = await self.engine.collective_rpc("asyncrl_staged")
            if errors := [s["error"] for s in states if s["done"] and s["error"]]:
                raise RuntimeError(f"weight receive failed in a worker: {errors[0]}")
            if all(s["done"] for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"weight receive failed in a worker: staging not done in {timeout_s}s")
            await asyncio.sleep(wait)
            wait = min(2 * wait, STAGE_POLL_MAX_S)

    async def _pause(self, mode: str) -> None:
        """`AsyncLLM.pause_generation(mode, clear_cache=True)` without its closing fixed 20 ms sleep,
        which vLLM keeps for "a more intuitive ordering of events", not for correctness: it was 20 of
        the ~44 ms each sync paused the tiny model's engine on CPU. What the ordering matters for here
        is the version stamp (`_stamp`): the last outputs before the pause reach the client's output
        queue before the pause's reply (one socket, in order). Before returning, this waits until the
        output handler has emptied that queue, then yields twice so that the streams stamp what it
        handed them; `loaded_version` only moves once the load's reply has come back, later still.
        Falls back to pause_generation where the engine has no scheduler-level pause."""
        core = getattr(self.engine, "engine_core", None)
        if not hasattr(core, "pause_scheduler_async"):
            await self.engine.pause_generation(mode=mode, clear_cache=True)
            return
        renderer = getattr(self.engine, "renderer", None)
        if renderer is not None:
            await renderer.clear_mm_cache_async()
        await core.pause_scheduler_async(mode=mode, clear_cache=True)
        # The reply can overtake outputs still queued for (or being chunked by) the output handler:
        # let it empty its queue, then give the streams their turn.
        queue = getattr(core, "outputs_queue", None)
        for _ in range(1000):
            if queue is None or queue.empty():
                break
            await asyncio.sleep(0)
        for _ in range(2):
            await asyncio.sleep(0)

    async def update_weights(self, announcement_frame: bytes, mode: str, timeout_s: float) -> WeightUpdateStats:
        """Receives and loads the weights in every worker between a pause and a resume. Returns timings:
        pause_s is the time generation stood still.

        Over gloo with weights.atomic (the buckets are staged in host memory anyway) the transfer runs
        before the pause, while the engine generates with the old weights; the pause then covers only
        the load (stage_s: the transfer). Over NCCL, or streaming (atomic=false), the transfer is inside
        the pause.

        keep: in-flight sequences are frozen and continue afterwards under the new weights (the pause
        clears the caches, which preempts them: they are re-prefilled under the new weights); abort:
        they are aborted and `generate_group` resubmits each with its tokens so far (re-prefilled
        under the new weights); drain: they finish first (vLLM's "wait").
        A sleeping engine (generator.sleep) is woken first (wake_s, outside pause_s: nothing was
        generating).
        """
        from asyncrl.protocol import schema

        version = schema.decode(announcement_frame, schema.WeightAnnouncement).version
        staged = self.cfg.weights.atomic and self.weights_backend == "gloo"
        t_stage = time.perf_counter()
        if staged:
            await self._stage(announcement_frame, timeout_s)
        self._active += 1  # `idle` must not put the engine to sleep between the wake and the end of the load
        try:
            wake_s = await self._awake()  # the load writes into the engine's weights: they must be resident
            t0 = time.perf_counter()
            if mode == "abort":
                self._resumed.clear()
            await self._pause({"keep": "keep", "abort": "abort", "drain": "wait"}[mode])
            t_paused = time.perf_counter()
            try:
                if staged:
                    # Staging has finished or used up its timeout: a short wait while paused, not another timeout.
                    results = await self.engine.collective_rpc("asyncrl_load_staged",
                                                               args=(STAGED_JOIN_S, self.cfg.weights.load))
                else:
                    results = await self.engine.collective_rpc(
                        "asyncrl_receive", args=(announcement_frame, timeout_s, self.cfg.weights.atomic,
                                                 self.cfg.weights.load))
                errors = [r["error"] for r in results if r.get("error")]
                if errors:  # nothing was loaded: the engine keeps its previous weights and version
                    raise RuntimeError(f"weight receive failed in a worker: {errors[0]}")
                self.loaded_version = version
                if check := results[0].get("load_check"):
                    log.info("weights.load=%s: %s", self.cfg.weights.load, check)
                self.shares_gpu = self.weights_backend == "ipc" and all(r.get("same_gpu") for r in results)
            finally:
                await self.engine.resume_generation()
                self._resumed.set()
        finally:
            self._active -= 1
        t1 = time.perf_counter()
        return {"pause_s": t1 - t0, "wait_s": t_paused - t0, "receive_s": max(r["seconds"] for r in results),
                "load_s": max(r.get("load_s", r["seconds"]) for r in results), "stage_s": t0 - t_stage,
                "checksums": results[0]["checksums"], "wake_s": wake_s,
                "load_path": results[0].get("load_path", "reload"),
                **{k: max(r.get(k, 0.0) for r in results) for k in ("handle_s", "checksum_s", "finish_s")}}

    def shutdown(self) -> None:
        """Stops the engine and its processes; never raises. vLLM's own shutdown SIGTERMs the engine
        core and waits SHUTDOWN_GRACE_S (its default, 5 s, was overrun on one pinned CPU, where the
        worker's exit alone took seconds), then SIGKILLs what is left; nothing of the engine is kept
        past the generator, so a short grace loses nothing. vLLM's teardown races its own engine
        core's: `kill_process_tree` calls psutil's `name()` on a child that may just have exited,
        which raises NoSuchProcess (not the ProcessLookupError it suppresses). A generator that
        drained cleanly must still exit 0 (a Slurm scale-down counts a non-zero exit as a failed
        job), so a failed teardown is logged, and whatever is left of the engine's processes is
        killed here either way."""
        t0 = time.perf_counter()
        try:
            self.engine.shutdown(timeout=SHUTDOWN_GRACE_S)
        except Exception as e:  # noqa: BLE001 - logged; the processes are killed below
            log.warning("vLLM engine shutdown raised %r; killing what is left of its processes", e)
        killed = kill_children(getattr(self, "_children_before", set()))
        log.info("vLLM engine shut down in %.2fs%s", time.perf_counter() - t0,
                 f" (killed leftover pids {killed})" if killed else "")
        # Drop the last reference now: AsyncLLM.__del__ during interpreter exit fails noisily.
        del self.engine
