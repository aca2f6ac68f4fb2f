"""A GNMT-style sequence-to-sequence LSTM with attention (Wu et al., 2016), as PipeDream's GNMT-8/16.

Encoder: a bidirectional first layer, then unidirectional layers with residual
connections from the third on. Decoder: its first layer's outputs query an attention
over the encoder outputs, and every later layer reads ``[hidden, context]``, residual
from the third on. Padding is handled by MASKING the attention scores (not packed
sequences), so the whole model is a fixed graph that torch.fx traces; each ``nn.LSTM``
is one layer of that graph. Training uses teacher forcing: the decoder reads the target
shifted right.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shared.zoo.datasets.cmudict_g2p import PAD, SRC_VOCAB, TGT_VOCAB
from shared.zoo.models.checks import check_positive
from shared.zoo.registry import register_model


class Attention(nn.Module):
    """Scaled dot-product attention of decoder queries over encoder outputs, padding masked out."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query = nn.Linear(hidden, hidden, bias=False)
        self.key = nn.Linear(hidden, hidden, bias=False)
        self.scale = 1.0 / math.sqrt(hidden)

    def forward(self, q: torch.Tensor, keys: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        # q (N, T, H), keys (N, S, H), pad_mask (N, S) true at padding -> context (N, T, H)
        scores = torch.bmm(self.query(q), self.key(keys).transpose(1, 2)) * self.scale
        scores = scores.masked_fill(pad_mask.unsqueeze(1), float("-inf"))
        return torch.bmm(torch.softmax(scores, dim=-1), keys)


class GNMT(nn.Module):
    def __init__(self, src_vocab: int, tgt_vocab: int, hidden: int, num_layers: int, dropout: float) -> None:
        super().__init__()
        self.src_embed = nn.Embedding(src_vocab, hidden, padding_idx=PAD)
        self.tgt_embed = nn.Embedding(tgt_vocab, hidden, padding_idx=PAD)
        self.drop = nn.Dropout(dropout)
        # Encoder: layer 0 reads both directions (half the width each way), the rest are unidirectional.
        self.encoder = nn.ModuleList(
            [nn.LSTM(hidden, hidden // 2, batch_first=True, bidirectional=True)]
            + [nn.LSTM(hidden, hidden, batch_first=True) for _ in range(num_layers - 1)]
        )
        self.decoder = nn.ModuleList(
            [nn.LSTM(hidden, hidden, batch_first=True)]
            + [nn.LSTM(2 * hidden, hidden, batch_first=True) for _ in range(num_layers - 1)]
        )
        self.attention = Attention(hidden)
        self.classifier = nn.Linear(hidden, tgt_vocab)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Source ids (N, S) and decoder input ids (N, T) -> logits (N, T, tgt_vocab)."""
        pad_mask = src.eq(PAD)
        x = self.drop(self.src_embed(src))
        for i, lstm in enumerate(self.encoder):  # a fixed range: fx unrolls it
            out = lstm(x)[0]
            # GNMT's residual connections start at the third layer.
            x = self.drop(out + x if i >= 2 else out)
        memory = x
        h = self.decoder[0](self.drop(self.tgt_embed(tgt_in)))[0]
        context = self.attention(h, memory, pad_mask)
        for i in range(1, len(self.decoder)):
            out = self.decoder[i](self.drop(torch.cat([h, context], dim=-1)))[0]
            h = out + h if i >= 2 else out
        logits: torch.Tensor = self.classifier(self.drop(h))
        return logits


@register_model(
    "gnmt",
    "GNMT-style seq2seq: LSTM encoder (bidirectional first layer) and decoder with attention, masking for "
    "padding; GNMT-8 size by default (1024 wide, 32k vocabularies); pairs with zoo:cmudict",
    "(int64 source ids (N, S), int64 decoder input ids (N, T)), 0 = padding; output (N, T, tgt_vocab)",
    dataset="cmudict",
    defaults={"hidden": 64, "num_layers": 3, "src_vocab": SRC_VOCAB, "tgt_vocab": TGT_VOCAB, "dropout": 0.0},
)
def gnmt(
    *,
    src_vocab: int = 32000,
    tgt_vocab: int = 32000,
    hidden: int = 1024,
    num_layers: int = 8,
    dropout: float = 0.2,
) -> nn.Module:
    check_positive("gnmt", src_vocab=src_vocab, tgt_vocab=tgt_vocab, hidden=hidden, num_layers=num_layers)
    if hidden % 2:
        raise ValueError(f"gnmt: hidden must be even (the bidirectional layer splits it), got {hidden}")
    return GNMT(src_vocab, tgt_vocab, hidden, num_layers, dropout)
