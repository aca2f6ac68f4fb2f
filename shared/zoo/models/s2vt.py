"""S2VT (Venugopalan et al., 2015): a two-layer stacked LSTM from per-frame features to words.

One pass over ``F + T`` time steps. While the frames are read (the first ``F`` steps)
the second layer sees a zero word; while the words are produced (the last ``T`` steps)
the first layer sees a zero frame. The output is read at the last ``T`` steps only.
Sizes follow the paper: 4096-d frame features (VGG fc7) embedded to 500, 1000-unit LSTMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.zoo.models.checks import check_positive
from shared.zoo.registry import register_model


class S2VT(nn.Module):
    def __init__(self, feat_dim: int, vocab_size: int, hidden: int, embed: int, dropout: float) -> None:
        super().__init__()
        self.frame_embed = nn.Linear(feat_dim, embed)
        self.word_embed = nn.Embedding(vocab_size, embed, padding_idx=0)
        self.drop = nn.Dropout(dropout)
        self.lstm1 = nn.LSTM(embed, hidden, batch_first=True)
        self.lstm2 = nn.LSTM(hidden + embed, hidden, batch_first=True)
        self.classifier = nn.Linear(hidden, vocab_size)

    def forward(self, frames: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """Frame features (N, F, feat_dim) and input word ids (N, T) -> logits (N, T, vocab_size)."""
        n_frames, n_words = frames.size(1), words.size(1)
        # Layer 1: the frames, then T steps of zero input while decoding.
        x1 = F.pad(self.drop(self.frame_embed(frames)), (0, 0, 0, n_words))
        h1 = self.lstm1(x1)[0]
        # Layer 2: F steps of zero word while encoding, then the words, beside layer 1's output.
        w = F.pad(self.drop(self.word_embed(words)), (0, 0, n_frames, 0))
        h2 = self.lstm2(torch.cat([self.drop(h1), w], dim=-1))[0]
        logits: torch.Tensor = self.classifier(self.drop(h2[:, n_frames:]))
        return logits


@register_model(
    "s2vt",
    "S2VT stacked-LSTM video captioning (frame features -> words); pairs with zoo:video_captions (synthetic)",
    "(float32 frame features (N, F, feat_dim), int64 input word ids (N, T)); output (N, T, vocab_size)",
    dataset="video_captions",
    defaults={"feat_dim": 64, "vocab_size": 32, "hidden": 64, "embed": 32, "dropout": 0.0},
)
def s2vt(
    *,
    feat_dim: int = 4096,
    vocab_size: int = 10000,
    hidden: int = 1000,
    embed: int = 500,
    dropout: float = 0.5,
) -> nn.Module:
    check_positive("s2vt", feat_dim=feat_dim, vocab_size=vocab_size, hidden=hidden, embed=embed)
    return S2VT(feat_dim, vocab_size, hidden, embed, dropout)
