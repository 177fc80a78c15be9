"""The vLLM engine arguments the generator builds from its settings: the compile switch, the
pass-through of more engine arguments, and the ones that pass-through may not replace."""

import pytest

from asyncrl.config import ConfigError, load_config
from generators.vllm_engine import engine_args


def _args(*overrides: str, on_cpu: bool = False) -> dict:
    return engine_args(load_config(None, list(overrides)), "/models/m", on_cpu)


def test_without_torch_compile_the_engine_keeps_full_cuda_graphs_and_skips_the_compile():
    assert "compilation_config" not in _args("generator.enforce_eager=false")
    args = _args("generator.enforce_eager=false", "generator.torch_compile=false")
    assert args["compilation_config"] == {"mode": "NONE", "cudagraph_mode": "FULL"}
    # Eager already compiles nothing and captures no graph.
    assert "compilation_config" not in _args("generator.enforce_eager=true", "generator.torch_compile=false")


def test_vllm_kwargs_come_last_and_reach_vllm_s_own_argument_class():
    from vllm import AsyncEngineArgs

    args = _args("generator.vllm_kwargs={kernel_config: {enable_flashinfer_autotune: false}, max_num_seqs: 64}",
                 "generator.max_num_seqs=512")
    assert args["kernel_config"] == {"enable_flashinfer_autotune": False}
    assert args["max_num_seqs"] == 64
    assert args["logprobs_mode"] == "processed_logprobs"
    AsyncEngineArgs(**args)  # every key is one of vLLM's engine arguments


@pytest.mark.parametrize("key", ["model", "logprobs_mode", "worker_extension_cls"])
def test_vllm_kwargs_may_not_replace_what_the_generator_relies_on(key):
    with pytest.raises(ConfigError, match=f"{key}: set by the generator itself"):
        load_config(None, [f"generator.vllm_kwargs={{{key}: x}}"])
