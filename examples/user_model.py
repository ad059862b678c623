"""A user's own model, dataset, collate function and loss, trained by `dtrain` without changing it.

    dtrain examples/configs/user_model.yaml            # from the repository root
    torchrun --nproc_per_node=2 -m distributed_training examples/configs/user_model.yaml

The config names each part by import path (``examples.user_model:SmallConvNet``): the working
directory and the config file's directory are importable, so a package of your own next to your
YAML (``my_pkg/models.py`` -> ``my_pkg.models:build``) is found the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from distributed_training.datasets import digits


class SmallConvNet(nn.Module):
    """Two 3x3 convolutions and a linear head for 1-channel square images."""

    def __init__(self, channels: int = 16, classes: int = 10, size: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * channels * (size // 2) ** 2, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, 1, H, W) -> (B, classes)
        return self.head(self.features(images).flatten(1))


class Digits:
    """The 8x8 handwritten digits shipped with the package, as {"image", "label"} samples: a map-style
    dataset that is not a torch Dataset (``__getitem__`` and ``__len__`` are enough). ``split`` takes
    the first ``1 - val_share`` of a fixed shuffle (train) or the rest (val)."""

    def __init__(self, split: str = "train", val_share: float = 0.2, seed: int = 0) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        images, labels = digits().tensors
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
        cut = int(len(order) * (1 - val_share))
        keep = order[:cut] if split == "train" else order[cut:]
        self.images, self.labels = images[keep].view(-1, 1, 8, 8), labels[keep]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[i], "label": self.labels[i]}


def collate(samples: list[dict[str, torch.Tensor]], noise: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of {"image", "label"} samples as (images (B, 1, 8, 8), labels (B,)), with optional
    Gaussian pixel noise (an augmentation, drawn from torch's global generator)."""
    images = torch.stack([s["image"] for s in samples])
    if noise:
        images = images + noise * torch.randn_like(images)
    return images, torch.stack([s["label"] for s in samples])
