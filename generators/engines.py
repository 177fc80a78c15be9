"""Picks the generation backend (`generator.backend`): both have the same interface.

`num_workers`, `generate_group(prompt_ids, n, version, temperature=None) -> list[SampleOut]`,
`join(epoch_frame, generator_id, timeout_s) -> bool`, `update_weights(announcement_frame, mode,
timeout_s) -> {"pause_s", "wait_s", "receive_s", "checksums"}`, `shutdown()`.
"""

from __future__ import annotations

from asyncrl.config import Config


def build_engine(cfg: Config):
    if cfg.generator.backend == "hf":
        from generators.hf_engine import HfEngine

        return HfEngine(cfg, cfg.model_path)
    from generators.vllm_engine import VllmEngine

    return VllmEngine(cfg, cfg.model_path)
