"""torch (SDPA / FlexAttention) and CPU memory-efficient backends for softmax, l2, fenchel, sigmoid and
relu register here (imported by attnzoo.functional after the references).

Backends (see docs/kernels_cpu_torch.md for the measurements behind the priorities):
  "torch"  F.scaled_dot_product_attention: softmax, l2 (one extra coordinate), fenchel first order
           (log u as an additive mask). Any device. Priority 25 for softmax (SDPA is the baseline
           every fused softmax kernel is measured against, so it also wins over Triton on CUDA) and
           15 for l2 / fenchel (below Triton's 20 on CUDA; on CPU above the blockwise path).
  "cpu"    blockwise PyTorch with recomputation in the backward (ops/blockwise.py): all five
           variants, no (Nq, Nk) tensor per head. Priority 10, picked by auto on CPU only. For
           sigmoid and relu the same path is also registered as "torch" (priority 9).
  "flex"   FlexAttention (CUDA only, compiled): l2 and fenchel. Priority 5 so auto picks it only when
           Triton and SDPA decline; untested here (no GPU in this project's CI).
  "reference" (priority 0) stays the ground truth, and auto keeps it for small calls where it was
  measured faster (SMALL_CALL_ELEMENTS).
"""
from __future__ import annotations

import torch

from . import dispatch
from .pointwise.cpu import relu_cpu, sigmoid_cpu
from .softmax.cpu import fenchel_cpu, l2_cpu, softmax_cpu
from .softmax.flex import fenchel_flex, flex_available, l2_flex
from .softmax.torch import fenchel_torch, l2_torch, softmax_torch

# Below this many scores per call (B * H * Nq * Nk) auto keeps the eager reference instead of the
# blockwise path. Measured (benchmarks/results/cpu/dispatch_crossover.json, fp32, fwd+bwd, 1 thread):
# at 2^22 scores (B=1, H=4, N=1024) blockwise sigmoid/relu were still 1.05-1.4x slower than the
# reference, at 2^23 (B=8, H=4, N=512) every variant was as fast or faster (0.5-0.96x), and from
# 2^24 on it is 2-4x faster with 10-40x less memory. SDPA ("torch") beat the reference at every size
# measured (16 <= N <= 1024), so it has no threshold.
SMALL_CALL_ELEMENTS = 2 ** 23


def _first_order_only(q, k, v, **kw):
    solve = kw.get("solve", "first_order")
    if solve != "first_order":
        return (f"solve={solve!r} needs per-query covariances of the keys (paper 004 eqs 13 / 7); only "
                f"solve='first_order' is a softmax with an additive bias")
    return None


def _no_dropout(q, k, v, **kw):
    if kw.get("dropout_p", 0.0) > 0:
        return ("dropout_p > 0 is not supported: the backward recomputes the weights block by block and "
                "would need each block's dropout mask; 'reference' supports it (and SDPA's 'torch' for "
                "softmax, l2 and fenchel)")
    return None


def _small_call(q, k, v, **kw):
    n = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    if n < SMALL_CALL_ELEMENTS:
        return (f"small call ({n} scores < {SMALL_CALL_ELEMENTS}): the reference was measured faster "
                f"here and its N x N weights are small")
    return None


def _sdpa_mask_grad(q, k, v, **kw):
    """(auto only) On CPU, SDPA's fused kernel gives no gradient for an additive mask: SDPA would use
    its math kernel (N x N weights), which the blockwise path avoids. Named explicitly, 'torch' runs."""
    if q.device.type != "cpu" or not torch.is_grad_enabled():
        return None
    for name in ("attn_mask", "log_u"):
        t = kw.get(name)
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return (f"{name} requires grad and on CPU SDPA has no fused kernel with a mask gradient (its math "
                    f"kernel would build the N x N weights); 'cpu' computes it blockwise")
    return None


def _all(*checks):
    def supports(q, k, v, **kw):
        for check in checks:
            why = check(q, k, v, **kw)
            if why is not None:
                return why
        return None
    return supports


def _cpu_supports(*extra):
    return _all(_no_dropout, *extra)


def _flex_supports(q, k, v, **kw):
    if q.device.type != "cuda":
        return "FlexAttention runs here on CUDA tensors only (it has no backward on CPU)"
    if not flex_available():
        return "torch.nn.attention.flex_attention is not available in this torch build"
    if kw.get("dropout_p", 0.0) > 0:
        return "FlexAttention has no dropout on the weights"
    return _first_order_only(q, k, v, **kw)


_CPU_DESC = "blockwise online softmax / pointwise weights with recomputation in backward, no N x N tensor"
_TORCH_DESC = "F.scaled_dot_product_attention with attnzoo's mask semantics"

dispatch.register_backend("softmax", "torch", softmax_torch, priority=25, description=_TORCH_DESC,
                          auto_prefers=_sdpa_mask_grad)
dispatch.register_backend("l2", "torch", l2_torch, priority=15, auto_prefers=_sdpa_mask_grad,
                          description=_TORCH_DESC + ", q and k augmented by one coordinate")
dispatch.register_backend("fenchel", "torch", fenchel_torch, supports=_first_order_only, priority=15,
                          auto_prefers=_sdpa_mask_grad, description=_TORCH_DESC + ", log u as an additive mask")

for _variant, _fn, _extra in (("softmax", softmax_cpu, ()), ("l2", l2_cpu, ()),
                              ("fenchel", fenchel_cpu, (_first_order_only,)),
                              ("sigmoid", sigmoid_cpu, ()), ("relu", relu_cpu, ())):
    dispatch.register_backend(_variant, "cpu", _fn, supports=_cpu_supports(*_extra), priority=10,
                              description=_CPU_DESC, auto_devices=("cpu",), auto_prefers=_small_call)

# The issue names the non-Triton path "torch" for every variant: for sigmoid and relu, where SDPA does
# not apply, "torch" is the same blockwise path as "cpu" (one priority lower, so auto shows "cpu").
for _variant, _fn in (("sigmoid", sigmoid_cpu), ("relu", relu_cpu)):
    dispatch.register_backend(_variant, "torch", _fn, supports=_cpu_supports(), priority=9,
                              description=_CPU_DESC + " (the 'cpu' path under the issue's name 'torch')",
                              auto_devices=("cpu",), auto_prefers=_small_call)

dispatch.register_backend("l2", "flex", l2_flex, supports=_flex_supports, priority=5,
                          description="FlexAttention with an L2 score_mod (CUDA)", auto_devices=("cuda",))
dispatch.register_backend("fenchel", "flex", fenchel_flex, supports=_flex_supports, priority=5,
                          description="FlexAttention with log u as a score_mod (CUDA)", auto_devices=("cuda",))
