"""LoRA through peft (learners/lora.py): only adapters train, generators and exports get the merged
weights under the base model's names, exactly what peft's merge_and_unload() gives."""

import pytest
import torch

from asyncrl.config import LoraConfig, load_config
from learners.batch import build_batch, build_step
from learners.lora import adapters_disabled, apply_lora, base_name, merged_shapes, merged_tensors
from learners.packing import plan_step
from learners.step import batch_targets, policy_update
from tests.helpers import fixed_groups
from tests.test_learner_variants import run_learner

TARGETS = LoraConfig().target_modules


def _lora_model(path, rank=4, seed=1):
    from transformers import AutoModelForCausalLM

    model = apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), LoraConfig(rank=rank))
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero (merged == base); give the adapters something to merge
            torch.nn.init.normal_(p, std=0.05)
    return model


def _peft_merged(path, adapter_state: dict, rank=4) -> dict:
    """peft's own merge: a fresh PeftModel, the adapters loaded into it, merge_and_unload()."""
    import peft
    from transformers import AutoModelForCausalLM

    pm = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                             peft.LoraConfig(r=rank, lora_alpha=16.0, target_modules=TARGETS))
    missing, unexpected = pm.get_base_model().load_state_dict(adapter_state, strict=False)
    assert not unexpected and all(".lora_" not in k for k in missing), (missing, unexpected)
    return pm.merge_and_unload().state_dict()


def test_base_name_strips_peft_parts():
    assert base_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert base_name("model.layers.1.mlp.down_proj.base_layer.bias") == "model.layers.1.mlp.down_proj.bias"
    assert base_name("lm_head.weight") == "lm_head.weight"


def test_merged_tensors_equal_peft_merge_and_unload(tiny_model):
    model = _lora_model(tiny_model)
    ours = list(merged_tensors(model))
    adapters = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    want = _peft_merged(tiny_model, adapters)
    assert [n for n, _ in ours] == list(want), "names and order of the base model"
    assert [(n, tuple(t.shape)) for n, t in ours] == merged_shapes(model)
    for name, t in ours:
        assert torch.equal(t, want[name]), name
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert list(base) == [n for n, _ in ours], "the generator gets exactly the names it loaded"
    moved = {n for n, t in ours if not torch.equal(t, base[n])}
    assert moved and all(n.endswith(".weight") and n.split(".")[-2] in TARGETS for n in moved)


def test_policy_update_moves_only_adapters_and_the_reference_is_the_base(tiny_model):
    from learners.logprobs import sequence_logprobs

    model = _lora_model(tiny_model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in params}
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    merged_before = dict(merged_tensors(model))
    batch = build_batch(fixed_groups(4, seed=3), pad_id=0, device="cpu")
    cfg = load_config(None, ["learner.lora.enabled=true"])
    step = build_step(fixed_groups(4, seed=3), "cpu")
    plan = plan_step(step.group_sizes, step.lengths, step.comp_len, world=1, minibatches=1, epochs=1, budget=64,
                     packed=True, seed=0)
    for _ in range(3):
        stats = policy_update(model, opt, step, plan, cfg, batch_targets(model, step, plan, cfg))
        assert stats["grad_norm"] > 0
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base_before[n]), f"frozen base parameter {n} changed"
    merged_after = dict(merged_tensors(model))
    assert any(not torch.equal(merged_after[n], merged_before[n]) for n in merged_after), "the policy moved"
    # The reference (adapters off) is the untouched base model, token for token.
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        want = sequence_logprobs(base, batch.input_ids_BL, batch.attention_mask_BL, 1.0)
        model.eval()
        with adapters_disabled(model):
            got = sequence_logprobs(model, batch.input_ids_BL, batch.attention_mask_BL, 1.0)
        policy = sequence_logprobs(model, batch.input_ids_BL, batch.attention_mask_BL, 1.0)
    assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(policy, want, atol=1e-4), "adapters are back on after the context"


