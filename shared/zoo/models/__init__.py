"""The zoo's models; importing this package registers them all."""

from shared.zoo.models import (  # noqa: F401
    alexnet,
    encoder,
    gnmt,
    gpt,
    hf,
    inception,
    mobilenet,
    resnet,
    s2vt,
    small,
    squeezenet,
    vgg,
)
