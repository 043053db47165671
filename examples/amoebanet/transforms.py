"""Image preprocessing: decode, resize, augment (crop + flip), normalise.

The augmentation is the usual CIFAR-10 recipe (He et al. 2016, "Deep Residual
Learning for Image Recognition", Section 4.2): pad by 4 pixels (an eighth of
the image side here), take a random crop of the original size, flip
horizontally with probability 1/2.
"""

import numpy as np
import torch
from PIL import Image
from torch import Tensor

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
"""Per-channel mean of the CIFAR-10 training images, RGB in [0, 1]."""

CIFAR10_STD = (0.2470, 0.2435, 0.2616)
"""Per-channel standard deviation of the CIFAR-10 training images, RGB in [0, 1]."""


def decode(image: Image.Image, size: int) -> Tensor:
    """Decode a PIL image to a uint8 tensor (3, size, size), resizing (bilinear) if needed."""
    image = image.convert("RGB")
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BILINEAR)
    return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)


def random_crop(image: Tensor, padding: int) -> Tensor:
    """Zero-pad (C, H, W) by ``padding`` on every side and crop a random (C, H, W) window."""
    _, height, width = image.shape
    padded = torch.nn.functional.pad(image, (padding, padding, padding, padding))
    top, left = torch.randint(0, 2 * padding + 1, (2,)).tolist()
    return padded[:, top : top + height, left : left + width]


def random_flip(image: Tensor) -> Tensor:
    """Flip (C, H, W) left-right with probability 1/2."""
    return image.flip(-1) if torch.rand(()) < 0.5 else image


class ImageTransform:
    """Turn a PIL image, or one already :func:`decode`-d, into a normalised float tensor (3, image_size, image_size).

    Args:
        image_size: output height and width.
        mean: per-channel mean subtracted after scaling to [0, 1].
        std: per-channel standard deviation divided by.
        augment: apply random crop (padding ``image_size // 8``) and flip (training only).
    """

    def __init__(
        self, image_size: int, mean: tuple[float, float, float], std: tuple[float, float, float], augment: bool
    ) -> None:
        self.image_size = image_size
        self.mean = torch.tensor(mean).view(3, 1, 1)
        self.std = torch.tensor(std).view(3, 1, 1)
        self.augment = augment

    def __call__(self, image: Image.Image | Tensor) -> Tensor:
        """Return the preprocessed tensor for ``image`` (a PIL image or a uint8 (3, image_size, image_size) tensor)."""
        tensor = image if isinstance(image, Tensor) else decode(image, self.image_size)
        tensor = tensor.float().div_(255)
        if self.augment:
            tensor = random_flip(random_crop(tensor, self.image_size // 8))
        return (tensor - self.mean) / self.std
