"""weights.load=direct: a pushed version goes into vLLM's parameters with one copy per tensor (stacked
qkv and gate_up filled from their parts, a tied head re-tied, the CPU build's packed GEMM weights
made again), and vLLM then generates greedily exactly what Hugging Face generates with the same
weights. Two versions in a row, for Qwen2 and Llama, with tied and untied heads; and the plan refuses
layouts it does not know, so that the generic reload stays their path."""

import asyncio
import shutil
import time
from pathlib import Path

import pytest
import torch

from asyncrl.protocol import schema
from asyncrl.protocol.weight_sync import WeightSender, pack_buckets, plan_buckets
from tests.test_weight_push_vllm import PROMPTS, _hf_greedy, _vllm_greedy, join_group


def _variant(tiny_model: str, out: Path, arch: str, tied: bool) -> str:
    """A random model of the tiny model's vocabulary and tokenizer: `arch` is qwen2 or llama."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    base = AutoConfig.from_pretrained(tiny_model)
    common = dict(vocab_size=base.vocab_size, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                  tie_word_embeddings=tied, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
                  pad_token_id=base.pad_token_id)
    if arch == "llama":
        cfg = LlamaConfig(**common, head_dim=64)
    else:
        cfg = type(base)(**common, head_dim=64)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    for f in Path(tiny_model).iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return str(out)


def _wire(model) -> dict[str, torch.Tensor]:
    from learners.trainer import tied_aliases

    skip = tied_aliases(model)
    return {n: t.detach().clone() for n, t in model.state_dict().items() if n not in skip}


@pytest.mark.slow
@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", True)])
def test_direct_load_matches_hf_greedy_over_two_versions(make_cfg, tiny_model, tmp_path, arch, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from generators.vllm_engine import VllmEngine

    path = _variant(tiny_model, tmp_path / f"{arch}-{tied}", arch, tied)
    cfg = make_cfg(f"model.path={path}", "generator.max_tokens=12", "generator.dtype=float32",
                   "weights.load=direct")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    wire0 = _wire(model)
    assert ("lm_head.weight" in wire0) != tied
    sender = WeightSender("127.0.0.1", 0, "gloo", join_timeout_s=60, sync_timeout_s=60)
    engine = VllmEngine(cfg, path)
    wants, gots, paths = [], [], []

    async def push(version: int, wire: dict[str, torch.Tensor]):
        loop = asyncio.get_running_loop()
        buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in wire.items()], 64 * 1024)
        ann = schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=version, epoch=sender.epoch,
                                        buckets=buckets, announced_at=time.time())
        sent = loop.run_in_executor(None, sender.broadcast, buckets,
                                    pack_buckets(buckets, iter(wire.items()), torch.device("cpu")))
        stats = await engine.update_weights(schema.encode(ann), "keep", 60)
        assert stats["checksums"] == await sent
        return stats

    async def scenario():
        await join_group(engine, sender)
        before = await _vllm_greedy(engine, tok, PROMPTS, 12)
        assert before == _hf_greedy(model, tok, PROMPTS, 12)
        for version, scale in ((1, 0.3), (2, 0.5)):
            torch.manual_seed(10 + version)
            with torch.no_grad():  # an update of every weight (the embedding, so a tied head, too)
                for p in model.parameters():
                    p.add_(scale * p.std() * torch.randn_like(p))
            wants.append(_hf_greedy(model, tok, PROMPTS, 12))
            stats = await push(version, _wire(model))
            paths.append(stats["load_path"])
            gots.append(await _vllm_greedy(engine, tok, PROMPTS, 12))
        return before

    try:
        before = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert paths == ["direct", "direct"]
    assert wants[0] != before and wants[1] != wants[0], "each update must change greedy output to prove anything"
    assert gots == wants, [[tok.decode(x) for x in g] for g in gots + wants]


@pytest.mark.slow
def test_auto_checks_the_plan_against_the_reload_then_loads_direct(make_cfg, tiny_model):
    """weights.load=auto: version 1 goes through vLLM's reload and the plan is compared with what it
    loaded, tensor by tensor; version 2 goes direct; both give Hugging Face's greedy output."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from generators.vllm_engine import VllmEngine

    cfg = make_cfg("generator.max_tokens=12", "generator.dtype=float32")
    assert cfg.weights.load == "auto"
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    sender = WeightSender("127.0.0.1", 0, "gloo", join_timeout_s=60, sync_timeout_s=60)
    engine = VllmEngine(cfg, tiny_model)
    results = []

    async def scenario():
        await join_group(engine, sender)
        loop = asyncio.get_running_loop()
        for version in (1, 2):
            torch.manual_seed(version)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            wire = _wire(model)
            buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in wire.items()], 256 * 1024)
            ann = schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=version,
                                            epoch=sender.epoch, buckets=buckets, announced_at=time.time())
            sent = loop.run_in_executor(None, sender.broadcast, buckets,
                                        pack_buckets(buckets, iter(wire.items()), torch.device("cpu")))
            stats = await engine.update_weights(schema.encode(ann), "keep", 60)
            await sent
            results.append((stats["load_path"], await _vllm_greedy(engine, tok, PROMPTS, 12),
                            _hf_greedy(model, tok, PROMPTS, 12)))

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert [r[0] for r in results] == ["reload", "direct"]
    assert [r[1] for r in results] == [r[2] for r in results]


class _Linear(torch.nn.Module):
    def __init__(self, rows: int, cols: int, method: str = "UnquantizedLinearMethod"):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(rows, cols), requires_grad=False)
        self.quant_method = type(method, (), {"process_weights_after_loading": lambda self, layer: None})()


