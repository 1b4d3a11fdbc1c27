"""Chunked causal linear attention for CPU (any device, really: plain batched matmuls).

``causal_product(q, k, v, s0)_i = q_i^T (s0 + sum_{j <= i} k_j v_j^T)`` on chunks of C rows:
inside a chunk the quadratic form tril(Q K^T) V, across chunks a state S_c = s0 + sum of earlier
chunks' K^T V. All chunks are processed at once (batched matmuls, a cumsum over chunk states), so
the largest tensors are (N/C, D, Dv) states and (N/C, C, C) intra-chunk blocks, never the
(N, D, Dv) prefix sums the reference builds. The backward recomputes both from q, k, v, s0.
"""
from __future__ import annotations

import torch

from .factorised import key_only_mask, linear_attention_factorised

DEFAULT_CHUNK = 64


def _chunks(x, chunk):
    n = x.shape[-2]
    pad = (-n) % chunk
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))   # zero rows contribute nothing
    return x.reshape(x.shape[:-2] + (x.shape[-2] // chunk, chunk, x.shape[-1]))


def _shift_chunks(x, later):
    """x moved one chunk along dim -3 (zeros coming in): an exclusive prefix (later=False: chunk c gets
    c - 1) or suffix sum from an inclusive one. Not the inclusive sum minus x: a NaN (or inf) would then
    reach its own chunk's earlier rows through NaN - NaN."""
    pad = (0, 0, 0, 0, 0, 1) if later else (0, 0, 0, 0, 1, 0)
    inner = x[..., 1:, :, :] if later else x[..., :-1, :, :]
    return torch.nn.functional.pad(inner, pad)


def _exclusive_states(k, v, s0):
    """S_c = s0 + sum_{c' < c} K_c'^T V_c', shape (..., nc, D, Dv)."""
    kv = k.transpose(-1, -2) @ v
    return s0.unsqueeze(-3) + _shift_chunks(kv.cumsum(-3), later=False)


class _CausalProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, s0, chunk):
        n = q.shape[-2]
        qc, kc, vc = _chunks(q, chunk), _chunks(k, chunk), _chunks(v, chunk)
        out = qc @ _exclusive_states(kc, vc, s0) + (qc @ kc.transpose(-1, -2)).tril() @ vc
        ctx.save_for_backward(q, k, v, s0)
        ctx.chunk = chunk
        return out.reshape(out.shape[:-3] + (-1, out.shape[-1]))[..., :n, :]

    @staticmethod
    def backward(ctx, dout):
        q, k, v, s0 = ctx.saved_tensors
        n, chunk = q.shape[-2], ctx.chunk
        qc, kc, vc, dc = _chunks(q, chunk), _chunks(k, chunk), _chunks(v, chunk), _chunks(dout, chunk)
        a = (qc @ kc.transpose(-1, -2)).tril()
        da = (dc @ vc.transpose(-1, -2)).tril()
        # gradient reaching the state used by chunk c comes from every later chunk's queries
        qdo = qc.transpose(-1, -2) @ dc                                      # (..., nc, D, Dv)
        suffix = qdo.flip(-3).cumsum(-3).flip(-3)                            # chunks c and later
        total = suffix[..., 0, :, :]
        ds_after = _shift_chunks(suffix, later=True)
        dq = da @ kc + dc @ _exclusive_states(kc, vc, s0).transpose(-1, -2)
        dk = da.transpose(-1, -2) @ qc + vc @ ds_after.transpose(-1, -2)
        dv = a.transpose(-1, -2) @ dc + kc @ ds_after

        def unchunk(x):
            return x.reshape(x.shape[:-3] + (-1, x.shape[-1]))[..., :n, :]
        return unchunk(dq), unchunk(dk), unchunk(dv), total, None


def causal_product(q, k, v, s0, chunk=None):
    """q_i^T (s0 + sum_{j <= i} k_j v_j^T) for q, k (..., N, D), v (..., N, Dv), s0 (..., D, Dv).
    ``chunk`` rows per chunk (default: the module's DEFAULT_CHUNK, read per call)."""
    s0 = s0.expand(q.shape[:-2] + s0.shape[-2:])
    return _CausalProduct.apply(q, k, v, s0, DEFAULT_CHUNK if chunk is None else int(chunk))


def linear_attention_cpu(q, k, v, *, attn_mask=None, is_causal=False, scale=1.0, feature_map="elu",
                         dropout_p=0.0):
    return linear_attention_factorised(causal_product, q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                       scale=scale, feature_map=feature_map)


def supports_linear_fused(q, k, v, **kw):
    """Shared by the cpu and triton linear backends: None, or why the call needs the reference."""
    if kw.get("dropout_p", 0.0) > 0:
        return "dropout on the weights needs the N x N weight matrix (use backend='reference')"
    if not key_only_mask(kw.get("attn_mask")):
        return ("a query-dependent attn_mask (not of shape (..., 1, Nk)) needs the N x N weights: linear "
                "attention only factorises with key masks and is_causal (use backend='reference')")
    return None
