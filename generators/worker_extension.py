"""Mixed into every vLLM worker through `worker_extension_cls`; called by `collective_rpc`.

Receives weights over the project's weight group and loads them (`weights.load`): `direct`, one copy
per tensor into the model's parameters (generators/direct_load.py), where the model's layout allows
it; otherwise vLLM's in-place reload path (`reload_weights(..., is_checkpoint_format=True)` inside
`set_current_vllm_config`), which copes with any layout. Under `auto` the first version is loaded by
the reload path and the direct plan is checked against what it loaded; later versions go direct
only if every tensor matched. Method names are prefixed: vLLM asserts that an extension never
shadows a worker attribute.

Staged updates (gloo, weights.atomic): `asyncrl_stage` receives every bucket into host memory on a
thread of the worker while the engine goes on generating; `asyncrl_staged` says whether that thread
is done; `asyncrl_load_staged` (engine paused) loads what it received. Generation then stops only for
the load, not for the transfer.

CUDA IPC (weights.backend=ipc): the worker opens the learner's bucket buffer by its handle and loads
from it directly (device to device), then confirms; nothing is staged.
"""

from __future__ import annotations

import threading
import time

import torch

from asyncrl.protocol import schema
from asyncrl.protocol.weight_sync import WeightReceiver
from generators.direct_load import DirectLoader, Unsupported


