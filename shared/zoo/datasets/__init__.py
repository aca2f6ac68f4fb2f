"""The zoo's datasets; importing this package registers them all."""

from shared.zoo.datasets import cmudict_g2p, pydoc_text, synthetic, tabular, video_captions  # noqa: F401
