"""A tiny Qwen2-architecture causal LM and a character-level tokenizer, in Hugging Face format.

The model is random (or briefly warm-started on the copy task): it exists so tests and the demo run
every real component (vLLM, FSDP2, weight broadcast) in seconds on a CPU. Head dimension is 64,
the smallest vLLM's CPU attention accepts.
"""

from __future__ import annotations

import json
import logging
import string
from pathlib import Path

log = logging.getLogger(__name__)

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
CHARS = string.printable[:95]  # digits, letters, punctuation, space


def build_tokenizer():
    """A byte-level BPE tokenizer with no merges: one token per printable ASCII character.

    Byte-level (space is `Ġ`, newline `Ċ`) so that it is exactly what transformers' Qwen2Tokenizer
    rebuilds from the same vocab, whichever class AutoTokenizer and vLLM pick.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = [c.replace(" ", "\u0120") for c in CHARS] + ["\u010a"]
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *byte_chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS)
    fast.model_max_length = 512
    return fast


def tiny_config(vocab_size: int, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 2,
                num_kv_heads: int = 1, intermediate_size: int = 256, max_positions: int = 512):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )


def warm_start(model, tokenizer, num_steps: int, seed: int, lr: float = 3e-3, batch_size: int = 32,
               device: str = "cpu", copy_len: tuple[int, int] = (2, 4)) -> float:
    """A short supervised warm start on the copy task; returns the last loss.

    Kept deliberately short: it teaches the output format so that RL has a non-zero reward to climb,
    not the task itself. `device="cuda"` for the larger shapes of the GPU benchmark (fp32 either way).
    `copy_len`: the (min, max) letters of the rows, as `data.min_len` / `data.max_len` set them.
    """
    import torch

    from asyncrl.tasks.synthetic import copy_dataset

    model.to(device)
    rows = copy_dataset(num_steps * batch_size, seed=seed + 7919, min_len=copy_len[0], max_len=copy_len[1])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss_value = float("nan")
    for step in range(num_steps):
        batch = rows[step * batch_size:(step + 1) * batch_size]
        ids, labels = [], []
        for row in batch:
            p = tokenizer(row.prompt, add_special_tokens=False)["input_ids"]
            a = tokenizer(row.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids.append(p + a)
            labels.append([-100] * len(p) + a)
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x in ids])
        label_ids = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
        attn = (torch.arange(width)[None, :] < torch.tensor([len(x) for x in ids])[:, None]).long()
        # Rows in chunks of at most 8,192 tokens, gradients accumulated: long copies (hundreds of
        # letters) would otherwise hold the whole batch's fp32 activations at once.
        rows_per = max(1, 8192 // width)
        total = int((label_ids != -100).sum())
        loss_sum = 0.0
        for i in range(0, len(ids), rows_per):
            sl = slice(i, i + rows_per)
            n = int((label_ids[sl] != -100).sum())
            loss = model(input_ids=input_ids[sl].to(device), attention_mask=attn[sl].to(device),
                         labels=label_ids[sl].to(device)).loss
            (loss * (n / total)).backward()
            loss_sum += float(loss.detach()) * n
        opt.step()
        opt.zero_grad()
        loss_value = loss_sum / total
    model.eval()
    model.to("cpu")
    if device.startswith("cuda"):  # the activations' cached blocks would stay reserved in this process
        torch.cuda.empty_cache()
    return loss_value


def write_tiny_model(out: str | Path, seed: int = 0, warm_start_steps: int = 0, device: str = "cpu",
                     warm_start_lr: float = 3e-3, copy_len: tuple[int, int] = (2, 4), **shape) -> Path:
    """Writes model + tokenizer to `out` and returns the path (`shape`: tiny_config's keywords)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    vocab_size = 128  # padded past the 98 real tokens to a friendly size
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size, **shape), dtype=torch.float32)
    if warm_start_steps > 0:
        loss = warm_start(model, tokenizer, warm_start_steps, seed, lr=warm_start_lr, device=device, copy_len=copy_len)
        log.info("warm start steps=%d loss=%.4f", warm_start_steps, loss)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "asyncrl_tiny.json").write_text(json.dumps({"seed": seed, "warm_start_steps": warm_start_steps}))
    return out
