"""The GPU correctness pass: every CUDA backend of every variant against the float64 reference on
the same inputs, outputs and every gradient, by FlashAttention's rule: the kernel's error is at most
twice the error of the eager reference run on the same low-precision inputs (its output rounded to
that dtype), plus a floor of one unit in the last place of the largest value."""
from __future__ import annotations

import time
import traceback

import torch

from attnzoo import functional as AF

from attnzoo.bench.speed_grid import cuda_backends

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
    return _verdict(got, low, want, ["out", "dq", "dk", "dv", "dlog_u"], dtype)


def check_t5(backend, shape, dtype, device) -> dict:
    """FenchelAttention's T5 preference on a fused path against the float64 eager reference."""
    from attnzoo.ops.fenchel import t5
    from attnzoo.ops.fenchel.t5_reference import t5_bias_attention_reference
    B, H, nq, nk, D, causal = shape
    q, k, v = _inputs(B, H, nq, nk, D, dtype, device, seed=11 + nq)
    table = torch.randn(32, H, dtype=torch.float64, device=device)
    cot = torch.randn(B, H, nq, D, dtype=torch.float64, device=device)
    args = dict(num_buckets=32, max_distance=128, bidirectional=not causal, is_causal=causal, scale=D ** -0.5)

    def run(fn, tensors, tab):
        leaves = [t.detach().clone().requires_grad_() for t in tensors + [tab]]
        out = fn(*leaves[:3], leaves[3])
        grads = torch.autograd.grad(out, leaves, cot.to(out.dtype))
        return [out.detach()] + list(grads)

    def fused(q, k, v, tab):
        bias = t5.T5Bias(tab, args["num_buckets"], args["max_distance"], args["bidirectional"])
        return AF.fenchel(q, k, v, is_causal=causal, scale=args["scale"], backend=backend, relative_bias=bias)

    def reference(q, k, v, tab):
        return t5_bias_attention_reference(q, k, v, tab, args["num_buckets"], args["max_distance"],
                                           args["bidirectional"], is_causal=causal, scale=args["scale"])
    got = run(fused, [q, k, v], table.float())
    want = run(reference, [t.double() for t in (q, k, v)], table)
    low = run(reference, [q, k, v], table.float())
    return _verdict(got, low, want, ["out", "dq", "dk", "dv", "dtable"], dtype)


def _verdict(got, low, want, names, dtype) -> dict:
    eps = torch.finfo(dtype).eps
    worst, detail = 0.0, {}
    for name, g, lo, w in zip(names, got, low, want):
        floor = (2e-5 if dtype == torch.float32 else eps) * max(1.0, float(w.abs().max()))
        bound = 2 * _err(lo, w) + floor
        ratio = _err(g, w) / bound if bound > 0 else 0.0
        if not torch.isfinite(g).all():
            ratio = float("inf")
        detail[name] = round(ratio, 3)
        worst = max(worst, ratio)
    return {"worst_ratio": worst, "ratios": detail, "ok": worst <= 1.0}


def cases(device, dtypes) -> list[tuple]:
    """(variant, spec, backend, shape, dtype) of every check, the T5 router as variant "fenchel_t5"."""
    out = []
    for variant, spec in VARIANTS + [("fenchel_t5", {})]:
        if variant == "fenchel_t5":
            backends = ["triton", "flex"] if device.type == "cuda" else ["triton"]
        else:
            backends = cuda_backends(variant) if device.type == "cuda" else ["reference"]
        for backend in backends:
            for shape in SHAPES:
                if variant == "ot" and shape[2] > 160:
                    continue  # OT's float64 reference is O(N^3) per head: the smaller shapes suffice
                for dtype in dtypes:
                    out.append((variant, spec, backend, shape, dtype))
    return out


def check_any(variant, spec, backend, shape, dtype, device) -> dict:
    if variant == "fenchel_t5":
        return check_t5(backend, shape, dtype, device)
    return check(variant, spec, backend, shape, dtype, device)


def nan_query(variant, spec, backend, device) -> dict:
    """A NaN in one query must reach that query's output row and no other (attnzoo's NaN rule); in
    Sinkhorn the column sums couple every row of the head, so there it reaches the whole head."""
    fn = AF.VARIANT_FUNCTIONS[variant]
    B, H, n, D = 1, 2, 64, 64
    q, k, v = _inputs(B, H, n, n, D, torch.bfloat16, device, seed=3)
    q[0, 1, 5, 7] = float("nan")
    kw = _kwargs(spec, B, H, n, torch.bfloat16, device)
    out = fn(q, k, v, backend=backend, **kw)
    row_nan = bool(torch.isnan(out[0, 1, 5]).all())
    others = torch.ones(n, dtype=torch.bool, device=device)
    others[5] = False
    head_coupled = variant == "sinkhorn"
    rest_finite = bool(torch.isfinite(out[0, 0]).all() and
                       (head_coupled or torch.isfinite(out[0, 1, others]).all()))
    return {"ok": row_nan and rest_finite, "row_nan": row_nan, "rest_finite": rest_finite}


def run(device, dtypes, deadline: float, log) -> list[dict]:
    rows = []
    if device.type == "cuda":
        for variant, spec in VARIANTS:
            for backend in cuda_backends(variant):
                row = {"variant": variant, "backend": backend, "check": "nan-query"}
                try:
                    row.update(nan_query(variant, spec, backend, device))
                except Exception as e:  # noqa: BLE001 - a failure is a result here
                    row.update({"ok": False, "error": f"{type(e).__name__}: {e}"[:300]})
                rows.append(row)
                log(f"nan-query {variant}/{backend}: {row}")
    for variant, spec, backend, shape, dtype in cases(device, dtypes):
        if time.time() > deadline:
            log(f"correctness: deadline reached before {variant}/{backend}")
            return rows
        row = {"variant": variant, "backend": backend, "shape": list(shape), "dtype": str(dtype)[6:]}
        try:
            row.update(check_any(variant, spec, backend, shape, dtype, device))
        except ValueError as e:  # the backend refuses this call: recorded with its reason
            row.update({"ok": None, "refused": str(e)[:200]})
        except Exception as e:  # noqa: BLE001 - a failure is a result here
            row.update({"ok": False, "error": f"{type(e).__name__}: {e}"[:300], "trace": traceback.format_exc()[-800:]})
        rows.append(row)
        log(f"correctness {variant}/{backend} {shape} {row['dtype']}: "
            f"{'ok' if row.get('ok') else row.get('refused') or row.get('error') or row.get('ratios')}")
    return rows
