"""What every task yields: the prompt record, and the deterministic order in which epochs release rows.

Every task module, the buffer and the generators import these; they depend on nothing else in asyncrl.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

EVAL_SEED_OFFSET = 104_729  # the held-out rows' seed is run.seed + this (the arith task uses the same)


@dataclass(frozen=True)
class PromptRecord:
    """One dataset row: what the generator sees and what the reward needs."""

    prompt_id: str
    prompt: str
    answer: str


def epoch_order(num_rows: int, seed: int, epoch: int) -> list[int]:
    """Row indices in the order epoch `epoch` releases them (what `iter_epochs` walks)."""
    order = list(range(num_rows))
    random.Random(seed + epoch).shuffle(order)
    return order


def iter_epochs(rows: list[PromptRecord], seed: int, start_epoch: int = 0,
                start_index: int = 0) -> Iterator[tuple[int, int, PromptRecord]]:
    """Yields (epoch, index, row) forever, reshuffled each epoch deterministically from `seed`."""
    epoch, index = start_epoch, start_index
    while True:
        order = epoch_order(len(rows), seed, epoch)
        while index < len(order):
            yield epoch, index, rows[order[index]]
            index += 1
        epoch, index = epoch + 1, 0
