"""The Hugging Face backend (`generator.backend=hf`): plain transformers sampling, for debugging and
machines without vLLM. The same interface as VllmEngine (generators/engines.py `Engine`).

Each group is decoded as a batch of `n` rows of the same prompt (so no padding), one forward per
token with the KV cache. Steps of all in-flight groups and weight loads run on one worker thread,
so an update lands between two decoding steps: `keep` continues on the cached keys/values, `abort`
re-prefills each in-flight sequence (prompt + tokens so far) under the new weights, `drain` waits
for the in-flight groups to finish. Behaviour log-probs are "processed" ones, like vLLM's
`processed_logprobs`: log_softmax of logits / temperature after top-k / top-p filtering.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from asyncrl.config import Config
from asyncrl.protocol import schema
from asyncrl.protocol.weight_sync import WeightReceiver
from generators.engines import SampleOut, WeightUpdateStats

log = logging.getLogger(__name__)


def filter_logits(logits_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Sets logits outside the top-k / nucleus (top-p) set to -inf (the token that crosses p is kept)."""
    if top_k > 0 and top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits_BV, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= top_p  # mass before this token already >= p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits_BV = logits_BV.masked_fill(drop, float("-inf"))
    return logits_BV


@dataclass
class _Group:
    rows: list[list[int]]  # prompt + every token so far, finished rows included (lockstep, equal lengths)
    samples: list[SampleOut]
    temperature: float
    past: object = None
    cache_weights: int = -1  # self.num_loads when `past` was computed


class HfEngine:
    def __init__(self, cfg: Config, model_path: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        g = cfg.generator
        self.cfg = cfg
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = "auto" if g.dtype == "auto" else getattr(torch, g.dtype)
        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        self.eos_id = AutoTokenizer.from_pretrained(model_path).eos_token_id
        self.rng = torch.Generator(device=self.device).manual_seed(cfg.run.seed)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")  # steps and loads
        self.num_workers = 1
        self.receiver: WeightReceiver | None = None
        self.loaded_version: int | None = None
        self.num_loads = 0
        self.num_steps = 0  # decoding steps (forwards) run
        self.mode = cfg.weights.mode
        self.num_active = 0
        self.num_resubmitted = 0
        self._admit = asyncio.Event()  # cleared while a drain-mode update waits for in-flight groups
        self._admit.set()
        log.info("HF engine up in %.1fs (model=%s, device=%s)", time.perf_counter() - t0, model_path, self.device)

    # ---- sampling ------------------------------------------------------------------------------

    @torch.no_grad()
    def _step(self, grp: _Group) -> tuple[list[int], list[float]]:
        rows = grp.rows
        if grp.past is not None and grp.cache_weights != self.num_loads and self.mode == "abort":
            grp.past = None  # abort: re-prefill the partial sequences under the new weights
            self.num_resubmitted += len(rows)
        if grp.past is None:
            ids = torch.tensor(rows, device=self.device)
        else:
            ids = torch.tensor([[r[-1]] for r in rows], device=self.device)
        out = self.model(input_ids=ids, past_key_values=grp.past, use_cache=True)
        grp.past, grp.cache_weights = out.past_key_values, self.num_loads
        self.num_steps += 1
        logits = out.logits[:, -1, :].float()
        if grp.temperature == 0.0:  # greedy (evaluation)
            logp = torch.log_softmax(logits, -1)
            tok = logp.argmax(-1, keepdim=True)
        else:
            g = self.cfg.generator
            logp = torch.log_softmax(filter_logits(logits / grp.temperature, g.top_k, g.top_p), -1)
            tok = torch.multinomial(logp.exp(), 1, generator=self.rng)
        toks = tok[:, 0].tolist()
        for r, t in zip(rows, toks, strict=True):
            r.append(t)
        return toks, logp.gather(-1, tok)[:, 0].tolist()

    async def generate_group(self, prompt_ids: list[int], n: int, version: Callable[[], int],
                             temperature: float | None = None, max_tokens: int | None = None) -> list[SampleOut]:
        await self._admit.wait()
        loop = asyncio.get_running_loop()
        temperature = self.cfg.generator.temperature if temperature is None else temperature
        grp = _Group([list(prompt_ids) for _ in range(n)], [SampleOut() for _ in range(n)], temperature)
        self.num_active += 1
        try:
            for _ in range(self.cfg.generator.max_tokens if max_tokens is None else max_tokens):
                toks, lps = await loop.run_in_executor(self.pool, self._step, grp)
                v = self.loaded_version if self.loaded_version is not None else version()
                for s, t, lp in zip(grp.samples, toks, lps, strict=True):
                    if s.finish_reason:
                        continue  # a finished row rides along (equal lengths); its extra tokens are dropped
                    s.token_ids.append(t)
                    s.logprobs.append(lp)
                    s.versions.append(v)
                    if t == self.eos_id:
                        s.finish_reason = "stop"
                if all(s.finish_reason for s in grp.samples):
                    break
        finally:
            self.num_active -= 1
        for s in grp.samples:
            s.finish_reason = s.finish_reason or "length"
        return grp.samples

    # ---- weights -------------------------------------------------------------------------------

    async def join(self, epoch_frame: bytes, generator_id: str, timeout_s: float) -> bool:
        info = schema.decode(epoch_frame, schema.GroupEpoch)
        if self.receiver is None:
            self.receiver = WeightReceiver(f"{generator_id}.0")
        return await asyncio.to_thread(self.receiver.join, info, timeout_s)

    @torch.no_grad()
    def _load(self, ann: schema.WeightAnnouncement, timeout_s: float) -> dict:
        t0 = time.perf_counter()
        try:
            state = dict(self.receiver.receive(ann, self.device, timeout_s))
            unexpected = set(state) - set(self.model.state_dict())
            assert not unexpected, f"received tensors the model does not have: {sorted(unexpected)[:5]}"
            self.model.load_state_dict(state, strict=False)
        except Exception as e:
            self.receiver.finish(ann, error=f"{type(e).__name__}: {e}")
            raise
        self.receiver.finish(ann)  # ipc: the learner may write its buffer again
        self.num_loads += 1
        self.loaded_version = ann.version
        return {"checksums": self.receiver.checksums, "seconds": time.perf_counter() - t0}

    async def update_weights(self, announcement_frame: bytes, mode: str, timeout_s: float) -> WeightUpdateStats:
        """keep/abort: loaded between two decoding steps; drain: after the in-flight groups finish."""
        ann = schema.decode(announcement_frame, schema.WeightAnnouncement)
        self.mode = mode
        t0 = time.perf_counter()
        if mode == "drain":
            self._admit.clear()
            while self.num_active:
                await asyncio.sleep(0.005)
        t_paused = time.perf_counter()
        try:
            result = await asyncio.get_running_loop().run_in_executor(self.pool, self._load, ann, timeout_s)
        finally:
            self._admit.set()
        t1 = time.perf_counter()
        return {"pause_s": t1 - t0, "wait_s": t_paused - t0, "receive_s": result["seconds"],
                "checksums": result["checksums"]}

    async def idle(self) -> None:
        """Nothing to release: the HF backend holds no cache between groups."""

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
