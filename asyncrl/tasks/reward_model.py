"""A Hugging Face sequence-classification reward model (`reward.model=PATH`), scored in batches.

The model must have one output (num_labels=1): its logit for prompt+completion is the reward. A
group is scored in batches of `reward.model_batch_size` with padding and the model's own
pad token, on CPU or the first GPU. Loaded once per generator process.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class RewardModel:
    def __init__(self, path: str, batch_size: int = 16):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward.model={path}: expected a scalar reward head (num_labels=1), "
                             f"got num_labels={self.model.config.num_labels}")
        if self.tokenizer.pad_token_id is None:
            raise ValueError(f"reward.model={path}: the tokenizer has no pad token; batched scoring needs one")
        # Sequence-classification heads pick the last non-pad token: the model must know the pad id.
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device)
        self.batch_size = batch_size
        self.num_batches = 0
        self.name = path

    def score_batch(self, completions: list[str], answer: str, prompt: str = "", **row) -> list[float]:
        import torch

        texts = [prompt + c for c in completions]
        scores: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                                 add_special_tokens=False).to(self.device)
            with torch.no_grad():
                logits = self.model(**enc).logits
            scores += logits[:, 0].float().tolist()
            self.num_batches += 1
        return scores

    def __call__(self, completion: str, answer: str, **row) -> float:
        return self.score_batch([completion], answer, **row)[0]
