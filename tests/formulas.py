"""Float64 attention written straight from the papers' formulas, deliberately
without attnzoo's helpers (no log-domain tricks, explicit masks, loops where they are clearer),
so the library is checked against something it did not compute itself."""
from __future__ import annotations

import math

import torch


def allow_and_add(attn_mask, is_causal, B, H, nq, nk):
    """Full (B,H,nq,nk) bool 'takes part' matrix and float additive term from SDPA-style masks."""
    allow = torch.ones(B, H, nq, nk, dtype=torch.bool)
    add = torch.zeros(B, H, nq, nk, dtype=torch.float64)
    if attn_mask is not None:
        m = attn_mask.expand(B, H, nq, nk)
        if m.dtype == torch.bool:
            allow &= m
        else:
            allow &= m > -math.inf
            add = torch.where(m > -math.inf, m.double(), torch.zeros((), dtype=torch.float64))
    if is_causal:
        for i in range(nq):
            for j in range(nk):
                if j > i + (nk - nq):
                    allow[..., i, j] = False
    return allow, add


def _normalise_rows(w):
    s = w.sum(-1, keepdim=True)
    return torch.where(s > 0, w / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(w))


def _softmax_allowed(logits, allow):
    m = torch.where(allow, logits, torch.full_like(logits, -1e300)).amax(-1, keepdim=True).detach()
    # exp only of allowed entries: exp(logit + 1e300) on a row with no key would be inf, and its
    # gradient, though not selected, would turn into NaN through torch.where
    shifted = torch.where(allow, logits - m, torch.zeros_like(logits))
    w = torch.where(allow, torch.exp(shifted), torch.zeros_like(logits))
    return _normalise_rows(w)


def softmax(q, k, v, allow, add, scale):
    s = scale * torch.einsum("bhid,bhjd->bhij", q, k) + add
    return _softmax_allowed(s, allow) @ v


def l2(q, k, v, allow, add, scale):
    d2 = ((q[:, :, :, None, :] - k[:, :, None, :, :]) ** 2).sum(-1)
    return _softmax_allowed(-scale * d2 + add, allow) @ v


def sigmoid(q, k, v, allow, add, scale, bias=None):
    n = allow.sum(-1, keepdim=True).double()
    b = -torch.log(n.clamp_min(1)) if bias is None else bias
    s = scale * torch.einsum("bhid,bhjd->bhij", q, k) + add
    w = torch.where(allow, 1.0 / (1.0 + torch.exp(-(s + b))), torch.zeros_like(s))
    return w @ v


def relu(q, k, v, allow, add, scale):
    n = allow.sum(-1, keepdim=True).double().clamp_min(1)
    s = scale * torch.einsum("bhid,bhjd->bhij", q, k) + add
    w = torch.where(allow, torch.clamp(s, min=0), torch.zeros_like(s)) / n
    return w @ v


def linear(q, k, v, allow, add, feature_map="elu", scale=1.0):
    q = q * scale
    if feature_map == "identity":
        n = allow.sum(-1, keepdim=True).double().clamp_min(1)
        w = torch.einsum("bhid,bhjd->bhij", q, k) * torch.exp(add)
        return torch.where(allow, w, torch.zeros_like(w)) / n @ v
    phi = (lambda x: torch.where(x > 0, x + 1, torch.exp(x))) if feature_map == "elu" else (lambda x: x.clamp(min=0))
    w = torch.einsum("bhid,bhjd->bhij", phi(q), phi(k)) * torch.exp(add)
    w = torch.where(allow, w, torch.zeros_like(w))
    return (w @ v) / (w.sum(-1, keepdim=True) + 1e-6)


def sinkhorn_plan(L, allow, n_iters):
    """Plain (not log-domain) alternating normalisation of K = exp(L) on the allowed entries."""
    nq, nk = L.shape[-2], L.shape[-1]
    K = torch.where(allow, torch.exp(L - L.amax()), torch.zeros_like(L))
    for _ in range(n_iters):
        K = _normalise_rows(K)
        c = K.sum(-2, keepdim=True)
        K = torch.where(c > 0, K / torch.where(c > 0, c, torch.ones_like(c)) * (nq / nk), K)
    return _normalise_rows(K)


def causal_row_problem(allow, add, i):
    """Row i's problem of a variant that couples queries under is_causal=True and a mask (allow, add:
    (..., nq, nk)), as docs/usage.md states the rule: over queries 0..i and keys 0..i + nk - nq, the
    tokens row i sees (T_i) and their queries (and query i) take part, a pair (a, b) as the mask lets
    the later of the two positions see the earlier. Returns (allow_i, add_i) of shape (..., i + 1, last + 1)."""
    nq, nk = allow.shape[-2:]
    off = nk - nq
    last = i + off
    sees = allow[..., i, : last + 1]
    a_i = torch.zeros(allow.shape[:-2] + (i + 1, last + 1), dtype=torch.bool)
    d_i = torch.zeros(a_i.shape, dtype=add.dtype)
    for a in range(i + 1):
        pa = a + off  # query a's position among the keys
        if pa < 0:
            continue
        query_in = sees[..., pa] | (a == i)
        for b in range(last + 1):
            later, earlier = max(pa, b), min(pa, b)
            a_i[..., a, b] = allow[..., later - off, earlier] & sees[..., b] & query_in
            d_i[..., a, b] = add[..., later - off, earlier]
    return a_i, d_i


