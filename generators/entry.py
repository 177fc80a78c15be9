"""`asyncrl generator`'s entry point, which the CLI imports by name once the config is loaded."""

from __future__ import annotations

from asyncrl.config import Config
from asyncrl.launch.launcher import write_model_if_missing
from generators.main import main as run_generator


def main(cfg: Config, generator_id: str) -> None:
    if cfg.generator.backend == "vllm" and not cfg.model.path:
        from generators.vllm_engine import import_vllm  # vLLM's engine module, for the vllm backend only

        import_vllm(cfg)  # its seconds of imports overlap the tiny model's write (by the learner, under asyncrl run)
    wrote_model = write_model_if_missing(cfg)
    run_generator(cfg, generator_id, torch_unused=not wrote_model)
