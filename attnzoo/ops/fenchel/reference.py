"""Preference-weighted attention from the Fenchel dual (paper 004), eager reference.

Reading of the paper in attention terms: the templates are the keys t_j = k_j, the evidence for
query i is z_i = scale * q_i, the preference u_ij is proportional to exp(log_u_ij) over the keys
taking part (masks and a float attn_mask add to log_u), and the output is sum_j p_ij v_j where
p_ij is proportional to u_ij exp(<k_j, lambda_i>). lambda_i is
  first_order  (14)/(16): alpha z_i                       -> softmax(alpha s_ij + log u_ij)
  second_order (13):      alpha (I + alpha Sigma_i)^-1 z_i, Sigma_i = Cov_{u_i}(k)
  exact        (7):       argmax <lambda, mu_i + z_i> - |lambda|^2/(2 alpha) - log sum_j u_ij e^{<k_j, lambda>},
                          mu_i = E_{u_i}[k], by damped Newton (the dual is strictly concave with
                          Hessian -I/alpha - Cov_p(k)), gradients by the implicit function theorem.
"""
from __future__ import annotations

import math

import torch

from ..common import dot_logits, upcast, weights_dropout
from ..logit_extras import cap_logits, masked_softmax_with_sinks
from ..masking import masked_softmax, split_mask

SOLVES = ("first_order", "second_order", "exact")


def preference_log_weights(log_u, attn_mask, is_causal, q, k):
    """(keep, log_u_total): log_u plus the float mask, -inf entries moved into keep."""
    nq, nk = q.shape[-2], k.shape[-2]
    keep, bias = split_mask(attn_mask, is_causal, nq, nk, q.device)
    total = torch.zeros((), dtype=q.dtype, device=q.device)
    if log_u is not None:
        log_u = log_u.to(q.dtype)
        finite = log_u > -math.inf
        # no data-dependent branch: torch.compile traces this path (an all-True keep costs one bool tensor)
        keep = finite if keep is None else keep & finite
        total = total + torch.where(finite, log_u, torch.zeros((), dtype=q.dtype, device=q.device))
    if bias is not None:
        total = total + bias.to(q.dtype)
    return keep, total


def _normalised_u(keep, log_u, shape):
    return masked_softmax(log_u.expand(shape), keep)


def _second_order_lambda(u, k, z, alpha):
    mean = u @ k                                                     # (B,H,Nq,D)
    second = torch.einsum("bhij,bhjd,bhje->bhide", u, k, k)
    cov = second - mean.unsqueeze(-1) * mean.unsqueeze(-2)
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    lam = torch.linalg.solve(eye + alpha * cov, (alpha * z).unsqueeze(-1)).squeeze(-1)
    return lam, mean


def dual_objective(lam, mean_plus_z, log_u_full, keep, k, alpha):
    logits = log_u_full + lam @ k.transpose(-1, -2)
    if keep is not None:
        logits = logits.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return (lam * mean_plus_z).sum(-1) - (lam * lam).sum(-1) / (2 * alpha) - lse


def _newton_step(lam, mean_plus_z, log_u_full, keep, k, alpha):
    logits = log_u_full + lam @ k.transpose(-1, -2)
    p = masked_softmax(logits, keep)
    ep = p @ k
    grad = mean_plus_z - lam / alpha - ep
    second = torch.einsum("bhij,bhjd,bhje->bhide", p, k, k)
    cov = second - ep.unsqueeze(-1) * ep.unsqueeze(-2)
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    step = torch.linalg.solve(eye / alpha + cov, grad.unsqueeze(-1)).squeeze(-1)
    return step, grad


def solve_dual(log_u_full, keep, k, z, alpha, tol=1e-6, max_iter=100):
    """Exact lambda* of dual (7) per query, without autograd, in float64. Returns (lambda*, mu)."""
    with torch.no_grad():
        k64, z64, lu64 = k.double(), z.double(), log_u_full.double()
        u = masked_softmax(lu64, keep)
        lam, mean = _second_order_lambda(u, k64, z64, alpha)
        mpz = mean + z64
        for _ in range(max_iter):
            step, grad = _newton_step(lam, mpz, lu64, keep, k64, alpha)
            if float(grad.abs().max()) < tol:
                break
            t = torch.ones(lam.shape[:-1] + (1,), dtype=lam.dtype, device=lam.device)
            f0 = dual_objective(lam, mpz, lu64, keep, k64, alpha).unsqueeze(-1)
            for _ in range(30):  # backtracking: Newton on a concave function, halve until it ascends
                f1 = dual_objective(lam + t * step, mpz, lu64, keep, k64, alpha).unsqueeze(-1)
                bad = f1 < f0 - 1e-12 * f0.abs()
                if not bool(bad.any()):
                    break
                t = torch.where(bad, t / 2, t)
            lam = lam + t * step
    return lam.to(k.dtype)


def fenchel_lambda(q, k, *, log_u_full, keep, scale, alpha, solve):
    z = q * scale
    if solve == "first_order":
        return alpha * z
    u = _normalised_u(keep, log_u_full, q.shape[:-1] + (k.shape[-2],))
    if solve == "second_order":
        return _second_order_lambda(u, k, z, alpha)[0]
    lam = solve_dual(log_u_full.expand(u.shape), keep, k, z, alpha)
    # one Newton step taken with autograd at the fixed point: its value is lambda* (the step is
    # ~0) and its derivative is exactly the implicit-function-theorem derivative of lambda*.
    mean = u @ k
    step, _ = _newton_step(lam, mean + z, log_u_full.expand(u.shape), keep, k, alpha)
    return lam + step


def fenchel_attention(q, k, v, *, attn_mask=None, is_causal=False, scale, log_u=None, alpha=1.0,
                      solve="first_order", dropout_p=0.0, softcap=None, sinks=None):
    (q, k, v, log_u), out_dtype = upcast(q, k, v, log_u)
    keep, log_u_full = preference_log_weights(log_u, attn_mask, is_causal, q, k)
    if softcap is not None and solve != "first_order":
        # the dual's lambda* is solved for uncapped scores: capping them afterwards is no solution of it
        raise ValueError(f"fenchel: softcap is defined for solve='first_order' only, got solve={solve!r}")
    if solve == "first_order":
        # the cap acts on the score alpha s_ij; the preference log u plays the bias's part, added after
        logits = cap_logits(alpha * dot_logits(q, k, scale), softcap) + log_u_full
    else:
        lam = fenchel_lambda(q, k, log_u_full=log_u_full, keep=keep, scale=scale, alpha=alpha, solve=solve)
        logits = lam @ k.transpose(-1, -2) + log_u_full
    p = masked_softmax_with_sinks(logits, keep, sinks)
    return (weights_dropout(p, dropout_p) @ v).to(out_dtype)
