"""A small real image dataset that installs from PyPI: scikit-learn's handwritten digits as 3x32x32 images.

The CIFAR-10 example falls back to it when no CIFAR-10 is on disk, so the example always runs on real
pictures (1,797 scans of handwritten digits, 8x8 pixels, upsampled) and reaches a meaningful accuracy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CLASSES = tuple(str(d) for d in range(10))


def load_digits_as_cifar(train: bool = True, test_fraction: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """(images uint8 (N, 3, 32, 32), labels int64 (N,)), a fixed split: the last 20% is the test set."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError("the digits fallback needs scikit-learn: pip install 'paratrain[examples]' "
                          "(or scikit-learn)") from None
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0  # (N, 1, 8, 8) in [0, 1]
    images = F.interpolate(images, size=(32, 32), mode="bilinear", align_corners=False)
    images = (images.clamp(0, 1) * 255).round().to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    labels = torch.tensor(digits.target, dtype=torch.int64)
    split = int(len(labels) * (1 - test_fraction))
    return (images[:split], labels[:split]) if train else (images[split:], labels[split:])
