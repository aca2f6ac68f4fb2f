"""The zoo's models; importing this package registers them all."""

from shared.zoo.models import alexnet, gnmt, gpt, inception, resnet, s2vt, small, squeezenet, vgg  # noqa: F401
