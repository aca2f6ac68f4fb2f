"""shared.batches.gather: a TensorDataset's one-gather path equals collating its samples one by one."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset, default_collate

from shared.batches import gather
from shared.resolve import resolve_dataset


def test_tensor_dataset_gather_equals_sample_by_sample_collation() -> None:
    data = resolve_dataset("zoo:mnist5k")
    assert type(data) is TensorDataset
    idx = torch.randperm(len(data), generator=torch.Generator().manual_seed(1))[:64]
    (x,), y = gather(data, idx)
    want_x, want_y = default_collate([data[int(i)] for i in idx])
    assert torch.equal(x, want_x) and torch.equal(y, want_y)
    only_target = gather(data, idx, inputs=False)
    assert only_target[0] == () and torch.equal(only_target[1], want_y)
    assert gather(data, idx, target=False)[1] is None


def test_other_datasets_are_collated_sample_by_sample() -> None:
    class Pairs(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return torch.full((3,), float(i)), i

    (x,), y = gather(Pairs(), torch.tensor([4, 2]))
    assert x.tolist() == [[4.0] * 3, [2.0] * 3] and y.tolist() == [4, 2]


def test_labels_alone_come_from_the_targets_table_without_fetching_inputs() -> None:
    # A last stage needs only the labels: the synthetic data and video captions keep a `targets` table.
    for spec, args in [("zoo:synthetic", {"size": 40, "shape": [8]}), ("zoo:video_captions", {})]:
        data = resolve_dataset(spec, args)
        idx = torch.tensor([5, 0, 17, 5])
        want = default_collate([data[int(i)] for i in idx])[1]
        assert torch.equal(gather(data, idx, inputs=False)[1], want)

    class Counted(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
        def __init__(self, target_transform: object = None) -> None:
            self.targets = torch.arange(10)
            self.target_transform = target_transform
            self.fetched = 0

        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            self.fetched += 1
            t = self.targets[i]
            return torch.zeros(2), t if self.target_transform is None else t * 2

    plain, transformed = Counted(), Counted(target_transform=True)
    assert gather(plain, torch.tensor([3, 1]), inputs=False)[1].tolist() == [3, 1] and plain.fetched == 0
    # With a target_transform (torchvision's), targets[i] is not the label: fetch the samples.
    assert gather(transformed, torch.tensor([3, 1]), inputs=False)[1].tolist() == [6, 2]
    assert transformed.fetched == 2


def test_keyword_samples_labels_come_from_the_wrapped_datasets_targets_table() -> None:
    """A last stage of a transformers model reads its labels from zoo:pydoc_*'s table: the same batch as
    reading every sample; a target named as a field of the sample has no table."""
    from shared.fields import keyword_dataset

    idx = torch.tensor([7, 0, 123, 7])
    for spec in ("zoo:pydoc_lines", "zoo:pydoc_tokens"):
        data = keyword_dataset(resolve_dataset(spec), ["input_ids", "attention_mask"], None, spec)
        assert isinstance(data.targets, torch.Tensor)
        want = default_collate([data[int(i)] for i in idx])
        inputs, labels = gather(data, idx)
        assert all(torch.equal(a, b) for a, b in zip(inputs, want[0], strict=True))
        assert torch.equal(labels, want[1]) and torch.equal(gather(data, idx, inputs=False)[1], want[1])
    named = keyword_dataset(resolve_dataset("zoo:pydoc_lines"), ["input_ids"], "attention_mask", "x")
    assert named.targets is None
