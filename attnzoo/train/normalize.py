"""Pixel normalisation as a table lookup, shared by the DataLoader and the device-resident pipelines."""
from __future__ import annotations

import torch

from .datasets import DatasetInfo


def normalization_table(info: DatasetInfo, device=None) -> torch.Tensor:
    """(C, 256) float32: (v / 255 - mean_c) / std_c for every pixel value v, computed once on the CPU.
    Normalising is then a lookup, so every device gives the same floats (a GPU divides by a scalar
    as a multiplication by its reciprocal, which can differ from the CPU's division in the last bit)."""
    mean, std = torch.tensor(info.mean).view(-1, 1), torch.tensor(info.std).view(-1, 1)
    return ((torch.arange(256).float() / 255.0 - mean) / std).to(device)


def normalize(images: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """uint8 (..., C, H, W) -> float32 of the same shape through the channel's ``normalization_table``."""
    c = table.shape[0]
    offsets = torch.arange(0, 256 * c, 256, device=images.device).view(c, 1, 1)
    return table.view(-1)[images.long() + offsets]
