"""The zoo's datasets: offline loading, fixed splits, and samples that mean what the docs say."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from shared.resolve import resolve_dataset
from shared.zoo import registry
from shared.zoo.datasets.cmudict_g2p import BOS, EOS, LETTERS, PHONEMES
from shared.zoo.datasets.pydoc_text import VOCAB_SIZE, decode

OFFLINE_LOAD = textwrap.dedent(
    """
    import json, socket

    def refuse(*args, **kwargs):
        raise OSError("network unreachable (test)")

    # Before anything is imported: every way to open a connection or resolve a name fails.
    socket.socket.connect = refuse
    socket.socket.connect_ex = refuse
    socket.create_connection = refuse
    socket.getaddrinfo = refuse
    try:
        socket.create_connection(("pypi.org", 443), timeout=1)
        blocked = False
    except OSError:
        blocked = True

    import torch
    torch.set_num_threads(1)
    from shared.zoo import registry

    sizes = {}
    for name, entry in registry.datasets().items():
        for split in ("train", "val"):
            data = entry.build(split=split)
            x, y = data[len(data) - 1]
            sizes[f"{name}/{split}"] = len(data)
    print(json.dumps({"blocked": blocked, "sizes": sizes}))
    """
)


def test_every_dataset_loads_with_the_network_unreachable() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", OFFLINE_LOAD], capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["blocked"] is True
    names = {"digits", "mnist5k", "cmudict", "pydoc_text", "synthetic", "synthetic_images", "video_captions"}
    assert names <= set(registry.datasets())
    for name in names:
        for split in ("train", "val"):
            assert report["sizes"][f"{name}/{split}"] > 0
    assert report["sizes"]["mnist5k/train"] + report["sizes"]["mnist5k/val"] == 5000
    assert report["sizes"]["digits/train"] + report["sizes"]["digits/val"] == 1797


@pytest.mark.parametrize(
    "name", ["digits", "mnist5k", "cmudict", "pydoc_text", "synthetic", "video_captions"]
)
def test_splits_are_fixed_by_seed(name: str) -> None:
    a = resolve_dataset(f"zoo:{name}", {"split": "train"})
    b = resolve_dataset(f"zoo:{name}", {"split": "train"})
    val = resolve_dataset(f"zoo:{name}", {"split": "val"})
    other = resolve_dataset(f"zoo:{name}", {"split": "train", "seed": 1})
    assert len(a) == len(b) > len(val) > 0

    def flat(sample: tuple[Any, torch.Tensor]) -> torch.Tensor:
        x, y = sample
        parts = list(x) if isinstance(x, (tuple, list)) else [x]
        return torch.cat([p.reshape(-1).float() for p in [*parts, y]])

    for i in (0, len(a) // 2, len(a) - 1):
        torch.testing.assert_close(flat(a[i]), flat(b[i]), rtol=0, atol=0)
    firsts = [flat(a[i]) for i in range(8)]
    assert any(not torch.equal(f, flat(other[i])) for i, f in enumerate(firsts)), "seed 1 gave the same order"
    assert all(not torch.equal(flat(val[i]), f) for i in range(4) for f in firsts)


def test_cmudict_pairs_are_letters_to_phonemes() -> None:
    data = resolve_dataset("zoo:cmudict")
    val = resolve_dataset("zoo:cmudict", {"split": "val"})
    assert len(data) > 100_000

    def word(letters: torch.Tensor) -> str:
        return "".join(LETTERS[i] for i in letters.tolist() if i != 0)

    # Train and val hold different words, and together every word.
    train_words = {word(data.letters[i]) for i in range(len(data))}
    val_words = {word(val.letters[i]) for i in range(len(val))}
    assert not train_words & val_words
    assert len(train_words) + len(val_words) == len(data) + len(val)
    words = {w: i for i, w in enumerate(word(data.letters[i]) for i in range(len(data)))} | {}
    source = data if "cat" in words else val
    index = words["cat"] if "cat" in words else [word(val.letters[i]) for i in range(len(val))].index("cat")
    (letters, dec_in), target = source[index]
    assert letters.shape == (16,) and dec_in.shape == target.shape == (17,)
    phones = [PHONEMES[i] for i in target.tolist() if i >= 0]
    assert phones == ["K", "AE1", "T", "<eos>"]  # CMUdict: cat  K AE1 T
    assert dec_in[0] == BOS and dec_in[1:4].tolist() == target[:3].tolist()
    assert target[3] == EOS and (target[4:] == -100).all() and (dec_in[4:] == 0).all()


def test_pydoc_text_targets_are_the_next_characters() -> None:
    from pydoc_data.topics import topics

    data = resolve_dataset("zoo:pydoc_text", {"block_size": 32})
    x, y = data[5]
    assert x.shape == y.shape == (32,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])
    assert int(x.max()) < VOCAB_SIZE
    text = "\n\n".join(topics[k] for k in sorted(topics))
    assert decode(torch.cat([x, y[-1:]])) in text


@pytest.mark.parametrize("name", ["pydoc_tokens", "pydoc_lines"])
def test_pydoc_blocks_are_the_corpus_with_real_characters_then_padding(name: str) -> None:
    """Each sample, as the module doc defines it, from the corpus: its block's first characters (a
    length fixed per sample, at least three quarters of the block), then padding (id 0, mask 0); the
    target is the block with -100 at the padding (tokens) or its line breaks, capped (lines)."""
    from shared.zoo.datasets.pydoc_text import corpus
    from shared.zoo.datasets.pydoc_tokens import NEWLINE

    data = resolve_dataset(f"zoo:{name}", {"block_size": 16})
    text = corpus()
    lengths = set()
    for i in (0, 1, 2, 50, len(data) - 1):
        fields, target = data[i]
        start = int(data.starts[i])
        length = int(fields["attention_mask"].sum())
        lengths.add(length)
        assert 12 <= length <= 16 and fields["attention_mask"][:length].all()
        assert torch.equal(fields["input_ids"][:length], text[start : start + length])
        assert (fields["input_ids"][length:] == 0).all()
        if name == "pydoc_tokens":
            assert (
                torch.equal(target[:length], fields["input_ids"][:length]) and (target[length:] == -100).all()
            )
        else:
            lines = int((text[start : start + length] == NEWLINE).sum())
            assert target.shape == () and int(target) == min(lines, 2)
    assert len(lengths) > 1  # the padding varies from sample to sample


def test_synthetic_shapes_and_lazy_images() -> None:
    data = resolve_dataset(
        "zoo:synthetic", {"shape": [3, 5], "target_shape": [2], "num_classes": 4, "size": 7}
    )
    x, y = data[6]
    assert x.shape == (3, 5) and y.shape == (2,) and int(y.max()) < 4 and len(data) == 7
    with pytest.raises(IndexError):
        data[7]
    images = resolve_dataset("zoo:synthetic_images", {"image_size": 64, "size": 100_000})
    x, y = images[99_999]  # generated on demand: a dataset this size costs no memory up front
    assert x.shape == (3, 64, 64) and 0 <= int(y) < 1000


def test_video_captions_repeat_each_clip_caption() -> None:
    data = resolve_dataset("zoo:video_captions")
    (frames, words), target = data[0]
    assert frames.shape == (8, 64) and words.shape == target.shape == (8,)
    length = int((target != -100).sum())
    assert target[length - 1] == 2 and words[0] == 1  # EOS closes the caption, BOS opens the decoder input
    assert torch.equal(words[1:length], target[: length - 1])
    # Samples of the same clip share its caption, and their frames lie near the same prototype.
    same = [i for i in range(1, 200) if torch.equal(data[i][1], target) and torch.equal(data[i][0][1], words)]
    assert same
    other_clip = next(i for i in range(1, 200) if not torch.equal(data[i][1], target))
    near = (frames - data[same[0]][0][0]).abs().mean()
    far = (frames - data[other_clip][0][0]).abs().mean()
    assert near < 0.75 < 1.0 < far  # noise 0.5 on both: ~0.56 apart; different clips: ~1.26
