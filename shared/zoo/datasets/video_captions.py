"""Synthetic video captioning for S2VT: per-frame feature vectors in, a caption out.

There is no video data here (MSVD is not shipped in any package), so this is a
stand-in with the same shapes and a learnable signal: each sample shows one of
``num_videos`` clips, its frames are that clip's fixed feature prototype plus noise, and
its caption is that clip's fixed word sequence. Word ids: 0 padding, 1 BOS, 2 EOS, then
words. Decoder input is ``BOS + caption`` (padded with 0); the target is ``caption + EOS``
(padded with -100, which the loss ignores).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from shared.zoo.datasets.synthetic import check_split, sample_generator
from shared.zoo.registry import register_dataset

PAD, BOS, EOS = 0, 1, 2
IGNORE = -100


class VideoCaptions(Dataset[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]):
    def __init__(
        self, size: int, num_frames: int, feat_dim: int, max_words: int, vocab_size: int, num_videos: int,
        noise: float, seed: int, split: str,
    ) -> None:  # fmt: skip
        self.size, self.noise, self.seed, self.split = size, noise, seed, split
        # The clips (prototypes and captions) are the same in both splits; only the samples differ.
        g = torch.Generator().manual_seed(seed)
        self.prototypes = torch.randn((num_videos, num_frames, feat_dim), generator=g)
        self.words_in = torch.full((num_videos, max_words), PAD, dtype=torch.int64)
        self.targets = torch.full((num_videos, max_words), IGNORE, dtype=torch.int64)
        lengths = torch.randint(1, max_words, (num_videos,), generator=g).tolist()
        for v, length in enumerate(lengths):
            caption = torch.randint(3, vocab_size, (length,), generator=g)
            self.words_in[v, : length + 1] = torch.cat([torch.tensor([BOS]), caption])
            self.targets[v, : length + 1] = torch.cat([caption, torch.tensor([EOS])])

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        if not -self.size <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} samples")
        g = sample_generator(self.seed, self.split, index % self.size)
        video = int(torch.randint(0, self.prototypes.shape[0], (), generator=g))
        proto = self.prototypes[video]
        frames = proto + self.noise * torch.randn(proto.shape, generator=g)
        return (frames, self.words_in[video]), self.targets[video]


@register_dataset(
    "video_captions",
    "SYNTHETIC frame features and captions for S2VT (16 clips; 1,024 train / 256 val by default)",
    "input (float32 frames (num_frames, feat_dim) = (8, 64), int64 words in (max_words,) = (8,)), "
    "target int64 (8,) padded with -100",
)
def video_captions(
    *,
    size: int | None = None,
    num_frames: int = 8,
    feat_dim: int = 64,
    max_words: int = 8,
    vocab_size: int = 32,
    num_videos: int = 16,
    noise: float = 0.5,
    seed: int = 0,
    split: str = "train",
) -> VideoCaptions:
    check_split(split)
    if min(num_frames, feat_dim, num_videos) < 1 or max_words < 2 or vocab_size < 4:
        raise ValueError(
            "video_captions needs num_frames, feat_dim, num_videos >= 1, max_words >= 2 and vocab_size >= 4, got "
            f"{num_frames}, {feat_dim}, {num_videos}, {max_words}, {vocab_size}"
        )
    n = size if size is not None else (1024 if split == "train" else 256)
    if n < 1:
        raise ValueError(f"size must be at least 1, got {n}")
    return VideoCaptions(n, num_frames, feat_dim, max_words, vocab_size, num_videos, noise, seed, split)
