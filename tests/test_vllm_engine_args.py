"""The vLLM engine arguments the generator builds from its settings: the compile switch, the
pass-through of more engine arguments, and the ones that pass-through may not replace."""

import os
import signal
import time

import pytest

from asyncrl.config import ConfigError, load_config
from generators.vllm_engine import engine_args


def _args(*overrides: str, on_cpu: bool = False) -> dict:
    return engine_args(load_config(None, list(overrides)), "/models/m", on_cpu)


def test_without_torch_compile_the_engine_keeps_full_cuda_graphs_for_decode_only_and_skips_the_compile():
    assert "compilation_config" not in _args("generator.enforce_eager=false")
    args = _args("generator.enforce_eager=false", "generator.torch_compile=false")
    # Not plain FULL: that replays graphs for batches with a prefill too, which corrupts generation.
    assert args["compilation_config"] == {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY"}
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


def test_auto_dtype_on_an_x86_cpu_without_bf16_instructions_is_float32(tmp_path, monkeypatch):
    from generators import vllm_engine

    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    bf16 = tmp_path / "bf16"
    bf16.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 amx_bf16\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert not vllm_engine.cpu_has_bf16(str(avx2))
    assert vllm_engine.cpu_has_bf16(str(bf16)) and vllm_engine.cpu_has_bf16(str(arm))
    assert vllm_engine.cpu_has_bf16(str(tmp_path / "none"))  # no cpuinfo: vLLM's own choice

    monkeypatch.setattr(vllm_engine, "cpu_has_bf16", lambda: False)
    assert _args(on_cpu=True)["dtype"] == "float32"
    assert _args(on_cpu=False)["dtype"] == "auto"  # on the GPU vLLM chooses
    assert _args("generator.dtype=bfloat16", on_cpu=True)["dtype"] == "bfloat16"  # said outright: kept
    monkeypatch.setattr(vllm_engine, "cpu_has_bf16", lambda: True)
    assert _args(on_cpu=True)["dtype"] == "auto"


@pytest.mark.parametrize(("start", "env", "want"), [("spawn", None, "spawn"), ("fork", None, "fork"),
                                                    ("fork", "spawn", "fork"), ("spawn", "fork", "spawn"),
                                                    ("auto", None, "spawn"), ("auto", "fork", "fork")])
def test_on_cuda_the_engine_core_starts_as_configured_and_the_cuda_check_leaves_cuda_uninitialised(
        start, env, want, monkeypatch):
    import torch
    import vllm.v1.engine.async_llm  # noqa: F401  (imported for real first: only the generator's check is faked)

    from generators import vllm_engine

    for var in ("VLLM_WORKER_MULTIPROC_METHOD", "PYTORCH_NVML_BASED_CUDA_CHECK"):
        monkeypatch.delenv(var, raising=False)
    if env is not None:
        monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", env)
    asked = []

    def is_available():  # what torch reads when it decides how to look for a GPU
        asked.append(os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"))
        return True

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    assert vllm_engine.import_vllm(load_config(None, [f"generator.engine_start={start}"])) is False
    assert asked == ["1"]
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == want


@pytest.mark.parametrize(("start", "torch_unused", "tp", "want"), [
    ("auto", True, 1, True), ("auto", False, 1, False), ("auto", True, 2, False),
    ("fork", False, 1, True), ("spawn", True, 1, False)])
def test_on_cpu_auto_forks_the_engine_core_only_from_a_process_that_never_ran_torch(
        start, torch_unused, tp, want, monkeypatch):
    from generators import vllm_engine

    monkeypatch.setattr(vllm_engine, "TORCH_UNUSED", torch_unused)
    cfg = load_config(None, [f"generator.engine_start={start}", f"generator.tensor_parallel_size={tp}"])
    assert vllm_engine.cpu_engine_fork(cfg) is want


def test_a_generator_that_writes_the_tiny_model_itself_is_told_it_ran_torch(tmp_path, monkeypatch):
    from generators import entry

    told = []
    monkeypatch.setattr(entry, "run_generator", lambda cfg, gid, torch_unused: told.append(torch_unused))
    cfg = load_config(None, [f"run.dir={tmp_path}", "generator.backend=hf", "model.tiny.warm_start_steps=1"])
    entry.main(cfg, "g0")  # writes the tiny model: its warm start trains in this process
    entry.main(cfg, "g1")  # finds it written
    assert told == [False, True]


def _signal_myself():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1)  # a SIGTERM that kills the child does not get here


def test_a_sigterm_to_a_forked_engine_core_does_not_reach_the_generators_event_loop():
    import asyncio
    import multiprocessing

    from generators import vllm_engine

    loop = asyncio.new_event_loop()
    got = []
    loop.add_signal_handler(signal.SIGTERM, got.append, "SIGTERM")  # as a generator's drain does
    try:
        vllm_engine.signals_stay_in_forked_children()
        child = multiprocessing.get_context("fork").Process(target=_signal_myself)
        child.start()
        child.join(10)
        loop.run_until_complete(asyncio.sleep(0.5))  # time for a stray signal byte to arrive
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        loop.close()
    assert child.exitcode == -signal.SIGTERM  # the child died of it, under the default action
    assert got == []


def test_an_unknown_engine_start_is_one_clear_error():
    with pytest.raises(ConfigError, match="engine_start"):
        load_config(None, ["generator.engine_start=thread"])


def test_a_model_class_is_inspected_in_a_fork_of_this_process_with_vllm_s_answer(monkeypatch):
    import time

    from vllm.model_executor.models import registry

    from generators import vllm_engine

    fallback = []

    def vllm_s_subprocess(fn):  # stands in for `python -m ...registry`, which would import vLLM again
        fallback.append(fn)
        return "from vLLM's subprocess"

    monkeypatch.setattr(registry, "_run_in_subprocess", vllm_s_subprocess)
    vllm_engine.inspect_models_in_a_fork()
    vllm_engine.inspect_models_in_a_fork()  # once only: not a fork wrapped around a fork
    run = registry._run_in_subprocess
    assert run.asyncrl_fork and run is not vllm_s_subprocess
    llama = registry.ModelRegistry.models["LlamaForCausalLM"]

    def inspect():
        return registry._ModelInfo.from_model_cls(llama.load_model_cls())

    t0 = time.monotonic()
    info = run(inspect)
    assert time.monotonic() - t0 < 10
    assert info == inspect() and info.is_text_generation_model and not fallback
    # An answer that is not a model's description goes to vLLM's own way.
    assert run(lambda: 42) == "from vLLM's subprocess" and len(fallback) == 1
