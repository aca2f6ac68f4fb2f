"""A GPT-style decoder (Radford et al., 2019; after nanoGPT): pre-norm blocks with causal self-attention.

Input and output embeddings are separate matrices by default; ``tie=True`` makes the output
projection read the token embedding's matrix, as GPT-2 does. A pipeline that puts the two on
different stages keeps them one parameter by summing its gradient (pdrun/tied.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.zoo.datasets.pydoc_text import VOCAB_SIZE as PYDOC_VOCAB
from shared.zoo.models.checks import check_positive
from shared.zoo.registry import register_model


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x).chunk(3, dim=-1)
        # Indexing, not unpacking: fx cannot iterate over the proxy that chunk returns.
        q, k, v = self._heads(qkv[0]), self._heads(qkv[1]), self._heads(qkv[2])
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        out: torch.Tensor = self.resid_dropout(self.c_proj(y.transpose(1, 2).flatten(2)))
        return out

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        # (N, T, C) -> (N, heads, T, C / heads) with static sizes only, so that fx can trace it.
        return torch.unflatten(t, -1, (self.n_head, -1)).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dropout(self.c_proj(self.gelu(self.c_fc(x))))
        return out


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float,
        tie: bool = False,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.Sequential(*[Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                # GPT-2's init; residual projections scaled down by the depth.
                std = 0.02 / (2 * n_layer) ** 0.5 if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        if tie:
            self.lm_head.weight = self.wte.weight  # one parameter, read by the first and the last layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (N, T) with T <= block_size -> next-token logits (N, T, vocab_size)."""
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        logits: torch.Tensor = self.lm_head(self.ln_f(self.h(x)))
        return logits


@register_model(
    "gpt",
    "GPT-style decoder (GPT-2 small by default: 12 layers, 12 heads, 768 wide); pairs with zoo:pydoc_text",
    "int64 token ids (N, T), T <= block_size; output (N, T, vocab_size)",
    dataset="pydoc_text",
    defaults={"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64, "vocab_size": PYDOC_VOCAB},
)
def gpt(
    *,
    n_layer: int = 12,
    n_head: int = 12,
    n_embd: int = 768,
    block_size: int = 1024,
    vocab_size: int = 50257,
    dropout: float = 0.0,
    tie: bool = False,
) -> nn.Module:
    check_positive(
        "gpt", n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, vocab_size=vocab_size
    )
    if n_embd % n_head:
        raise ValueError(f"gpt: n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout, tie)
