"""Sinkhorn attention (paper 002 sec 2.4 and appendix A.2; Sander et al.'s Sinkformers), eager,
log-domain, unrolled (autograd differentiates through every iteration).

Logits: L_ij = -scale * ||q_i - k_j||^2 / (2 eps)   (cost="l2", the kernel exp(-c_eps))
        L_ij =  scale * q_i . k_j / eps            (cost="dot", paper 002 remark 5.2)
plus the float mask. With potentials f (queries) and g (keys), one iteration is
    f_i = -logsumexp_j (L_ij + g_j)                 (row normalisation)
    g_j = log(Nq/Nk) - logsumexp_i (L_ij + f_i)     (column normalisation to the uniform marginal)
and the weights are the final row normalisation P_ij = softmax_j(L_ij + g_j), so every row sums to
one and, as n_iters grows, every column sums to Nq/Nk. n_iters = 0 is softmax(L).

Causal: paper 002 eq (2.6) defines masked attention as the variant applied to each prefix,
out_i = Sinkhorn(x_1..x_i)_i. For softmax this equals masking the score matrix; for Sinkhorn it
does not (column sums couple rows), and masking the lower triangle would let query i depend on
later queries through the column normalisation. We therefore run Sinkhorn on every prefix, which
keeps the causal prefix property exact at O(N^3) cost for this reference. A mask given with
is_causal=True (a band, packed blocks, padding) shapes each prefix problem as
``masking.coupled_causal_rows`` defines: row i is solved on the tokens it sees, each pair as the
mask lets the later token see the earlier one.
"""
from __future__ import annotations

import math

import torch

from ..common import dot_logits, sq_dist, upcast, weights_dropout
from ..logit_extras import cap_logits
from ..masking import coupled_causal_rows, masked_softmax, safe_logsumexp, split_mask


def sinkhorn_logits(q, k, *, scale, eps, cost):
    if cost == "l2":
        return -scale * sq_dist(q, k) / (2.0 * eps)
    return dot_logits(q, k, scale) / eps


def sinkhorn_potential(logits, keep, n_iters):
    """Key potential g after n_iters (row, column) rounds; logits already hold -inf where masked."""
    nq, nk = logits.shape[-2], logits.shape[-1]
    if keep is not None:
        logits = logits.masked_fill(~keep, -math.inf)
    col_target = math.log(nq / nk)
    g = torch.zeros(logits.shape[:-2] + (1, nk), dtype=logits.dtype, device=logits.device)
    for _ in range(n_iters):
        f = -safe_logsumexp(logits + g, dim=-1)          # (..., Nq, 1)
        g = col_target - safe_logsumexp(logits + f, dim=-2)  # (..., 1, Nk)
    return g


def sinkhorn_weights(q, k, *, attn_mask=None, scale, n_iters=3, eps=1.0, cost="l2", softcap=None):
    """The non-causal transport plan P (B, H, Nq, Nk), rows summing to one (for tests/analysis)."""
    keep, bias = split_mask(attn_mask, False, q.shape[-2], k.shape[-2], q.device)
    L = cap_logits(sinkhorn_logits(q, k, scale=scale, eps=eps, cost=cost), softcap)
    if bias is not None:
        L = L + bias.to(L.dtype)
    g = sinkhorn_potential(L, keep, n_iters)
    return masked_softmax(L + g, keep)


def sinkhorn_attention(q, k, v, *, attn_mask=None, is_causal=False, scale, n_iters=3, eps=1.0,
                       cost="l2", dropout_p=0.0, softcap=None):
    (q, k, v), out_dtype = upcast(q, k, v)
    if not is_causal:
        p = sinkhorn_weights(q, k, attn_mask=attn_mask, scale=scale, n_iters=n_iters, eps=eps, cost=cost,
                             softcap=softcap)
        return (weights_dropout(p, dropout_p) @ v).to(out_dtype)
    nq, nk = q.shape[-2], k.shape[-2]
    row_mask = coupled_causal_rows(attn_mask, nq, nk)
    rows = []
    for i in range(nq):
        m = i + nk - nq + 1  # keys visible to query i
        if m <= 0:  # no key visible: a zero row, as for every empty row
            rows.append(v.new_zeros(*v.shape[:-2], 1, v.shape[-1]))
            continue
        # row i's problem: queries 0..i and the keys it sees, non-causal, under the rule's mask
        p = sinkhorn_weights(q[..., :i + 1, :], k[..., :m, :], attn_mask=row_mask(i), scale=scale,
                             n_iters=n_iters, eps=eps, cost=cost, softcap=softcap)[..., -1:, :]
        rows.append(weights_dropout(p, dropout_p) @ v[..., :m, :])
    return torch.cat(rows, dim=-2).to(out_dtype)
