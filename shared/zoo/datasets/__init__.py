"""The zoo's datasets; importing this package registers them all."""

from shared.zoo.datasets import synthetic, tabular  # noqa: F401