class AsyncRLWorkerExtension:
    def asyncrl_join(self, epoch_frame: bytes, generator_id: str, timeout_s: float) -> bool:
        info = schema.decode(epoch_frame, schema.GroupEpoch)
        member_id = f"{generator_id}.{self.rank}"
        receiver = getattr(self, "_asyncrl_receiver", None)
        if receiver is None:
            receiver = self._asyncrl_receiver = WeightReceiver(member_id)
        return receiver.join(info, timeout_s)

    def asyncrl_stage(self, announcement_frame: bytes, timeout_s: float) -> bool:
        """Starts receiving the announced weights on a thread; returns at once. False (nothing
        started) while an earlier staging thread is still alive: two receives must never share the
        group or the receive buffers."""
        previous = getattr(self, "_asyncrl_staged", None)
        if previous is not None and previous["thread"].is_alive():
            return False
        ann = schema.decode(announcement_frame, schema.WeightAnnouncement)
        receiver: WeightReceiver = self._asyncrl_receiver
        staged: dict = {"t0": time.perf_counter(), "ann": ann}
        pg = receiver.pg

        def run():
            # gloo moves host memory: the buckets stay on the host until the load copies them.
            try:
                staged["weights"] = list(receiver.receive(ann, torch.device("cpu"), timeout_s))
                staged["checksums"] = receiver.checksums
            except Exception as e:  # noqa: BLE001 - reported by asyncrl_staged / asyncrl_load_staged
                if receiver.pg is pg:  # this epoch's group is broken; a group joined since is not
                    receiver.pg = None
                staged["error"] = f"{type(e).__name__}: {e}"
            staged["seconds"] = time.perf_counter() - staged["t0"]

        staged["thread"] = threading.Thread(target=run, name="asyncrl-stage", daemon=True)
        self._asyncrl_staged = staged
        staged["thread"].start()
        return True

    def asyncrl_staged(self) -> dict:
        """The staging thread's state: done (received everything, or failed) and its error if any."""
        staged = getattr(self, "_asyncrl_staged", None)
        if staged is None:
            return {"done": True, "error": "nothing is being staged"}
        done = not staged["thread"].is_alive()
        return {"done": done, "error": staged.get("error") if done else None}

    def _asyncrl_load(self, weights, ann, how: str = "auto") -> str:
        """Loads one version (`how`: weights.load); returns the path it took, `direct` or `reload`."""
        direct = self._asyncrl_direct(ann, how)
        if direct is not None and (how == "direct" or self._asyncrl_direct_state[1]):
            direct.load(weights)
            self._asyncrl_retie()
            return "direct"
        if direct is not None:
            weights = list(weights)  # read again below, to check the plan against the reload
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        self._asyncrl_retie()
        if direct is not None:
            bad = direct.mismatches(weights)
            # A plan that disagreed is dropped for this layout: no second check, no switching back.
            self._asyncrl_direct_state = (direct, True) if not bad else (None, False)
            # Said by the generator process (vllm_engine.update_weights), whose log a user reads.
            self._asyncrl_load_check = (f"the direct plan disagrees with vLLM's reload on {len(bad)} tensors "
                                        f"({', '.join(bad[:3])}); loading by reload from now on" if bad else
                                        f"the direct plan matches vLLM's reload on all {len(direct.views)} tensors; "
                                        "loading direct from the next version on")
        return "reload"

    def _asyncrl_direct(self, ann, how: str) -> DirectLoader | None:
        """The direct plan for this announcement's layout (built once per layout), or None: reload.
        `_asyncrl_direct_state` is (plan or None, checked against a reload)."""
        if how == "reload":
            return None
        layout = tuple((m.name, tuple(m.shape), m.dtype) for b in ann.buckets for m in b.tensors)
        if getattr(self, "_asyncrl_direct_layout", None) != layout:
            self._asyncrl_direct_layout, self._asyncrl_direct_state, self._asyncrl_direct_why = layout, (None, False), ""
            try:
                self._asyncrl_direct_state = (self._asyncrl_plan([m for b in ann.buckets for m in b.tensors]), False)
            except Unsupported as e:
                self._asyncrl_direct_why = str(e)
                self._asyncrl_load_check = f"vLLM's reload path ({e})"
        plan = self._asyncrl_direct_state[0]
        if plan is None and how == "direct":  # every version of this layout fails the same way
            raise RuntimeError(f"weights.load=direct: {self._asyncrl_direct_why or 'the plan was rejected'}")
        return plan

    def _asyncrl_take_check(self) -> str:
        """What weights.load=auto decided at this load (said once), else empty."""
        check, self._asyncrl_load_check = getattr(self, "_asyncrl_load_check", ""), ""
        return check

    def _asyncrl_plan(self, metas) -> DirectLoader:
        from vllm.platforms import current_platform

        cfg = self.vllm_config
        if cfg.model_config.quantization is not None:
            raise Unsupported(f"quantization {cfg.model_config.quantization}")
        if cfg.parallel_config.tensor_parallel_size > 1 or cfg.parallel_config.pipeline_parallel_size > 1:
            raise Unsupported("tensor or pipeline parallelism")
        if not (current_platform.is_cuda() or current_platform.is_cpu()):
            raise Unsupported(f"platform {current_platform.device_name} (direct loads are planned for CUDA and CPU)")
        hf = cfg.model_config.hf_config
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        model = self.model_runner.get_model() if hasattr(self.model_runner, "get_model") else self.model_runner.model
        return DirectLoader(model, metas, tied=bool(getattr(text, "tie_word_embeddings", False)),
                            post_process=current_platform.is_cpu(), dtype=cfg.model_config.dtype)

    def _asyncrl_retie(self) -> None:
        """A tied output head (`tie_word_embeddings`: SmolLM2, Qwen2.5-0.5B) takes the embedding again.

        vLLM's in-place reload loads the embedding, finds no checkpoint weight for the head (its
        loader skips `lm_head.*` when tied; the log says "ParallelLMHead: Failed to load weights")
        and puts the head's previous tensor back, so the engine went on sampling from the initial
        head while the learner trained the shared one (greedy output differed from the learner's
        after the first push). Copied rather than re-pointed, so that the head keeps its storage
        (captured CUDA graphs hold its address); then the head's post-load processing runs again,
        which on the CPU build re-packs the weight its GEMM kernel reads (a copy of the old one)."""
        hf = self.vllm_config.model_config.hf_config
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        if not getattr(text, "tie_word_embeddings", False):
            return
        model = self.model_runner.get_model() if hasattr(self.model_runner, "get_model") else self.model_runner.model
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or not hasattr(head, "weight"):
            return  # an architecture without these names: nothing we know how to re-tie
        if head.weight.data_ptr() != embed.weight.data_ptr():
            assert head.weight.shape == embed.weight.shape, (head.weight.shape, embed.weight.shape)
            with torch.no_grad():
                head.weight.copy_(embed.weight)
        if (method := getattr(head, "quant_method", None)) is not None:
            method.process_weights_after_loading(head)

    def asyncrl_load_staged(self, timeout_s: float, how: str = "auto") -> dict:
        """Loads what `asyncrl_stage` received (waiting for it up to `timeout_s`)."""
        staged, self._asyncrl_staged = getattr(self, "_asyncrl_staged", None), None
        if staged is None:
            return {"error": "no staged weights to load", "checksums": [], "seconds": 0.0}
        staged["thread"].join(timeout_s)
        if staged["thread"].is_alive():
            self._asyncrl_receiver.pg = None  # the broadcast is stuck: this epoch is unusable
            return {"error": f"staging did not finish in {timeout_s}s", "checksums": [], "seconds": timeout_s}
        if "error" in staged:
            return {"error": staged["error"], "checksums": [], "seconds": staged["seconds"]}
        t0 = time.perf_counter()
        path = self._asyncrl_load(iter(staged["weights"]), staged["ann"], how)
        return {"checksums": staged["checksums"], "seconds": staged["seconds"], "load_s": time.perf_counter() - t0,
                "load_path": path, "load_check": self._asyncrl_take_check()}

    def asyncrl_receive(self, announcement_frame: bytes, timeout_s: float, atomic: bool = True,
                        how: str = "auto") -> dict:
        ann = schema.decode(announcement_frame, schema.WeightAnnouncement)
        receiver: WeightReceiver = self._asyncrl_receiver
        t0 = time.perf_counter()
        weights = receiver.receive(ann, torch.device(self.device), timeout_s)
        if receiver.backend == "ipc":
            return self._asyncrl_load_ipc(receiver, ann, weights, t0, how)
        if atomic:
            # Receive every bucket before touching the model: a broadcast that fails part-way (a peer
            # died) then leaves the engine on its old, consistent weights instead of a half-loaded
            # model. Costs one staged copy of the weights (weights.atomic=false streams instead).
            # The failure is returned, not raised, so it never reaches vLLM's engine core.
            try:
                weights = iter(list(weights))
            except Exception as e:  # noqa: BLE001 - reported to the generator process, which logs it
                receiver.pg = None
                return {"error": f"{type(e).__name__}: {e}", "checksums": [], "seconds": time.perf_counter() - t0}
        try:
            path = self._asyncrl_load(weights, ann, how)
        finally:
            for _ in weights:  # every bucket must be received, or the learner's broadcast would wait
                pass
        return {"checksums": receiver.checksums, "seconds": time.perf_counter() - t0, "load_path": path,
                "load_check": self._asyncrl_take_check()}

    def _asyncrl_load_ipc(self, receiver: WeightReceiver, ann, weights, t0: float, how: str) -> dict:
        """ipc: the whole version already sits in the learner's GPU memory, so loading straight from it
        is atomic by itself (a failed read leaves nothing half-received); the learner is told when the
        load is done (or failed), and only then writes its buffer again."""
        try:
            path = self._asyncrl_load(weights, ann, how)
        except Exception as e:  # noqa: BLE001 - reported to the learner and to the generator process
            receiver.finish(ann, error=f"{type(e).__name__}: {e}")
            return {"error": f"{type(e).__name__}: {e}", "checksums": [], "seconds": time.perf_counter() - t0}
        t_loaded = time.perf_counter()
        receiver.finish(ann)
        return {"checksums": receiver.checksums, "seconds": time.perf_counter() - t0,
                "same_gpu": receiver.shares_device, "handle_s": receiver.handle_s,
                "checksum_s": receiver.checksum_s, "finish_s": time.perf_counter() - t_loaded, "load_path": path,
                "load_check": self._asyncrl_take_check()}