def sinkhorn(q, k, v, user_allow, add, scale, n_iters=3, eps=1.0, cost="l2", is_causal=False):
    """``user_allow`` is the attn_mask part only: causal Sinkhorn is Sinkhorn on every prefix
    (paper 002 eq 2.6), where inside the prefix of query i every query sees every prefix key; a mask
    shapes each prefix problem as ``causal_row_problem`` states."""
    if cost == "l2":
        L = -scale * ((q[:, :, :, None, :] - k[:, :, None, :, :]) ** 2).sum(-1) / (2 * eps)
    else:
        L = scale * torch.einsum("bhid,bhjd->bhij", q, k) / eps
    if not is_causal:
        return sinkhorn_plan(L + add, user_allow, n_iters) @ v
    nq, nk = L.shape[-2:]
    allow = torch.as_tensor(user_allow).expand(L.shape)
    add = torch.as_tensor(add, dtype=L.dtype).expand(L.shape)
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    for i in range(nq):
        last = i + nk - nq           # the prefix problem of query i: queries 0..i, keys 0..last
        if last < 0:
            continue
        allow_i, add_i = causal_row_problem(allow, add, i)
        P = sinkhorn_plan(L[..., : i + 1, : last + 1] + add_i, allow_i, n_iters)
        out[..., i, :] = (P[..., i:i + 1, :] @ v[..., : last + 1, :])[..., 0, :]
    return out


def fenchel_first(q, k, v, allow, add, scale, log_u=None, alpha=1.0):
    s = alpha * scale * torch.einsum("bhid,bhjd->bhij", q, k) + add
    if log_u is not None:
        s = s + log_u
    return _softmax_allowed(s, allow) @ v


def fenchel_second(q, k, v, allow, add, scale, log_u=None, alpha=1.0):
    B, H, nq, D = q.shape
    lu = add if log_u is None else add + log_u
    out = torch.zeros(B, H, nq, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                a = allow[b, h, i]
                if not a.any():
                    continue
                u = torch.softmax(lu[b, h, i][a], 0)
                t = k[b, h][a]
                mu = u @ t
                cov = (u[:, None] * (t - mu)).T @ (t - mu)
                z = scale * q[b, h, i]
                lam = alpha * torch.linalg.solve(torch.eye(D, dtype=torch.float64) + alpha * cov, z)
                p = torch.softmax(torch.log(u) + t @ lam, 0)
                out[b, h, i] = p @ v[b, h][a]
    return out


def ot(q, k, v, allow, add, scale, alpha=1.0, gamma=None, log_u=None, tk=None, tv=None):
    gamma = 1.0 / scale if gamma is None else gamma
    B, H, nq, _ = q.shape
    nk = k.shape[2]
    out = torch.zeros(B, H, nq, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                keys = [j for j in range(nk) if allow[b, h, i, j]]
                if not keys:
                    continue
                lu = torch.zeros(len(keys), dtype=torch.float64) if log_u is None else log_u[b, h, keys].double()
                u = torch.softmax(lu, 0)
                At = [k[b, h, t] for t in keys] + ([] if tk is None else list(tk[b, h]))
                Av = [v[b, h, t] for t in keys] + ([] if tv is None else list(tv[b, h]))
                extra_add = [add[b, h, i, t] for t in keys] + ([] if tk is None else [0.0] * tk.shape[2])
                At, Av = torch.stack(At), torch.stack(Av)
                extra_add = torch.tensor([float(x) for x in extra_add], dtype=torch.float64)
                for uj, j in zip(u, keys):
                    logits = (alpha * At @ q[b, h, i] + At @ k[b, h, j]) / gamma + extra_add
                    out[b, h, i] += uj * torch.softmax(logits, 0) @ Av
    return out


def t5_bucket(rel: int, num_buckets: int, max_distance: int, bidirectional: bool) -> int:
    """T5 (Raffel et al. 2020): the bucket of the offset rel = j - i: exact buckets for |offset| <
    max_exact, then log-spaced up to max_distance; bidirectional gives each sign half of the buckets,
    causal only counts j <= i."""
    base = 0
    if bidirectional:
        num_buckets //= 2
        base = num_buckets if rel > 0 else 0
        dist = abs(rel)
    else:
        dist = max(-rel, 0)
    max_exact = num_buckets // 2
    if dist < max_exact:
        return base + dist
    large = max_exact + int(math.log(dist / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return base + min(large, num_buckets - 1)
