"""Packed calls that a variant's own Triton kernels take in one call for all sequences, reading the
offsets in the kernels (``ops/varlen.py``'s eager route asks here after the blockwise CPU path).

A variant whose kernels live in its own folder (linear attention: ``ops/linear/varlen.py``) registers
a route here from its ``__init__``, so this shared module imports no variant folder (the layering
rule of tests/test_architecture.py); the softmax and pointwise families' packed kernels are routed
elsewhere. A route returns the packed output (T_q, H, Dv), or None when the call does not take it
(another backend named, dropout, an option the kernels do not compute, a device they do not run on):
the caller then runs the sequences per length through the variant's own function, which checks and
dispatches each call as usual. A route never reads the offsets on the host.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

ROUTES: dict[str, Callable] = {}


def register(variant: str, route: Callable) -> None:
    """``route(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, kwargs)`` -> (T_q, H, Dv) or None;
    ``kwargs``: scale, dropout_p, backend, enable_gqa and the variant's options as the call gave them."""
    ROUTES[variant] = route


def run(name: str, q, k, v, cu_seq_q, cu_seq_k, max_q: int, max_k: int, is_causal, kwargs: dict
        ) -> Optional[torch.Tensor]:
    route = ROUTES.get(name)
    return None if route is None else route(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, kwargs)
