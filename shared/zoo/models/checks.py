"""Argument checks the zoo's builders share, so a bad size fails at build time with a clear message."""

from __future__ import annotations


def check_image_size(model: str, image_size: int, minimum: int) -> None:
    """Raise ``ValueError`` (a ``SpecError`` once the resolver wraps it) when images are too small."""
    if image_size < minimum:
        raise ValueError(f"{model} needs image_size >= {minimum}, got {image_size}")


def check_positive(model: str, **values: int) -> None:
    """Raise ``ValueError`` naming the first argument that is not a positive integer."""
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{model}: {name} must be at least 1, got {value}")
