"""The engine a generator runs (`generator.backend`): `vllm` (generators/vllm_engine.py) or `hf`
(generators/hf_engine.py), both behind generators/engines.py `Engine`. Imported on use: neither
backend's dependencies load unless it is chosen."""

from __future__ import annotations

from asyncrl.config import Config
from generators.engines import Engine


def build_engine(cfg: Config) -> Engine:
    if cfg.generator.backend == "hf":
        from generators.hf_engine import HfEngine

        return HfEngine(cfg, cfg.model_path)
    from generators.vllm_engine import VllmEngine

    return VllmEngine(cfg, cfg.model_path)
