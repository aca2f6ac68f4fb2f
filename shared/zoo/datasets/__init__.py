"""The zoo's datasets; importing this package registers them all."""

from shared.zoo.datasets import (  # noqa: F401
    cmudict_g2p,
    pydoc_text,
    pydoc_tokens,
    synthetic,
    tabular,
    video_captions,
)
