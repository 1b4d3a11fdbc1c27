"""Counter-based randomness: every random number the data pipeline draws is a pure function of
(seed, epoch, index, salt), computed with integer arithmetic that gives the same bits on a CPU, on a
GPU, inside a DataLoader worker and inside torch.compile.

The mixer is ``lowbias32`` (Chris Wellons' hash prospector): xor-shift / multiply rounds, a
bijection of the 32-bit integers. Values live in int64 tensors (or Python ints) kept below 2^32;
the 32-bit products are formed from 16-bit halves so no intermediate reaches 2^63 (no signed
overflow anywhere, so no reliance on wrap-around). For a fixed (seed, epoch, salt) the map
index -> bits is a bijection too, so sorting by it gives a permutation without ties.

Salts name the independent streams (order, crop rows, crop columns, flips, partner coin, partner
pick)."""
from __future__ import annotations

from typing import Union

import torch

Int = Union[int, torch.Tensor]
MASK32 = 0xFFFFFFFF
SALT_ORDER, SALT_TOP, SALT_LEFT, SALT_FLIP, SALT_PARTNER_COIN, SALT_PARTNER_PICK = range(1, 7)


def _mul32(x: Int, c: int) -> Int:
    """(x * c) mod 2^32 for 0 <= x < 2^32, from 16-bit halves of x (every product < 2^48)."""
    lo = (x & 0xFFFF) * c
    hi = (((x >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def hash32(x: Int) -> Int:
    """lowbias32: a bijection of [0, 2^32) with good avalanche; works on Python ints and int64 tensors."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_key(seed: int, epoch: int, salt: int) -> tuple[int, int]:
    """Two 32-bit keys for one (seed, epoch, salt) stream (Python ints: computed once per batch)."""
    k = hash32(salt)
    for part in (seed & MASK32, (seed >> 32) & MASK32, epoch & MASK32):
        k = hash32((k + part) & MASK32)
    return k, hash32(k ^ 0x9E3779B9)


def random_bits(seed: int, epoch: int, index: Int, salt: int) -> Int:
    """32 random bits per index in [0, 2^32), a bijection of the index for fixed (seed, epoch, salt)."""
    k1, k2 = stream_key(seed, epoch, salt)
    return hash32(hash32(index ^ k1) ^ k2)


def below(bits: Int, n: Int) -> Int:
    """A draw in [0, n) from 32 random bits (multiply-shift; n < 2^31)."""
    return (bits * n) >> 32


def coin(bits: Int, prob: float) -> Int:
    """True with probability ``prob`` (to 2^-32)."""
    return bits < int(round(prob * 2 ** 32))


def permutation(seed: int, epoch: int, n: int, device=None) -> torch.Tensor:
    """A random permutation of 0..n-1 for (seed, epoch): the order of the sort keys, which are
    distinct (a bijection), so every device's sort gives the same answer."""
    keys = random_bits(seed, epoch, torch.arange(n, device=device), SALT_ORDER)
    return torch.argsort(keys)
