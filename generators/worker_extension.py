"""Mixed into every vLLM worker through `worker_extension_cls`; called by `collective_rpc`.

Receives weights over the project's weight group and loads them with vLLM's in-place reload path
(`reload_weights(..., is_checkpoint_format=True)` inside `set_current_vllm_config`), which copes with
kernel-format layouts where a plain `load_weights` does not. Method names are prefixed: vLLM asserts
that an extension never shadows a worker attribute.
"""

from __future__ import annotations

import time

import torch

from asyncrl import schema
from asyncrl.weight_sync import WeightReceiver


class AsyncRLWorkerExtension:
    def asyncrl_join(self, epoch_frame: bytes, generator_id: str, timeout_s: float) -> bool:
        info = schema.decode(epoch_frame, schema.GroupEpoch)
        member_id = f"{generator_id}.{self.rank}"
        receiver = getattr(self, "_asyncrl_receiver", None)
        if receiver is None:
            receiver = self._asyncrl_receiver = WeightReceiver(member_id)
        return receiver.join(info, timeout_s)

    def asyncrl_receive(self, announcement_frame: bytes, timeout_s: float, atomic: bool = True) -> dict:
        from vllm.config import set_current_vllm_config

        ann = schema.decode(announcement_frame, schema.WeightAnnouncement)
        receiver: WeightReceiver = self._asyncrl_receiver
        t0 = time.perf_counter()
        weights = receiver.receive(ann, torch.device(self.device), timeout_s)
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
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        for _ in weights:  # every bucket must be received, or the learner's broadcast would wait
            pass
        return {"checksums": receiver.checksums, "seconds": time.perf_counter() - t0}
