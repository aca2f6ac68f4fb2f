"""Hugging Face transformers built from small configs (random weights, nothing downloaded).

GPT-2 and a Llama-style decoder (``LlamaForCausalLM``: RMSNorm, rotary positions, SwiGLU,
grouped-query attention) as causal LMs, BERT for sequence classification. They are the models
as transformers defines them, not rewritten: pdprof traces them with torch.export
(``shared.tracer_export``). ``transformers`` is the optional extra ``hf``
(``pip install 'pipedream-toolchain[hf]'``). Dropout defaults to 0, since an exported graph
keeps its probabilities (see docs/models.md); the causal LMs tie the token embedding and the
output projection as the originals do (``tie_word_embeddings``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shared.errors import SpecError
from shared.zoo.datasets.pydoc_text import VOCAB_SIZE as PYDOC_VOCAB
from shared.zoo.models.checks import check_positive
from shared.zoo.registry import register_model


def _from_config(model: str, config: str, head: str, positive: tuple[str, ...], **fields: Any) -> nn.Module:
    """transformers' ``head`` on a ``config`` of ``fields``, random weights; the ``positive`` fields checked first."""
    check_positive(model, **{name: fields[name] for name in positive})
    try:
        import transformers
    except ImportError:
        raise SpecError(
            f"model spec 'zoo:{model}': needs transformers; pip install 'pipedream-toolchain[hf]'"
        ) from None
    built: nn.Module = getattr(transformers, head)(getattr(transformers, config)(**fields))
    return built


@register_model(
    "hf_gpt2",
    "transformers' GPT2LMHeadModel from a GPT2Config (4 blocks of 64 by default); pairs with zoo:pydoc_tokens "
    "and --loss causal_lm",
    "keyword input_ids, attention_mask int64 (N, T), T <= n_positions; output logits (N, T, vocab_size)",
    dataset="pydoc_tokens",
    defaults={"n_layer": 2, "n_embd": 32},
)
def hf_gpt2(
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_positions: int = 64,
    vocab_size: int = PYDOC_VOCAB,
    dropout: float = 0.0,
    tie_word_embeddings: bool = True,
) -> nn.Module:
    return _from_config(
        "hf_gpt2",
        "GPT2Config",
        "GPT2LMHeadModel",
        positive=("n_layer", "n_embd", "n_head", "vocab_size"),
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_positions=n_positions,
        vocab_size=vocab_size,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        tie_word_embeddings=tie_word_embeddings,
    )


@register_model(
    "hf_llama",
    "transformers' LlamaForCausalLM from a LlamaConfig (4 blocks of 64, 4 heads, 2 key/value heads); "
    "pairs with zoo:pydoc_tokens and --loss causal_lm",
    "keyword input_ids, attention_mask int64 (N, T); output logits (N, T, vocab_size)",
    dataset="pydoc_tokens",
    defaults={"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64},
)
def hf_llama(
    *,
    num_hidden_layers: int = 4,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = PYDOC_VOCAB,
    max_position_embeddings: int = 64,
    tie_word_embeddings: bool = True,
) -> nn.Module:
    return _from_config(
        "hf_llama",
        "LlamaConfig",
        "LlamaForCausalLM",
        positive=(
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        ),
        num_hidden_layers=num_hidden_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )


@register_model(
    "hf_bert",
    "transformers' BertForSequenceClassification from a BertConfig (4 layers of 64 by default); "
    "pairs with zoo:pydoc_lines",
    "keyword input_ids, attention_mask int64 (N, T); output logits (N, num_labels)",
    dataset="pydoc_lines",
    defaults={"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64},
)
def hf_bert(
    *,
    num_hidden_layers: int = 4,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    intermediate_size: int = 128,
    vocab_size: int = PYDOC_VOCAB,
    max_position_embeddings: int = 64,
    num_labels: int = 3,
    dropout: float = 0.0,
) -> nn.Module:
    return _from_config(
        "hf_bert",
        "BertConfig",
        "BertForSequenceClassification",
        positive=("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "num_labels"),
        num_hidden_layers=num_hidden_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        num_labels=num_labels,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
