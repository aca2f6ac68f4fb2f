"""A text classifier on ``torch.nn.TransformerEncoder`` (Vaswani et al., 2017): plain torch, keyword inputs.

Token and learned position embeddings, ``nn.TransformerEncoder`` (pre-norm layers, batch
first), the mean over the real (unmasked) positions, a linear head. ``forward`` takes
``input_ids`` and ``attention_mask`` as a Hugging Face model does, so it pairs with the zoo's
keyword datasets; the tracer opens the encoder into its layers (``shared.tracer``).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.zoo.datasets.pydoc_text import VOCAB_SIZE as PYDOC_VOCAB
from shared.zoo.models.checks import check_positive
from shared.zoo.registry import register_model


class EncoderClassifier(nn.Module):
    def __init__(
        self, vocab_size: int, max_len: int, d_model: int, nhead: int, num_layers: int, num_classes: int
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead, 2 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        # No nested tensors: they exist only on the inference fast path, which training never takes.
        self.encoder = nn.TransformerEncoder(
            layer, num_layers, nn.LayerNorm(d_model), enable_nested_tensor=False
        )
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Token ids and a 1/0 mask (N, T) -> class logits (N, num_classes)."""
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.embed(input_ids) + self.pos(pos)
        h = self.encoder(x, src_key_padding_mask=attention_mask == 0)
        keep = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        logits: torch.Tensor = self.head(pooled)
        return logits


@register_model(
    "transformer_encoder",
    "text classifier on torch.nn.TransformerEncoder (4 layers of 64 by default); pairs with zoo:pydoc_lines",
    "keyword input_ids, attention_mask int64 (N, T), T <= max_len; output (N, num_classes)",
    dataset="pydoc_lines",
    defaults={"num_layers": 2, "d_model": 32},
)
def transformer_encoder(
    *,
    num_layers: int = 4,
    d_model: int = 64,
    nhead: int = 4,
    max_len: int = 64,
    vocab_size: int = PYDOC_VOCAB,
    num_classes: int = 3,
) -> nn.Module:
    check_positive(
        "transformer_encoder", num_layers=num_layers, d_model=d_model, nhead=nhead, max_len=max_len
    )
    if d_model % nhead:
        raise ValueError(f"transformer_encoder: d_model ({d_model}) must be a multiple of nhead ({nhead})")
    return EncoderClassifier(vocab_size, max_len, d_model, nhead, num_layers, num_classes)
