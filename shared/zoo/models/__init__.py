"""The zoo's models; importing this package registers them all."""

from shared.zoo.models import small  # noqa: F401
