"""FlexAttention paths (CUDA only) for L2 and Fenchel first order.

FlexAttention compiles a score modifier into a fused kernel: L2 becomes 2 * scale * q.k minus
scale * ||k_j||^2 (the ||q_i||^2 term cancels in the softmax), Fenchel adds log u_ij. Masks use
the same preparation as the SDPA path (``torch.sdpa_mask``): bottom-right causal, rows with no
key opened and then zeroed. FlexAttention has no backward on CPU, and this project's CI has no
GPU: the backend only accepts CUDA tensors. Its forward logic is checked on CPU under no_grad by an
opt-in test (ATTNZOO_FLEX_CPU=1, tests/test_cpu_softmax_family.py); CUDA and backward are untested.
"""
from __future__ import annotations

import functools

import torch

from .torch import fenchel_additive_mask, sdpa_mask


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def compiled_flex_attention():
    """flex_attention wrapped by torch.compile once per process: every caller (these backends, the
    benchmark's FlexAttention baseline) shares one compiled function and so one dynamo cache, instead
    of a fresh torch.compile object, and a fresh compile, per call site or per call."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)




def _flex(q, k, v, mask, is_causal, scale, key_term=None):
    """softmax(scale q.k + mask_ij - key_term_j) v with attnzoo's mask semantics."""
    from torch.nn.attention.flex_attention import create_block_mask
    B, H, nq, _ = q.shape
    nk = k.shape[2]
    mask, causal, has_key = sdpa_mask(mask, is_causal, nq, nk, q.device, q.dtype)
    block_mask = None
    additive = None
    if causal:
        block_mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, nq, nk, device=q.device)
    elif mask is not None and mask.dtype == torch.bool:
        full = mask.expand(B, H, nq, nk)
        block_mask = create_block_mask(lambda b, h, i, j: full[b, h, i, j], B, H, nq, nk, device=q.device)
    elif mask is not None:
        additive = mask.expand(B, H, nq, nk)

    def score_mod(score, b, h, i, j):
        if additive is not None:
            score = score + additive[b, h, i, j]
        if key_term is not None:
            score = score - key_term[b, h, j]
        return score

    out = compiled_flex_attention()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
    if has_key is not None:
        out = torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


def l2_flex(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0):
    kk = (k.float() * k.float()).sum(-1) * scale
    return _flex(q, k, v, attn_mask, is_causal, 2.0 * scale, key_term=kk)


def fenchel_flex(q, k, v, *, attn_mask=None, is_causal=False, scale, log_u=None, alpha=1.0,
                 solve="first_order", dropout_p=0.0):
    mask = fenchel_additive_mask(attn_mask, log_u, q.dtype)
    return _flex(q, k, v, mask, is_causal, alpha * scale)
