"""Per-key-token options of a packed call (ops/varlen.py).

A variant option that is one value per key *token* (Fenchel's context preference log u_j, computed by
a layer from each key token x_j) has no meaning in the (B, H, Nq, Nk) layout of an ordinary call once
the sequences are packed: its keys are the packed tokens of every sequence. ``PerKey`` marks such a
value in the packed layout, (T_k, H) (or (T_k, 1) for every head), row j belonging to packed key token
j. Every packed route hands each sequence its own rows, as the (G, H, 1, n_k) tensor an ordinary
call of G stacked sequences takes; the blockwise CPU path reads them as one (1, H, 1, T_k) tensor
and slices each sequence's keys. A marker, not a shape rule: a plain tensor option keeps the
ordinary layout's meaning (broadcast over every sequence).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class PerKey(NamedTuple):
    """One value per packed key token and head: ``values`` (T_k, H) or (T_k, 1)."""
    values: torch.Tensor

    def check(self, name: str, total_k: int, heads: int) -> None:
        t = self.values
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != total_k or t.shape[1] not in (1, heads):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} given per key token (PerKey) must be a (T_k={total_k}, H={heads} or 1) "
                             f"tensor, got {got}")

    def packed(self) -> torch.Tensor:
        """(1, H|1, 1, T_k): the blockwise packed path's additive term."""
        return self.values.t()[None, :, None, :]

    def stacked(self, offsets_k: list[int], members: list[int]) -> torch.Tensor:
        """(G, H|1, 1, n_k): the rows of sequences ``members`` (all n_k long), stacked."""
        rows = torch.stack([self.values[offsets_k[i]:offsets_k[i + 1]] for i in members])   # (G, n_k, H)
        return rows.permute(0, 2, 1)[:, :, None, :]

    def padded(self, seq: torch.Tensor, pos: torch.Tensor, n_seq: int, max_k: int) -> torch.Tensor:
        """(N, H|1, 1, max_k): each sequence's rows at the front, zeros after (its padded keys are masked)."""
        t = self.values
        out = t.new_zeros((n_seq, max_k, t.shape[1])).index_put((seq, pos), t)
        return out.permute(0, 2, 1)[:, :, None, :]


def per_key_options(options: dict) -> dict:
    """The options given as PerKey."""
    return {name: value for name, value in options.items() if isinstance(value, PerKey)}