def test_lora_config_is_checked():
    from asyncrl.config import ConfigError

    with pytest.raises(ConfigError, match="learner.lora.rank"):
        load_config(None, ["learner.lora.enabled=true", "learner.lora.rank=0"])
    cfg = load_config(None, ["learner.lora.enabled=true", "learner.lora.target_modules=q_proj,v_proj"])
    assert cfg.learner.lora.target_modules == ["q_proj", "v_proj"]


def _dcp_state(path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_lora_learner_world_size_2_pushes_merged_weights(tmp_path, tiny_model):
    """A real FSDP2 learner at world size 2 (gloo) with LoRA and a KL reference (adapters off): it
    trains, the base never moves, its checkpoint holds adapters only, and the exported weights (the
    same `full_tensors` a weight sync broadcasts) equal peft's merge of the checkpointed adapters."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg, rows = run_learner(tmp_path, tiny_model, "lora_ws2", [
        "learner.nproc=2", "learner.lora.enabled=true", "learner.lora.rank=4", "algorithm.kl_coef=0.05",
        "checkpoint.every=3", "checkpoint.export_hf=true"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["grad_norm"] > 0 for r in rows)
    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    want = sum(float(p.double().sum()) for p in base.values())
    assert all(abs(r["ref_checksum"] - want) < 1e-6 * max(1.0, abs(want)) for r in rows), "base stayed the same"
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6), "step 1: policy = base (B starts at zero)"
    assert rows[-1]["kl"] != 0.0, "the adapters moved the policy away from the base"

    state = _dcp_state(cfg.checkpoint_dir / "step-000003")
    assert state["model"] and all(".lora_A." in k or ".lora_B." in k for k in state["model"]), \
        "the checkpoint holds the adapters, not the frozen base"
    optim_params = set(state["optim"]["state"])
    assert optim_params == set(state["model"]), "the optimizer holds exactly the adapter parameters"

    exported = load_file(str(cfg.run_dir / "hf-final" / "model.safetensors"))
    assert sorted(exported) == sorted(base), "merged weights under the base model's names (safetensors sorts them)"
    merged = _peft_merged(tiny_model, state["model"])
    for name, t in exported.items():
        assert torch.allclose(t, merged[name], atol=1e-6), name
        if name.split(".")[-2] in TARGETS and name.endswith(".weight"):
            continue
        assert torch.equal(t, base[name]), f"{name} has no adapter and must be the base weight"
    assert any(not torch.equal(exported[n], base[n]) for n in exported), "the merged policy moved"
    AutoModelForCausalLM.from_pretrained(cfg.run_dir / "hf-final")  # a loadable Hugging Face model


@pytest.mark.slow
def test_lora_and_gae_through_a_real_vllm_generator(tmp_path, tiny_model):
    """`asyncrl run` with every real part (vLLM CPU generator, buffer, learner): LoRA policy, GAE critic,
    one sample per prompt. vLLM loads the merged weights under its own names at every sync, and the
    checksums it reports match what the learner sent."""
    import json
    import subprocess
    import sys

    steps = 4
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", f"run.max_steps={steps}", f"model.path={tiny_model}",
                        "learner.lora.enabled=true", "learner.lora.rank=4", "learner.lr=5e-3",
                        "algorithm.advantage=gae", "generator.n=1", "learner.batch_groups=16",
                        "learner.critic_lr=1e-3", "algorithm.kl_coef=0.01", "checkpoint.export_hf=false"],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    # Verification reads the generators' heartbeats, so a version the generator moved past before the
    # learner looked is not counted: under load (seen once with the whole suite) one more sync can be.
    assert rows[-1]["weights_verified"] >= steps - 2 and rows[-1]["weights_mismatch"] == 0
    assert rows[-1]["kl"] > 0, "the adapters moved the policy away from the base"
    assert rows[-1]["value_mean"] != 0.0
