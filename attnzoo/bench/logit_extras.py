"""Benchmark rows for softcap, attention sinks and sliding windows (issue 29): a spec such as
``"softmax(softcap=30)"``, ``"softmax(sinks=True)"`` or ``"masked(window_size=(1023, 0))"`` is timed
with its extras in the call, and its baselines compute the same thing:

* SDPA with the same dense mask: the window as an (Nq, Nk) bool band (causality folded in), sinks as
  one more key with value 0 whose logit is the sink (a float mask column: q . 0 + sink). SDPA has no
  softcap (a cap is a function of the logit, not a term added to it): that row says so.
* FlexAttention with the same mods: the window as the block mask's mask_mod (its tiles outside the
  band skipped), softcap as a score_mod, sinks by log-sum-exp renormalisation of the output
  (out * sigmoid(lse - sink), as transformers' flex path applies them). CUDA only, as the plain rows.

Without this, a spec's layer-only extras were dropped from the timed call (the functional took the
kernel's arguments only) and a "softcap" row timed plain softmax against plain SDPA.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..ops import logit_extras
from .errors import Unsupported
from .extras_inputs import call_inputs, extras_of
from .problem import Problem, qkv
from .targets import Prepared, VariantSpec


def _band(spec: VariantSpec, problem: Problem, causal: bool) -> Optional[torch.Tensor]:
    """(Nq, Nk) bool: the window's band AND bottom-right causality, or None (neither)."""
    s = problem.shape
    window = logit_extras.check_window_size(extras_of(spec).get("window_size"))
    if window is None and not causal:
        return None
    if causal:
        window = (window[0] if window else -1, 0 if window is None or window[1] < 0 else min(window[1], 0))
    return logit_extras.window_keep(window, s.seq_q, s.nk, problem.device)


def sdpa(spec: VariantSpec, problem: Problem, label: str) -> Prepared:
    """F.scaled_dot_product_attention with the same dense mask (default dispatch)."""
    kw, leaves = call_inputs(spec, problem)
    if "softcap" in kw:
        raise Unsupported("SDPA cannot cap its logits (softcap is a function of the logit, not a term a mask "
                          "adds): no SDPA row computes the same attention")
    causal = spec.causal(problem.causal)
    q, k, v = qkv(problem)
    band = _band(spec, problem, causal)
    sinks = kw.get("sinks")
    s = problem.shape
    if sinks is not None:  # the sink: one more key and value of zeros (logit q . 0 = 0) plus the sink in the mask
        zeros = q.new_zeros(s.batch, s.heads, 1, s.head_dim).detach()
        rest = q.new_zeros(1, 1, s.seq_q, s.nk) if band is None else \
            q.new_zeros(1, 1, s.seq_q, s.nk).masked_fill(~band, -math.inf)
        rest = rest.expand(1, s.heads, s.seq_q, s.nk)

    def forward():
        if sinks is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=band)
        mask = torch.cat([sinks.to(q.dtype).view(1, -1, 1, 1).expand(1, s.heads, s.seq_q, 1), rest], -1)
        return F.scaled_dot_product_attention(q, torch.cat([zeros, k], -2), torch.cat([zeros, v], -2),
                                              attn_mask=mask)
    return Prepared(forward, [q, k, v, *leaves], label,
                    ("sdpa-extras", spec.label, problem.key(), causal), materialises=True)


def flex(spec: VariantSpec, problem: Problem, label: str, any_device: bool = False) -> Prepared:
    """FlexAttention with the window as mask_mod, softcap as score_mod, sinks by renormalisation.
    ``any_device``: build it on CPU too (a forward-only check; the benchmark rows are CUDA only)."""
    if problem.device.type != "cuda" and not any_device:
        raise Unsupported("FlexAttention is benchmarked on CUDA only (it has no backward on CPU)")
    from torch.nn.attention import flex_attention as flex_module
    from torch.nn.attention.flex_attention import create_block_mask

    from ..ops.kernels.flex import compiled_flex_attention, in_band
    kw, leaves = call_inputs(spec, problem)
    causal = spec.causal(problem.causal)
    q, k, v = qkv(problem)
    s = problem.shape
    shift = s.nk - s.seq_q
    window = logit_extras.check_window_size(kw.get("window_size"))
    left = -1 if window is None else window[0]
    right = 0 if causal else (-1 if window is None else window[1])
    if causal and window is not None and window[1] >= 0:
        right = min(window[1], 0)

    def mask_mod(b, h, qi, kj):
        return in_band(qi, kj, shift, left, right)  # bottom-right aligned, as attnzoo's windows
    block_mask = None
    if left >= 0 or right >= 0:
        block_mask = create_block_mask(mask_mod, None, None, s.seq_q, s.nk, device=problem.device)
    cap = kw.get("softcap")
    score_mod = None
    if cap:
        def score_mod(score, b, h, qi, kj):
            return cap * torch.tanh(score / cap)
    sinks = kw.get("sinks")
    compiled = compiled_flex_attention()
    # torch >= 2.9 asks for the log-sum-exp with return_aux=AuxRequest(lse=True), earlier with return_lse
    aux_request = getattr(flex_module, "AuxRequest", None)
    lse_kwargs = {"return_aux": aux_request(lse=True)} if aux_request is not None else {"return_lse": True}

    def forward():
        if sinks is None:
            return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
        out, aux = compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, **lse_kwargs)
        lse = aux.lse if aux_request is not None else aux
        # the sink joins the normaliser: weights exp(s - lse) become exp(s - logaddexp(lse, sink))
        return out * torch.sigmoid(lse - sinks.view(1, -1, 1)).unsqueeze(-1).to(out.dtype)
    return Prepared(forward, [q, k, v, *leaves], label, ("flex-extras", spec.label, problem.key(), causal))
