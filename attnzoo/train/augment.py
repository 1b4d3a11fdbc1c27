"""Random crop with zero padding and horizontal flip, drawn per (seed, epoch, index) from the
counter-based streams, in two implementations that give the same pixels:

- ``crop_flip_one``: one image with torchvision's pad / crop / flip (the DataLoader pipeline);
- ``crop_flip_gather``: a batch as one gather from the zero-padded split kept on the device
  (the device-resident pipeline): out[b, c, y, x] = padded[i_b, c, top_b + y, left_b + x'] with
  x' = W - 1 - x where the image is flipped."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torchvision.transforms.v2.functional as TF

from .counter_rng import SALT_FLIP, SALT_LEFT, SALT_TOP, Int, below, random_bits


@dataclass(frozen=True)
class CropFlip:
    """``pad``: zero padding on each side before the random crop back to the image size (0: no
    crop); ``flip``: random horizontal flip with probability 1/2."""
    pad: int = 4
    flip: bool = True

    @property
    def active(self) -> bool:
        return self.pad > 0 or self.flip

    def draw(self, seed: int, epoch: int, index: Int) -> tuple[Int, Int, Int]:
        """(top, left, flipped) for image ``index`` (an int or an int64 tensor of indices)."""
        span = 2 * self.pad + 1
        top = below(random_bits(seed, epoch, index, SALT_TOP), span) if self.pad else index * 0
        left = below(random_bits(seed, epoch, index, SALT_LEFT), span) if self.pad else index * 0
        flipped = (random_bits(seed, epoch, index, SALT_FLIP) >> 31) if self.flip else index * 0
        return top, left, flipped


def crop_flip_one(image: torch.Tensor, top: int, left: int, flipped: int, pad: int) -> torch.Tensor:
    """(C, H, W) uint8 -> the same shape: zero-pad by ``pad``, crop at (top, left), flip if asked."""
    if pad:
        image = TF.crop(TF.pad(image, [pad]), top, left, image.shape[-2], image.shape[-1])
    return TF.horizontal_flip(image) if flipped else image


def pad_split(images: torch.Tensor, pad: int) -> torch.Tensor:
    """(N, C, H, W) -> (N, C, H + 2 pad, W + 2 pad), zeros around: padded once, cropped per batch."""
    return torch.nn.functional.pad(images, (pad, pad, pad, pad)) if pad else images


def crop_flip_gather(padded: torch.Tensor, index: torch.Tensor, top: torch.Tensor, left: torch.Tensor,
                     flipped: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Images ``index`` of a split padded by ``pad_split``, each cropped at its (top, left) to
    ``size`` and flipped where ``flipped`` is 1: (B, C, H, W) uint8 in one indexing kernel."""
    h, w = size
    dev = padded.device
    ys, xs = torch.arange(h, device=dev), torch.arange(w, device=dev)
    rows = top[:, None] + ys                                         # (B, H)
    cols = left[:, None] + torch.where(flipped[:, None].bool(), w - 1 - xs, xs)  # (B, W)
    chans = torch.arange(padded.shape[1], device=dev)
    return padded[index[:, None, None, None], chans[None, :, None, None], rows[:, None, :, None],
                  cols[:, None, None, :]]
