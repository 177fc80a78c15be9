"""The vLLM backend: one AsyncLLM engine (continuous batching), same code on the CPU build and CUDA."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.config import Config

log = logging.getLogger(__name__)


@dataclass
class SampleOut:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""


def cpu_env_defaults(cfg: Config) -> None:
    """CPU-build settings that must be in the environment before vLLM is imported."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(cfg.generator.kv_cache_gb))))
    # Several engines share a few cores here: let the OS schedule them instead of pinning all to core 0.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.generator.cpu_threads))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")


class VllmEngine:
    def __init__(self, cfg: Config, model_path: str):
        import torch

        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            cpu_env_defaults(cfg)
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        g = cfg.generator
        kwargs = dict(
            model=model_path,
            dtype=g.dtype,
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
        if on_cpu:
            kwargs["kv_cache_memory_bytes"] = int(g.kv_cache_gb * 2**30)
        t0 = time.perf_counter()
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        self.num_workers = g.tensor_parallel_size
        log.info("vLLM engine up in %.1fs (model=%s, cpu=%s)", time.perf_counter() - t0, model_path, on_cpu)
        self.cfg = cfg

    def sampling_params(self, n: int, temperature: float | None = None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        g = self.cfg.generator
        temperature = g.temperature if temperature is None else temperature  # 0.0: greedy (evaluation)
        return SamplingParams(n=n, temperature=temperature, top_p=g.top_p, top_k=max(g.top_k, 0),
                              max_tokens=g.max_tokens, logprobs=0, output_kind=RequestOutputKind.DELTA)

    async def generate_group(self, prompt_ids: list[int], n: int, version: Callable[[], int],
                             temperature: float | None = None) -> list[SampleOut]:
        """Samples `n` completions; each token is stamped with the policy version held when it arrived."""
        from vllm.inputs import TokensPrompt

        samples = [SampleOut() for _ in range(n)]
        request_id = uuid.uuid4().hex
        async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids),
                                              self.sampling_params(n, temperature),
                                              request_id=request_id):
            v = version()
            for c in out.outputs:
                s = samples[c.index]
                for tid, lp in zip(c.token_ids, c.logprobs or [], strict=True):
                    s.token_ids.append(tid)
                    s.logprobs.append(lp[tid].logprob)
                    s.versions.append(v)
                if c.finish_reason:
                    s.finish_reason = c.finish_reason
        return samples

    async def join(self, epoch_frame: bytes, generator_id: str, timeout_s: float) -> bool:
        results = await self.engine.collective_rpc("asyncrl_join", args=(epoch_frame, generator_id, timeout_s))
        return all(results)

    async def update_weights(self, announcement_frame: bytes, mode: str, timeout_s: float) -> dict:
        """Pauses (keep: in-flight sequences continue afterwards under the new weights; drain: they
        finish first), receives and loads the weights in every worker, resumes. Returns timings."""
        t0 = time.perf_counter()
        await self.engine.pause_generation(mode="keep" if mode == "keep" else "wait", clear_cache=True)
        t_paused = time.perf_counter()
        try:
            results = await self.engine.collective_rpc("asyncrl_receive", args=(announcement_frame, timeout_s))
        finally:
            await self.engine.resume_generation()
        t1 = time.perf_counter()
        return {"pause_s": t1 - t0, "wait_s": t_paused - t0, "receive_s": max(r["seconds"] for r in results),
                "checksums": results[0]["checksums"]}

    def shutdown(self) -> None:
        self.engine.shutdown()
        # Drop the last reference now: AsyncLLM.__del__ during interpreter exit fails noisily.
        del self.engine
