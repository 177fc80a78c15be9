"""Prompt datasets from files, GSM8K preparation, and prompt encoding with or without a chat template.

- `load_prompt_file`: parquet or jsonl rows -> `PromptRecord`s, with configurable column names.
- `prepare_gsm8k` (`asyncrl data gsm8k`): GSM8K jsonl files (or a Hugging Face dataset name, through
  `datasets`) -> `train.parquet` / `test.parquet` with the prompt, the final answer and chat messages.
- `encode_prompt`: what the generator feeds the engine.

pyarrow is imported only inside the functions that read or write parquet.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from asyncrl.tasks.base import PromptRecord

log = logging.getLogger(__name__)

# The instruction verl's GSM8K preprocessing appends; the `####` it asks for is what the reward reads first.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
GSM8K_SPLITS = ("train", "test")


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a `.parquet`, `.jsonl` or `.json` (a list of objects) file, as dicts."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix == ".jsonl":
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".json":
        rows = json.loads(path.read_text())
        if not isinstance(rows, list):
            raise ValueError(f"{path}: a .json dataset must be a list of objects")
        return rows
    raise ValueError(f"{path}: unsupported dataset format {path.suffix!r}; use .parquet, .jsonl or .json")


def load_prompt_file(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer",
                     id_key: str = "", max_prompt_chars: int = 0, limit: int = 0) -> list[PromptRecord]:
    """Prompt records from a file; `max_prompt_chars > 0` skips longer prompts, `limit > 0` keeps the first rows."""
    path = Path(path)
    rows = read_rows(path)
    if rows:
        missing = [k for k in (prompt_key, answer_key, id_key) if k and k not in rows[0]]
        if missing:
            raise ValueError(f"{path}: no column(s) {missing}; the file has {sorted(rows[0])} "
                             "(set data.prompt_key / data.answer_key / data.id_key)")
    records = []
    for i, row in enumerate(rows):
        prompt = str(row[prompt_key])
        if max_prompt_chars > 0 and len(prompt) > max_prompt_chars:
            continue
        prompt_id = str(row[id_key]) if id_key else f"{path.stem}-{i}"
        records.append(PromptRecord(prompt_id=prompt_id, prompt=prompt, answer=str(row[answer_key])))
        if limit and len(records) >= limit:
            break
    if not records:
        raise ValueError(f"{path}: no prompts left (rows={len(rows)}, max_prompt_chars={max_prompt_chars})")
    return records


def load_dataset_from_config(data_cfg, path: str | None = None, limit: int = 0) -> list[PromptRecord]:
    return load_prompt_file(path or data_cfg.path, data_cfg.prompt_key, data_cfg.answer_key, data_cfg.id_key,
                            data_cfg.max_prompt_chars, limit)


def encode_prompt(tokenizer, prompt: str, chat_template: bool) -> list[int]:
    """Token ids of a prompt: through the chat template when asked for and the tokenizer has one."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


# ---- GSM8K -------------------------------------------------------------------------------------


def gsm8k_final_answer(solution: str) -> str:
    """The final answer of a GSM8K reference solution: after `####`, thousands separators removed."""
    if "####" not in solution:
        raise ValueError(f"GSM8K solution without '####': {solution[:80]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def gsm8k_record(row: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    question = row["question"].strip()
    prompt = f"{question} {GSM8K_INSTRUCTION}"
    return {
        "id": f"gsm8k-{split}-{index}",
        "split": split,
        "question": question,
        "prompt": prompt,
        "answer": gsm8k_final_answer(row["answer"]),
        "solution": row["answer"],
        "messages": [{"role": "user", "content": prompt}],
    }


def _read_gsm8k_source(src: str) -> dict[str, list[dict[str, Any]]]:
    """`src` is a folder with {train,test}.jsonl (or .parquet), or a Hugging Face dataset name."""
    folder = Path(src).expanduser()
    if folder.is_dir():
        splits = {}
        for split in GSM8K_SPLITS:
            candidates = [folder / f"{split}.jsonl", folder / f"{split}.parquet", folder / "main" / f"{split}.jsonl"]
            found = next((p for p in candidates if p.exists()), None)
            if found is None:
                raise FileNotFoundError(f"{folder}: no {split}.jsonl or {split}.parquet")
            splits[split] = read_rows(found)
        return splits
    if folder.exists() or src.startswith((".", "/", "~")):
        raise FileNotFoundError(f"--src {src}: expected a folder with train.jsonl and test.jsonl")
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--src {src} is not a folder, and reading a Hugging Face dataset needs `datasets` "
                         "(pip install datasets) and network access") from None
    log.info("loading Hugging Face dataset %s (config main)", src)
    ds = datasets.load_dataset(src, "main")
    return {split: [dict(r) for r in ds[split]] for split in GSM8K_SPLITS}


def prepare_gsm8k(src: str, out: str | Path) -> dict[str, int]:
    """Writes {out}/train.parquet and {out}/test.parquet; returns rows per split."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, rows in _read_gsm8k_source(src).items():
        records = [gsm8k_record(row, split, i) for i, row in enumerate(rows)]
        pq.write_table(pa.Table.from_pylist(records), out / f"{split}.parquet")
        counts[split] = len(records)
        log.info("wrote %s: %d rows", out / f"{split}.parquet", len(records))
    return counts
