"""The GPU correctness pass: every CUDA backend of every variant against the float64 reference on
the same inputs, outputs and every gradient, by FlashAttention's rule: the kernel's error is at most
twice the error of the eager reference run on the same low-precision inputs (its output rounded to
that dtype), plus a floor of one unit in the last place of the largest value."""
from __future__ import annotations

import time
import traceback

import torch

import attnzoo.functional as AF

from .cases import cuda_backends

# awkward sizes: N not a multiple of any tile, Nq != Nk with bottom-right causal, a wide head
SHAPES = [  # (B, H, Nq, Nk, D, causal)
    (2, 3, 200, 200, 64, False),
    (2, 3, 150, 231, 64, True),
    (1, 2, 96, 96, 128, True),
]
VARIANTS = [
    ("softmax", {}),
    ("l2", {}),
    ("fenchel", {"log_u": "per-key"}),
    ("sigmoid", {}),
    ("relu", {}),
    ("sinkhorn", {"n_iters": 3}),
    ("linear", {}),
    ("ot", {}),
]


def _inputs(B, H, nq, nk, D, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (nq, nk, nk))
    return [t.to(dtype).to(device) for t in (q, k, v)]


def _kwargs(spec, B, H, nk, dtype, device):
    kw = dict(spec)
    if kw.get("log_u") == "per-key":
        g = torch.Generator(device="cpu").manual_seed(5)
        kw["log_u"] = torch.randn(B, H, 1, nk, generator=g, dtype=torch.float64).to(dtype).to(device)
    return kw


def _run(fn, tensors, kw, backend, cot):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    extra = {**kw}
    if "log_u" in extra:
        extra["log_u"] = leaves[3]
    out = fn(*leaves[:3], backend=backend, **extra)
    grads = torch.autograd.grad(out, leaves, cot.to(out.dtype), allow_unused=True)
    return [out.detach()] + [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves)]


def _err(a, b) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def check(variant, spec, backend, shape, dtype, device) -> dict:
    B, H, nq, nk, D, causal = shape
    fn = AF.VARIANT_FUNCTIONS[variant]
    q, k, v = _inputs(B, H, nq, nk, D, dtype, device, seed=sum(map(ord, variant)) + nq + D)
    kw = {**_kwargs(spec, B, H, nk, dtype, device), "is_causal": causal}
    tensors = [q, k, v] + ([kw["log_u"]] if "log_u" in kw else [])
    cot = torch.randn(B, H, nq, D, dtype=torch.float64, device=device)
    got = _run(fn, tensors, kw, backend, cot)
    want = _run(fn, [t.double() for t in tensors], kw, "reference", cot)
    low = _run(fn, tensors, kw, "reference", cot)
    eps = torch.finfo(dtype).eps
    worst = 0.0
    names = ["out", "dq", "dk", "dv", "dlog_u"]
    detail = {}
    for name, g, lo, w in zip(names, got, low, want):
        floor = (2e-5 if dtype == torch.float32 else eps) * max(1.0, float(w.abs().max()))
        bound = 2 * _err(lo, w) + floor
        ratio = _err(g, w) / bound if bound > 0 else 0.0
        if not torch.isfinite(g).all():
            ratio = float("inf")
        detail[name] = round(ratio, 3)
        worst = max(worst, ratio)
    return {"worst_ratio": worst, "ratios": detail, "ok": worst <= 1.0}


def run(device, dtypes, deadline: float, log) -> list[dict]:
    rows = []
    for variant, spec in VARIANTS:
        for backend in cuda_backends(variant) if device.type == "cuda" else ["reference"]:
            for shape in SHAPES:
                if variant == "ot" and shape[2] > 160:
                    continue  # OT's float64 reference is O(N^3) per head: the smaller shapes suffice
                for dtype in dtypes:
                    if time.time() > deadline:
                        log(f"correctness: deadline reached before {variant}/{backend}")
                        return rows
                    row = {"variant": variant, "backend": backend, "shape": list(shape), "dtype": str(dtype)[6:]}
                    try:
                        row.update(check(variant, spec, backend, shape, dtype, device))
                    except ValueError as e:  # the backend refuses this call: recorded with its reason
                        row.update({"ok": None, "refused": str(e)[:200]})
                    except Exception as e:  # noqa: BLE001 - a failure is a result here
                        row.update({"ok": False, "error": f"{type(e).__name__}: {e}"[:300],
                                    "trace": traceback.format_exc()[-800:]})
                    rows.append(row)
                    log(f"correctness {variant}/{backend} {shape} {row['dtype']}: "
                        f"{'ok' if row.get('ok') else row.get('refused') or row.get('error') or row.get('ratios')}")
    return rows