class _Block(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, method: str = "UnquantizedLinearMethod"):
        super().__init__()
        self.qkv_proj = _Linear(8, 4, method)
        self.o_proj = _Linear(4, 4, method)


def _metas(shapes: dict[str, tuple[int, ...]]) -> list[schema.TensorMeta]:
    return [schema.TensorMeta(name=n, dtype="float32", shape=list(s), offset=0, nbytes=4 * int(torch.Size(s).numel()))
            for n, s in shapes.items()]


def test_plan_fills_a_stacked_parameter_from_its_parts_in_order():
    from generators.direct_load import DirectLoader

    block = _Block()
    shapes = {"v_proj.weight": (2, 4), "q_proj.weight": (4, 4), "k_proj.weight": (2, 4), "o_proj.weight": (4, 4)}
    plan = DirectLoader(block, _metas(shapes), tied=False, post_process=False)
    parts = {n: torch.full(s, float(i + 1)) for i, (n, s) in enumerate(shapes.items())}
    assert plan.load(iter(parts.items())) == 4
    rows = block.qkv_proj.weight[:, 0].tolist()
    assert rows == [2.0] * 4 + [3.0] * 2 + [1.0] * 2  # q, k, v: the mapping's order, not the push's
    assert torch.equal(block.o_proj.weight, parts["o_proj.weight"])
    assert plan.mismatches(iter(parts.items())) == []
    parts["k_proj.weight"] = parts["k_proj.weight"] + 1
    assert plan.mismatches(iter(parts.items())) == ["k_proj.weight"]


def test_only_a_vocabulary_layer_may_be_larger_than_the_push():
    """vLLM pads a vocabulary; the pushed rows go first. A stacked parameter with more rows than its
    parts is a layout we do not know (a part would land at the wrong offset), not padding."""
    from generators.direct_load import DirectLoader, Unsupported

    parts = {"q_proj.weight": (4, 4), "k_proj.weight": (2, 4), "v_proj.weight": (1, 4), "o_proj.weight": (4, 4)}
    with pytest.raises(Unsupported, match="qkv_proj.weight: vLLM holds shape"):
        DirectLoader(_Block(), _metas(parts), tied=False, post_process=False)

    class _Embedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.org_vocab_size = 6
            self.weight = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)  # padded to 8 rows

    class _Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = _Embedding()

    model = _Model()
    plan = DirectLoader(model, _metas({"embed_tokens.weight": (6, 4)}), tied=False, post_process=False)
    plan.load(iter([("embed_tokens.weight", torch.ones(6, 4))]))
    assert model.embed_tokens.weight[:6].eq(1).all() and model.embed_tokens.weight[6:].eq(0).all()


def test_a_parameter_whose_storage_vllm_replaced_fails_the_check():
    from generators.direct_load import DirectLoader

    block = _Block()
    shapes = {"q_proj.weight": (4, 4), "k_proj.weight": (2, 4), "v_proj.weight": (2, 4), "o_proj.weight": (4, 4)}
    plan = DirectLoader(block, _metas(shapes), tied=False, post_process=False)
    parts = {n: torch.zeros(s) for n, s in shapes.items()}
    assert plan.mismatches(iter(parts.items())) == []
    block.o_proj.weight = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)  # same values, new storage
    assert plan.mismatches(iter(parts.items())) == ["o_proj.weight (storage replaced)"]


def test_a_wire_dtype_other_than_the_engines_is_cast_as_the_reload_casts_it():
    from generators.direct_load import DirectLoader

    block = _Block().to(torch.bfloat16)
    shapes = {"q_proj.weight": (4, 4), "k_proj.weight": (2, 4), "v_proj.weight": (2, 4), "o_proj.weight": (4, 4)}
    plan = DirectLoader(block, _metas(shapes), tied=False, post_process=False)
    torch.manual_seed(0)
    parts = {n: torch.randn(s) for n, s in shapes.items()}  # float32 on the wire, bfloat16 in the engine
    plan.load(iter(parts.items()))
    assert block.qkv_proj.weight.dtype == torch.bfloat16
    assert torch.equal(block.qkv_proj.weight[:4], parts["q_proj.weight"].to(torch.bfloat16))
    assert plan.mismatches(iter(parts.items())) == []


@pytest.mark.parametrize("shapes,method,why", [
    ({"q_proj.weight": (4, 4), "k_proj.weight": (2, 4), "o_proj.weight": (4, 4)}, "UnquantizedLinearMethod",
     "parts"),
    ({"q_proj.weight": (4, 4), "k_proj.weight": (2, 4), "v_proj.weight": (3, 4), "o_proj.weight": (4, 4)},
     "UnquantizedLinearMethod", "shape"),
    ({"q_proj.weight": (4, 4), "k_proj.weight": (2, 4), "v_proj.weight": (2, 4)}, "UnquantizedLinearMethod",
     "no pushed tensor covers"),
    ({"q_proj.weight": (4, 4), "k_proj.weight": (2, 4), "v_proj.weight": (2, 4), "o_proj.weight": (4, 4),
      "gate.weight": (1, 4)}, "UnquantizedLinearMethod", "no module"),
    ({"q_proj.weight": (4, 4), "k_proj.weight": (2, 4), "v_proj.weight": (2, 4), "o_proj.weight": (4, 4)},
     "Fp8LinearMethod", "quantization"),
])
def test_plan_refuses_what_it_does_not_know(shapes, method, why):
    from generators.direct_load import DirectLoader, Unsupported

    with pytest.raises(Unsupported, match=why):
        DirectLoader(_Block(method), _metas(shapes), tied=False, post_process=False)
