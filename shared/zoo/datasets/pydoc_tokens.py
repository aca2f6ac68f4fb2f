"""Python's own documentation as token samples with keyword fields, for Hugging Face-style models.

The text and its 98-symbol character vocabulary are ``zoo:pydoc_text``'s (nothing is
downloaded). A sample is a pair ``({"input_ids", "attention_mask"}, target)``: a block of
``block_size`` positions whose last few are padding (id 0, mask 0), the number of real
characters varying from sample to sample so that the mask matters.

- ``pydoc_tokens``: the target is the block itself with ``-100`` at the padding, Hugging
  Face's convention for causal LMs (the model, or ``--loss causal_lm``, shifts it by one).
- ``pydoc_lines``: the target is a class, how many line breaks the real characters hold
  (0, 1, ..., ``num_classes - 1`` or more): a property of real text a small encoder learns.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from shared.zoo.datasets.pydoc_text import CHARS, corpus, split_blocks
from shared.zoo.datasets.synthetic import check_split
from shared.zoo.registry import register_dataset

NEWLINE = CHARS.index("\n") + 1
Sample = tuple[dict[str, torch.Tensor], torch.Tensor]


class TokenBlocks(Dataset[Sample]):
    """Blocks of the corpus as keyword samples (see the module's docstring).

    Every sample is made at once, as tables (a few MB): a sample read is then two row views and a
    target, about 3 us instead of the 23 us of making it (16 per unit on every pdrun worker that
    reads them), and ``targets`` lets a last stage gather its labels in one index (shared.batches).
    """

    def __init__(
        self, starts: torch.Tensor, block_size: int, min_length: int, task: str, num_classes: int
    ) -> None:
        data = corpus()
        self.starts = starts
        self.block_size = block_size
        self.task = task
        self.num_classes = num_classes
        span = block_size - min_length + 1
        length = min_length + (starts * 7919) % span  # real characters: fixed per sample
        positions = torch.arange(block_size)
        real = positions[None, :] < length[:, None]
        at = (starts[:, None] + positions[None, :]).clamp(max=data.numel() - 1)
        self.input_ids = torch.where(real, data[at], 0)
        self.attention_mask = real.to(torch.int64)
        if task == "lm":
            self.targets = self.input_ids.masked_fill(~real, -100)
        else:
            lines = ((self.input_ids == NEWLINE) & real).sum(dim=1)
            self.targets = lines.clamp(max=num_classes - 1)

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    def __getitem__(self, index: int) -> Sample:
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
        }, self.targets[index]


def _blocks(
    block_size: int, split: str, val_fraction: float, seed: int, task: str, num_classes: int
) -> TokenBlocks:
    check_split(split)
    if block_size < 4:
        raise ValueError(f"block_size must be at least 4, got {block_size}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    chosen = split_blocks((int(corpus().numel()) - 1) // block_size, split, val_fraction, seed)
    return TokenBlocks(chosen * block_size, block_size, (3 * block_size) // 4, task, num_classes)


@register_dataset(
    "pydoc_tokens",
    "pydoc_data.topics as causal-LM samples: ({input_ids, attention_mask}, labels = input_ids, -100 at "
    "padding); the last quarter of a block may be padding; use --loss causal_lm",
    "input {input_ids int64 (block_size,), attention_mask int64 (block_size,)}, target int64 (block_size,)",
)
def pydoc_tokens(
    *, block_size: int = 32, split: str = "train", val_fraction: float = 0.1, seed: int = 0
) -> TokenBlocks:
    return _blocks(block_size, split, val_fraction, seed, "lm", 0)


@register_dataset(
    "pydoc_lines",
    "pydoc_data.topics blocks classified by their number of line breaks (0, 1, 2+ by default), "
    "({input_ids, attention_mask}, class) pairs, for sequence classification",
    "input {input_ids int64 (block_size,), attention_mask int64 (block_size,)}, target int64 ()",
)
def pydoc_lines(
    *,
    block_size: int = 32,
    num_classes: int = 3,
    split: str = "train",
    val_fraction: float = 0.1,
    seed: int = 0,
) -> TokenBlocks:
    if num_classes < 2:
        raise ValueError(f"num_classes must be at least 2, got {num_classes}")
    return _blocks(block_size, split, val_fraction, seed, "lines", num_classes)
