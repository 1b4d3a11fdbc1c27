"""Every input the README, docs/usage.md and the docstrings promise, on every backend that accepts it,
against float64 math written from the formulas (tests/formulas.py) and, for attnzoo.MultiheadAttention,
against torch.nn.MultiheadAttention with the same weights.

What is probed: masks of every broadcastable shape (key-axis broadcasts (Nq, 1), (B, 1, Nq, 1),
(B, H, Nq, 1) included; 1-, 2-, 3- and 4-D; expanded, stride-0 views) combined with ``is_causal``
(bottom-right aligned, Nq < Nk and Nq > Nk, where leading rows keep no key); non-contiguous q, k, v
(the (B, N, H, D) -> (B, H, N, D) transpose a layer makes); Dv != D; Nq = 1; an explicit ``scale``;
each variant's own options (Sinkhorn n_iters / eps / cost, sigmoid's scalar and tensor bias, linear's
feature maps, Fenchel's log_u / alpha / solve, OT's log_u / alpha / gamma / templates); fp64 and
half-precision inputs; the timm-style layers with 2-D / 3-D / 4-D masks; attnzoo.create spec strings;
and nn.MultiheadAttention's arguments. A backend that declines a call must say why (ValueError
"cannot run this"); one that accepts it must be right.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import attnzoo
import attnzoo.functional as AF
from attnzoo.ops import dispatch
from tests import formulas as R
from tests.common import INTERPRET, KERNEL_DEVICE, ON_GPU, seeded
from tests.flash_rule import assert_flash_rule, flash_rule_failures, reference_or_rounded, scale_grad
from tests.test_external_references import sinkformers_plan

pytestmark = pytest.mark.usefixtures("one_thread")

B, H, D, DV = 2, 2, 4, 3


def backends_of(variant: str) -> list[str]:
    """Every registered backend plus auto; Triton ones only where they run (interpreter or GPU);
    flex is CUDA-only FlexAttention."""
    out = []
    for name in dispatch.backends(variant) + ["auto"]:
        if name == "flex":
            continue
        if name.startswith("triton") and not (INTERPRET or ON_GPU):
            continue
        out.append(name)
    return out


def is_triton(backend: str) -> bool:
    return backend.startswith("triton")


# --- float64 formulas, one per variant, with every option ---------------------------------------------

def expected(variant, q, k, v, mask, is_causal, scale, opts):
    """The float64 formula of ``variant`` (q, k, v float64 leaves)."""
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    allow, add = R.allow_and_add(mask, is_causal, b, h, nq, nk)
    if variant == "linear":
        s = 1.0 if scale is None else scale
        return R.linear(q, k, v, allow, add, opts.get("feature_map", "elu"), s)
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    if variant == "softmax":
        return R.softmax(q, k, v, allow, add, s)
    if variant == "l2":
        return R.l2(q, k, v, allow, add, s)
    if variant == "relu":
        return R.relu(q, k, v, allow, add, s)
    if variant == "sigmoid":
        bias = opts.get("bias")
        if isinstance(bias, torch.Tensor):  # -inf: weight 0 (kept out of the arithmetic, whose gradient is NaN)
            bias = bias.double().expand(b, h, nq, nk)
            allow = allow & (bias > -math.inf)
            bias = torch.where(allow, bias, torch.zeros((), dtype=torch.float64))
        return R.sigmoid(q, k, v, allow, add, s, bias=bias)
    if variant == "sinkhorn":
        user_allow, _ = R.allow_and_add(mask, False, b, h, nq, nk)
        return R.sinkhorn(q, k, v, user_allow, add, s, opts.get("n_iters", 3), opts.get("eps", 1.0),
                          opts.get("cost", "l2"), is_causal)
    if variant == "fenchel":
        log_u = opts.get("log_u")
        if log_u is not None:
            log_u = log_u.double().expand(b, h, nq, nk)
        alpha = opts.get("alpha", 1.0)
        if opts.get("solve", "first_order") == "second_order":
            return R.fenchel_second(q, k, v, allow, add, s, log_u, alpha)
        return R.fenchel_first(q, k, v, allow, add, s, log_u, alpha)
    if variant == "ot":
        log_u = opts.get("log_u")
        if log_u is not None:
            log_u = log_u.double().expand(b, h, nk)
        tk, tv = opts.get("templates_k"), opts.get("templates_v")
        return R.ot(q, k, v, allow, add, s, opts.get("alpha", 1.0), opts.get("gamma"), log_u,
                    None if tk is None else tk.double(), None if tv is None else tv.double())
    raise AssertionError(variant)


def make_mask(shape, kind, g, nq, nk):
    """bool (True = take part) or float (``float_inf``: with -inf entries) of ``shape``; entries drawn
    so that some rows / keys are removed and at least one entry survives."""
    if shape is None:
        return None
    keep = torch.rand(shape, generator=g) < 0.7
    if keep.numel() > 1:
        keep.view(-1)[0], keep.view(-1)[-1] = True, False
    if kind == "bool":
        return keep
    m = torch.randn(shape, generator=g, dtype=torch.float64)
    return m.masked_fill(~keep, -math.inf) if kind == "float_inf" else m


def run_case(variant, backend, nq, nk, mask_shape, kind, is_causal, opts=None, scale=None, dv=DV,
             noncontig=False, expand_mask=False, grads=True, seed=0):
    """Compare one call (forward and, with ``grads``, q/k/v gradients) with the float64 formula."""
    opts = dict(opts or {})
    g = seeded(seed)
    q, k, v = (torch.randn(B, H, n, w, generator=g, dtype=torch.float64) for n, w in ((nq, D), (nk, D), (nk, dv)))
    mask = make_mask(mask_shape, kind, g, nq, nk)
    if expand_mask and mask is not None:
        mask = mask.expand(B, H, nq, nk)  # stride-0 view
    cot = torch.randn(B, H, nq, dv, generator=g, dtype=torch.float64)
    leaves64 = [t.clone().requires_grad_() for t in (q, k, v)]
    want = expected(variant, *leaves64, mask, is_causal, scale, opts)
    triton = is_triton(backend)
    dtype, device = (torch.float32, KERNEL_DEVICE) if triton else (torch.float64, "cpu")

    def prep(t):
        if noncontig:  # the layout a layer hands over: (B, N, H, D) transposed
            t = t.transpose(1, 2).contiguous().transpose(1, 2)
        return t.to(dtype).to(device).detach().requires_grad_()
    leaves = [prep(t) for t in (q, k, v)]
    if noncontig:
        assert not leaves[0].is_contiguous()
    m = None if mask is None else (mask.to(device) if mask.dtype == torch.bool else mask.to(dtype).to(device))
    kw = {n: (t.to(dtype).to(device) if isinstance(t, torch.Tensor) else t) for n, t in opts.items()}
    try:
        out = getattr(AF, variant)(*leaves, attn_mask=m, is_causal=is_causal, scale=scale, backend=backend, **kw)
    except ValueError as e:  # a backend may decline, saying why; auto and reference never decline
        assert backend not in ("auto", "reference"), f"{backend} refused a documented call: {e}"
        assert "cannot run this" in str(e), str(e)
        return None
    assert out.shape == want.shape and out.dtype == dtype, (out.shape, out.dtype)
    tol = dict(atol=1e-9, rtol=1e-9) if dtype == torch.float64 else dict(atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(out.double().cpu(), want.detach(), **tol)
    if grads:
        want_g = (torch.autograd.grad((want * cot).sum(), leaves64) if want.requires_grad
                  else [torch.zeros_like(t) for t in leaves64])  # every key masked: no graph, gradient 0
        got_g = torch.autograd.grad((out * cot.to(dtype).to(device)).sum(), leaves)
        gtol = tol if dtype == torch.float64 else dict(atol=5e-4, rtol=5e-4)
        for name, a, b in zip("qkv", got_g, want_g):
            torch.testing.assert_close(a.double().cpu(), b, **gtol, msg=lambda s, n=name: f"grad {n}: {s}")
    return out


# --- 1. masks broadcast along any axis, with and without causality, Nq != Nk ---------------------------

VARIANT_OPTS = {  # the options each variant runs with in the mask probes (non-default ones)
    "softmax": {}, "l2": {}, "relu": {},
    "sigmoid": {},
    "sinkhorn": {"n_iters": 2, "eps": 0.7},
    "linear": {"feature_map": "identity"},
    "fenchel": {"alpha": 0.8},
    "ot": {},
}

# (Nq, Nk): cross attention both ways; under is_causal with Nq > Nk the first Nq - Nk rows keep no key
SIZES = [(3, 5), (5, 3)]
KEY_BROADCAST = {  # shapes that broadcast along the key axis, and others SDPA's rule accepts
    "Nq,1": lambda nq, nk: (nq, 1),
    "B,1,Nq,1": lambda nq, nk: (B, 1, nq, 1),
    "B,H,Nq,1": lambda nq, nk: (B, H, nq, 1),
    "1,1": lambda nq, nk: (1, 1),
    "1,Nk": lambda nq, nk: (1, nk),
    "H,1,Nk": lambda nq, nk: (H, 1, nk),
    "H,Nq,Nk": lambda nq, nk: (H, nq, nk),
    "B,1,1,Nk": lambda nq, nk: (B, 1, 1, nk),
}


def mask_cases():
    cases = []
    for variant in VARIANT_OPTS:
        for backend in backends_of(variant):
            if is_triton(backend):  # the interpreter is slow: the key-axis broadcasts, causal, Nq > Nk
                combos = [("Nq,1", "float_inf", True, (5, 3)), ("B,H,Nq,1", "bool", True, (3, 5)),
                          ("H,1,Nk", "bool", False, (3, 5))]
            else:
                combos = [(s, kind, c, size) for s in KEY_BROADCAST for kind in ("bool", "float_inf")
                          for c in (False, True) for size in SIZES]
            cases += [(variant, backend, *c) for c in combos]
    return cases


MASK_CASES = mask_cases()


@pytest.mark.parametrize("variant,backend,shape,kind,causal,size", MASK_CASES,
                         ids=[f"{v}-{b}-{s}-{k}-{'causal' if c else 'full'}-{n[0]}x{n[1]}"
                              for v, b, s, k, c, n in MASK_CASES])
def test_broadcast_masks_with_causality(variant, backend, shape, kind, causal, size):
    nq, nk = size
    # an implicit Sinkhorn backward is the gradient of the converged plan, not of n_iters rounds:
    # forward only here, its gradient in test_sinkhorn_implicit_gradient_with_broadcast_masks
    grads = not backend.endswith("_implicit") and (not is_triton(backend) or shape == "Nq,1")
    run_case(variant, backend, nq, nk, KEY_BROADCAST[shape](nq, nk), kind, causal, VARIANT_OPTS[variant],
             grads=grads)


# --- 2. each variant's own options, layouts and scale -------------------------------------------------

def _t(shape, seed, fill_inf=False):
    t = torch.randn(shape, generator=seeded(seed), dtype=torch.float64)
    if fill_inf:
        t.view(-1)[1] = -math.inf
    return t


M = 2  # OT templates
OPTION_CASES = {  # name -> (variant, options, call settings)
    "sigmoid-scalar-bias": ("sigmoid", {"bias": -1.5}, {}),
    "sigmoid-tensor-bias-Nq,Nk-inf": ("sigmoid", {"bias": _t((5, 7), 1, fill_inf=True)}, {"mask": (7,)}),
    "sigmoid-tensor-bias-B,1,1,Nk": ("sigmoid", {"bias": _t((B, 1, 1, 7), 2)}, {"causal": True}),
    "sinkhorn-0-iters": ("sinkhorn", {"n_iters": 0}, {"mask": (5, 1)}),
    "sinkhorn-dot-eps": ("sinkhorn", {"n_iters": 1, "eps": 0.3, "cost": "dot"}, {"mask": (B, 1, 1, 7)}),
    "sinkhorn-dot-causal": ("sinkhorn", {"n_iters": 2, "cost": "dot"}, {"causal": True, "mask": (7,)}),
    "linear-elu-scale": ("linear", {"feature_map": "elu"}, {"scale": 0.5, "mask": (5, 7), "kind": "float"}),
    "linear-relu-causal": ("linear", {"feature_map": "relu"}, {"causal": True, "mask": (B, H, 5, 1)}),
    "linear-identity-causal": ("linear", {"feature_map": "identity"}, {"causal": True, "mask": (B, 1, 1, 7)}),
    "fenchel-log_u-Nk": ("fenchel", {"log_u": _t((7,), 3), "alpha": 1.7}, {"mask": (5, 1)}),
    "fenchel-log_u-full-inf": ("fenchel", {"log_u": _t((B, H, 5, 7), 4, fill_inf=True)}, {"causal": True}),
    "fenchel-second-order": ("fenchel", {"solve": "second_order", "alpha": 0.6, "log_u": _t((7,), 5)},
                             {"mask": (B, 1, 1, 7)}),
    "fenchel-second-order-causal": ("fenchel", {"solve": "second_order"}, {"causal": True, "mask": (5, 1)}),
    "ot-log_u-alpha-gamma": ("ot", {"log_u": _t((B, H, 7), 6), "alpha": 0.5, "gamma": 1.3}, {"mask": (5, 7)}),
    "ot-log_u-Nk-causal": ("ot", {"log_u": _t((7,), 7)}, {"causal": True, "mask": (B, H, 5, 1)}),
    "ot-templates": ("ot", {"templates_k": _t((B, H, M, D), 8), "templates_v": _t((B, H, M, DV), 9)},
                     {"mask": (B, 1, 1, 7), "causal": True}),
}
LAYOUT_CASES = {  # a layer's transposed q, k, v and a stride-0 mask; a decode step; an explicit scale
    "noncontig-expanded-mask": dict(noncontig=True, expand_mask=True, mask=(5, 7)),
    "decode-step-Dv6": dict(nq=1, dv=6, causal=True, mask=(7,)),
    "scale": dict(scale=0.37, mask=(H, 5, 7), kind="float"),
}


def option_cases():
    cases = []
    for name, (variant, _, _) in OPTION_CASES.items():
        cases += [(name, backend) for backend in backends_of(variant)]
    for name in LAYOUT_CASES:
        for variant in VARIANT_OPTS:
            cases += [(f"{variant}-{name}", backend) for backend in backends_of(variant)]
    return cases


OPT_CASES = option_cases()


@pytest.mark.parametrize("name,backend", OPT_CASES, ids=[f"{n}-{b}" for n, b in OPT_CASES])
def test_variant_options_and_layouts(name, backend):
    if name in OPTION_CASES:
        variant, opts, settings = OPTION_CASES[name]
    else:
        variant, layout = name.split("-", 1)
        opts, settings = VARIANT_OPTS[variant], LAYOUT_CASES[layout]
    settings = dict(settings)
    nq, dv = settings.pop("nq", 5), settings.pop("dv", DV)
    if variant == "ot" and "templates_k" in opts:
        dv = opts["templates_v"].shape[-1]
    grads = not backend.endswith("_implicit") and not (is_triton(backend) and name.endswith("-causal"))
    run_case(variant, backend, nq, 7, settings.pop("mask", None), settings.pop("kind", "bool"),
             settings.pop("causal", False), opts, dv=dv, grads=grads, **settings)


# --- 3. the timm-style layers: spec strings, 2-D / 3-D / 4-D masks, is_causal, hooks ------------------

DIM, HEADS, N = 8, 2, 5


def _t5_log_u(table, nq, nk, num_buckets, max_distance, bidirectional):
    """log u_ij = table[bucket(j - (i + nk - nq)), h] from T5's bucketing (tests/formulas.py)."""
    out = torch.zeros(1, table.shape[1], nq, nk, dtype=torch.float64)
    for i in range(nq):
        for j in range(nk):
            out[0, :, i, j] = table[R.t5_bucket(j - (i + nk - nq), num_buckets, max_distance, bidirectional)]
    return out


def layer_expected(layer, spec_variant, x, mask4, is_causal):
    """The layer's float64 output from its own weights and the formula: qkv projection, the formula,
    the output projection. ``mask4``: the mask as the kernel should read it (4-D)."""
    b = x.shape[0]
    qkv = nn.functional.linear(x, layer.qkv.weight, layer.qkv.bias).reshape(b, N, 3, HEADS, DIM // HEADS)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    opts, variant = {}, spec_variant
    if variant == "l2" and layer.tie_qk:
        k = q
    if variant == "masked":
        variant, is_causal = layer.kind, True
    if variant == "sinkhorn":
        opts = {"n_iters": layer.n_iters, "eps": layer.eps, "cost": layer.cost}
    if variant == "linear":
        opts = {"feature_map": layer.feature_map}
    if variant == "ot":
        opts = {"alpha": layer.alpha, "gamma": layer.gamma}
    if variant == "fenchel":
        opts = {"alpha": layer.alpha, "solve": layer.solve}
        if layer.relative_bias is not None:
            opts["log_u"] = _t5_log_u(layer.relative_bias.weight.detach(), N, N, layer.num_buckets,
                                      layer.max_distance, layer.bidirectional)
        elif layer.context_net is not None:
            opts["log_u"] = layer.context_net(x).transpose(1, 2).unsqueeze(2).detach()
    if variant == "sigmoid" and layer.bias_shift is not None:
        allow, _ = R.allow_and_add(mask4, is_causal, b, HEADS, N, N)
        n = allow.sum(-1, keepdim=True).double().clamp_min(1)
        opts = {"bias": -torch.log(n) + layer.bias_shift.detach().double().view(1, -1, 1, 1)}
    scale = None if variant == "linear" else layer.scale
    out = expected(variant, q, k, v, mask4, is_causal, scale, opts)
    out = out.transpose(1, 2).reshape(b, N, DIM)
    return nn.functional.linear(out, layer.proj.weight, layer.proj.bias)


LAYER_SPECS = ["softmax", "l2", "l2(tie_qk=True)", "sinkhorn(n_iters=2, eps=0.5, cost='dot')", "sigmoid",
               "sigmoid(learnable_bias=True)", "relu", "linear(feature_map='relu')", "fenchel(alpha=0.7)",
               "fenchel(preference='t5', num_buckets=8, max_distance=16)", "fenchel(preference='context')",
               "fenchel(solve='second_order')", "ot(alpha=0.5)", "masked(kind='sigmoid')", "masked(kind='sinkhorn')"]


def layer_masks(g):
    """The masks a timm / HF host hands a layer, each with the 4-D mask the kernel must read."""
    pad = torch.tensor([[True] * N, [True] * 3 + [False] * (N - 3)])
    full3 = torch.randn(B, N, N, generator=g, dtype=torch.float64).masked_fill(torch.rand(B, N, N, generator=g) < 0.3,
                                                                              -math.inf)
    two = torch.rand(N, N, generator=g) < 0.7
    return {
        "none": (None, None),
        "N,N-bool": (two, two),
        "B,N,N-float": (full3, full3[:, None]),            # (B, N, N): batch first, broadcast over heads
        "B,1,N-padding": (pad[:, None, :], pad[:, None, None, :]),
        "B,1,1,N-padding": (pad[:, None, None, :], pad[:, None, None, :]),
        "B,H,N,N-bool": (torch.rand(B, HEADS, N, N, generator=g) < 0.7,) * 2,
    }


LAYER_CASES = [(spec, m, c) for spec in LAYER_SPECS for m in ("none", "N,N-bool", "B,N,N-float", "B,1,N-padding",
                                                              "B,1,1,N-padding", "B,H,N,N-bool")
               for c in (False, True)]


@pytest.mark.parametrize("spec,mask_name,causal", LAYER_CASES, ids=[f"{s}-{m}-{c}" for s, m, c in LAYER_CASES])
def test_layers_match_the_formula(spec, mask_name, causal):
    torch.manual_seed(0)
    layer = attnzoo.create(spec, DIM, num_heads=HEADS, qkv_bias=True, dtype=torch.float64).eval()
    with torch.no_grad():  # hooks' parameters start at zero (uniform preference, no shift): make them matter
        for name, p in layer.named_parameters():
            if name.startswith(("relative_bias", "context_net", "bias_shift")):
                p.normal_(0, 0.5)
    g = seeded(3)
    x = torch.randn(B, N, DIM, generator=g, dtype=torch.float64)
    mask, mask4 = layer_masks(g)[mask_name]
    out = layer(x, attn_mask=mask, is_causal=causal)
    want = layer_expected(layer, attnzoo.registry.parse_spec(spec)[0], x, mask4, causal)
    torch.testing.assert_close(out, want, atol=1e-9, rtol=1e-9)


# --- 4. attnzoo.MultiheadAttention against torch.nn.MultiheadAttention ---------------------------------

E_MHA, H_MHA, L_MHA, S_MHA = 6, 2, 4, 5


def _mha_pair(batch_first, kdim, vdim, bias):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E_MHA, H_MHA, bias=bias, batch_first=batch_first, kdim=kdim, vdim=vdim,
                                dtype=torch.float64)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.4)
    ours = attnzoo.MultiheadAttention(E_MHA, H_MHA, bias=bias, batch_first=batch_first, kdim=kdim, vdim=vdim,
                                      dtype=torch.float64)
    ours.load_state_dict(ref.state_dict())
    return ref.eval(), ours.eval()


def _mha_masks(kind, g, L, S):
    """torch-MHA masks (bool True = masked out, float added) that leave every row some key."""
    if kind is None:
        return None, None
    hide = torch.rand(B * H_MHA, L, S, generator=g) < 0.3
    hide[..., 0] = False
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, -2:] = True
    two, three = hide[0], hide
    if kind == "bool":
        return two, pad
    if kind == "float":
        return (torch.randn(L, S, generator=g, dtype=torch.float64).masked_fill(two, -math.inf),
                torch.zeros(B, S, dtype=torch.float64).masked_fill(pad, -math.inf))
    if kind == "bool3-floatpad":
        return three, torch.randn(B, S, generator=g, dtype=torch.float64).masked_fill(pad, -math.inf)
    if kind == "float3-boolpad":
        return torch.randn(B * H_MHA, L, S, generator=g, dtype=torch.float64).masked_fill(three, -math.inf), pad
    raise AssertionError(kind)


MHA_CASES = [(bf, cross, bias, masks, which)
             for bf in (False, True) for cross in (False, True) for bias in (True, False)
             for masks in (None, "bool", "float", "bool3-floatpad", "float3-boolpad")
             for which in (("attn", "pad", "both") if masks else ("none",))]


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning")  # torch, mixed mask dtypes
@pytest.mark.parametrize("batch_first,cross,bias,masks,which", MHA_CASES,
                         ids=[f"bf{int(a)}-{'cross' if c else 'self'}-bias{int(b)}-{m}-{w}" for a, c, b, m, w in MHA_CASES])
def test_multihead_matches_torch(batch_first, cross, bias, masks, which):
    kdim, vdim = (3, 5) if cross else (None, None)
    ref, ours = _mha_pair(batch_first, kdim, vdim, bias)
    g = seeded(4)
    S = S_MHA if cross else L_MHA
    def make(n, w):
        return torch.randn((B, n, w) if batch_first else (n, B, w), generator=g, dtype=torch.float64)
    q = make(L_MHA, E_MHA)
    k, v = (make(S, kdim), make(S, vdim)) if cross else (q, q)
    attn_mask, pad = _mha_masks(masks, g, L_MHA, S)
    kw = {"attn_mask": attn_mask if which in ("attn", "both") else None,
          "key_padding_mask": pad if which in ("pad", "both") else None}
    for need_weights in (True, False):
        for average in (True, False):
            a = ref(q, k, v, need_weights=need_weights, average_attn_weights=average, **kw)
            b = ours(q, k, v, need_weights=need_weights, average_attn_weights=average, **kw)
            torch.testing.assert_close(b[0], a[0], atol=1e-10, rtol=1e-9)
            if need_weights:
                torch.testing.assert_close(b[1], a[1], atol=1e-10, rtol=1e-9)
            else:
                assert b[1] is None


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64])
@pytest.mark.parametrize("batch_first", [False, True])
def test_multihead_causal_hint_matches_torch(mask_dtype, batch_first):
    """is_causal=True with the exact causal mask (torch's documented use) gives torch's result."""
    ref, ours = _mha_pair(batch_first, None, None, True)
    x = torch.randn((B, L_MHA, E_MHA) if batch_first else (L_MHA, B, E_MHA), generator=seeded(5), dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(L_MHA, dtype=torch.float64)
    if mask_dtype == torch.bool:
        mask = mask == -math.inf
    pad = torch.zeros(B, L_MHA, dtype=torch.bool)
    pad[0, -1] = True
    for kpm in (None, pad):
        a = ref(x, x, x, attn_mask=mask, key_padding_mask=kpm, is_causal=True, need_weights=False)[0]
        b = ours(x, x, x, attn_mask=mask, key_padding_mask=kpm, is_causal=True, need_weights=False)[0]
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-9)


def test_multihead_kinds_follow_their_formula():
    """kind= and its options reach the kernel: the output is out_proj(formula(projections))."""
    torch.manual_seed(0)
    for kind, kw in (("sigmoid", {}), ("sinkhorn", {"n_iters": 2}), ("linear", {"feature_map": "identity"}),
                     ("relu", {})):
        m = attnzoo.MultiheadAttention(E_MHA, H_MHA, batch_first=True, kind=kind, dtype=torch.float64, **kw).eval()
        x = torch.randn(B, L_MHA, E_MHA, dtype=torch.float64)
        pad = torch.zeros(B, L_MHA, dtype=torch.bool)
        pad[1, -1] = True
        out, w = m(x, x, x, key_padding_mask=pad, average_attn_weights=False)
        q, k, v = (t.reshape(B, L_MHA, H_MHA, -1).transpose(1, 2)
                   for t in nn.functional.linear(x, m.in_proj_weight, m.in_proj_bias).chunk(3, -1))
        want = expected(kind, q, k, v, (~pad)[:, None, None, :], False, None, kw)
        torch.testing.assert_close(out, m.out_proj(want.transpose(1, 2).reshape(B, L_MHA, E_MHA)), atol=1e-10, rtol=1e-9)
        eye = torch.eye(L_MHA, dtype=torch.float64).expand(B, H_MHA, L_MHA, L_MHA)
        torch.testing.assert_close(w, expected(kind, q, k, eye, (~pad)[:, None, None, :], False, None, kw),
                                   atol=1e-10, rtol=1e-9)


# --- 5. Sinkformers, implicit gradients, half precision, shape fuzzing ---------------------------------

def sinkformers_attention(q, k, v, max_iter, eps=1.0):
    """Sinkformers' SinkhornDistance (Sander et al. 2022) as their code runs it, on s = scale q.k:
    tests/test_external_references.sinkformers_plan (their dual-potential half-steps, the plan
    scaled by Nk, so rows sum to ~1 for Nq = Nk), applied to v."""
    s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
    return sinkformers_plan(s, max_iter, eps) @ v


@pytest.mark.parametrize("n_iters", [1, 3])
@pytest.mark.parametrize("nq,nk", [(5, 5), (3, 6)])
def test_sinkformers_mapping(n_iters, nq, nk):
    """README: Sinkformers' max_iter = 2 n_iters + 1 with cost="dot"; their rows sum to Nk/Nq, so
    attnzoo's output times Nk/Nq is theirs (equal for Nq = Nk)."""
    g = seeded(6)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (nq, nk, nk))
    theirs = sinkformers_attention(q, k, v, 2 * n_iters + 1, eps=0.8)
    for backend in backends_of("sinkhorn"):
        if is_triton(backend):
            continue
        ours = AF.sinkhorn(q, k, v, n_iters=n_iters, eps=0.8, cost="dot", backend=backend)
        torch.testing.assert_close(ours * nk / nq, theirs, atol=1e-9, rtol=1e-9)


IMPLICIT = [b for b in backends_of("sinkhorn") if b.endswith("_implicit")]


@pytest.mark.parametrize("backend", IMPLICIT)
@pytest.mark.parametrize("shape,causal", [((5, 1), True), ((5, 7), False), ((B, H, 5, 7), False)])
def test_sinkhorn_implicit_gradient_with_masks(backend, shape, causal):
    """Near the fixed point (eps = 2, 30 rounds) the implicit gradient equals the unrolled formula's,
    for masks that leave every row and column of each problem an entry (causal: a mask removing nothing)."""
    g = seeded(0)
    q, k, v = (torch.randn(B, H, n, w, generator=g, dtype=torch.float64) for n, w in ((5, D), (7, D), (7, DV)))
    mask = torch.rand(shape, generator=g) < 0.7
    if causal:
        mask[:] = True
    else:
        mask[..., 0, :] = True
        mask[..., :, 0] = True
    dtype, device = (torch.float32, KERNEL_DEVICE) if is_triton(backend) else (torch.float64, "cpu")
    leaves = [t.to(dtype).to(device).requires_grad_() for t in (q, k, v)]
    got = AF.sinkhorn(*leaves, attn_mask=mask.to(device), is_causal=causal, n_iters=30, eps=2.0, backend=backend)
    want_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = expected("sinkhorn", *want_leaves, mask, causal, None, {"n_iters": 30, "eps": 2.0})
    # 30 rounds leave ~1e-7 of the fixed point with partial masks: what separates the two gradients
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float64 else dict(atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(got.double().cpu(), want.detach(), **tol)
    for a, b_ in zip(torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), want_leaves)):
        torch.testing.assert_close(a.double().cpu(), b_, **tol)


@pytest.mark.parametrize("backend", IMPLICIT)
@pytest.mark.parametrize("shape,causal", [((B, 1, 1, 7), False), ((5, 1), False), ((5, 7), True)])
def test_sinkhorn_implicit_refuses_masks_its_gradient_gets_wrong(backend, shape, causal):
    """Key padding, a fully masked query row, or any removed entry under is_causal (a prefix problem
    with a key column left empty) break the fixed-point identity the implicit backward relies on: the
    forward converges but the gradient would be wrong (tens of percent), so the backend says why."""
    q, k, v = (torch.randn(B, H, n, D, device=KERNEL_DEVICE) for n in (5, 7, 7))
    mask = torch.ones(shape, dtype=torch.bool)
    mask.view(-1)[-1] = False
    with pytest.raises(ValueError, match="implicit gradient needs every query row and key column"):
        AF.sinkhorn(q, k, v, attn_mask=mask.to(KERNEL_DEVICE), is_causal=causal, backend=backend)


HALF_CASES = [(var, be, dt) for var in VARIANT_OPTS for be in backends_of(var)
              if not is_triton(be) and not be.endswith("_implicit") for dt in (torch.bfloat16, torch.float16)]


def half_triples(variant, backend, dtype, perturb=None):
    """(name, ``backend`` on half inputs, the reference backend on the same inputs (or the float64
    result stored in ``dtype`` where ``backend`` runs the reference itself), the float64 formula on
    those inputs) for the output and dq, dk, dv. ``perturb``: (q, k, v) -> (q, k, v), made wrong on purpose."""
    g = seeded(8)
    q, k, v = (torch.randn(B, H, n, w, generator=g, dtype=torch.float64) for n, w in ((5, D), (7, D), (7, DV)))
    cot = torch.randn(B, H, 5, DV, generator=g, dtype=torch.float64)
    q, k, v = (t.to(dtype).double() for t in (q, k, v))  # the half inputs, as float64 for the formula
    mask = torch.tensor([True] * 6 + [False])  # a key-padding mask every backend takes
    opts = VARIANT_OPTS[variant]

    def run(fn, to, tested=False):
        leaves = [t.to(to).requires_grad_() for t in (q, k, v)]
        out = fn(*(perturb(*leaves) if tested and perturb else leaves))
        return [out] + list(torch.autograd.grad((out.double() * cot).sum(), leaves))

    want = run(lambda *qkv: expected(variant, *qkv, mask, True, None, opts), torch.float64)
    got = run(lambda *qkv: getattr(AF, variant)(*qkv, attn_mask=mask, is_causal=True, backend=backend, **opts),
              dtype, tested=True)
    low = run(lambda *qkv: getattr(AF, variant)(*qkv, attn_mask=mask, is_causal=True, backend="reference", **opts),
              dtype)
    return list(zip(("out", "dq", "dk", "dv"), got, reference_or_rounded(got, low, want, dtype), want))


@pytest.mark.parametrize("variant,backend,dtype", HALF_CASES, ids=[f"{v}-{b}-{str(d)[6:]}" for v, b, d in HALF_CASES])
def test_half_precision_inputs(variant, backend, dtype):
    """Half inputs: fp32 accumulation, output in the input dtype, the output and every gradient within
    FlashAttention's rule (tests/flash_rule.py) against the same formula evaluated on the rounded inputs."""
    triples = half_triples(variant, backend, dtype)
    assert triples[0][1].dtype == dtype
    assert_flash_rule(f"{variant} {backend}", dtype, 1.0, triples)


@pytest.mark.parametrize("variant,backend,dtype,what,factor", [
    ("softmax", "torch", torch.bfloat16, "dq", 0.85), ("sinkhorn", "cpu", torch.float16, "dk", 0.95),
    ("ot", "reference", torch.bfloat16, "dv", 1.05), ("linear", "auto", torch.float16, "dq", 0.95)])
def test_half_precision_check_sees_a_scaled_gradient(variant, backend, dtype, what, factor):
    i = "qkv".index(what[1])
    triples = half_triples(variant, backend, dtype,
                           lambda *qkv: [scale_grad(t, factor) if j == i else t for j, t in enumerate(qkv)])
    assert any(f"{what} error" in f for f in flash_rule_failures(variant, dtype, 1.0, triples))


try:
    from hypothesis import given, settings, strategies as st
    HAVE_HYPOTHESIS = True
except ImportError:  # pragma: no cover
    HAVE_HYPOTHESIS = False


if HAVE_HYPOTHESIS:
    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(variant=st.sampled_from(sorted(VARIANT_OPTS)), nq=st.integers(1, 6), nk=st.integers(1, 6),
           dims=st.lists(st.booleans(), min_size=4, max_size=4), kind=st.sampled_from(["bool", "float_inf", "float"]),
           causal=st.booleans(), ndim=st.integers(1, 4))
    def test_fuzzed_mask_shapes_on_cpu_backends(variant, nq, nk, dims, kind, causal, ndim):
        """Any SDPA-broadcastable mask shape (each axis full or 1, 1 to 4 dims), any Nq / Nk, causal or
        not, on every non-Triton backend, against the formula."""
        full = (B, H, nq, nk)
        shape = tuple(s if keep else 1 for s, keep in zip(full, dims))[4 - ndim:]
        for backend in backends_of(variant):
            if not is_triton(backend):
                run_case(variant, backend, nq, nk, shape, kind, causal, VARIANT_OPTS[variant],
                         grads=not backend.endswith("_implicit"))


# --- 6. bad input: a clear error naming the argument --------------------------------------------------

def _qkv_small():
    return [torch.randn(2, 2, n, 4) for n in (3, 5, 5)]


def _mha(**kw):
    return attnzoo.MultiheadAttention(8, 2, **kw)


def _mha_call(**kw):
    x = torch.randn(5, 2, 8)
    return _mha()(x, x, x, **kw)


BAD_INPUTS = [  # (what the message must name, exception type, call)
    ("attn_mask", ValueError, lambda q, k, v: AF.softmax(q, k, v, attn_mask=torch.ones(3, 4, dtype=torch.bool))),
    ("attn_mask", TypeError, lambda q, k, v: AF.relu(q, k, v, attn_mask=torch.ones(3, 5, dtype=torch.int64))),
    ("bias must be a float tensor", TypeError, lambda q, k, v: AF.sigmoid(q, k, v, bias=torch.ones(5, dtype=torch.int64))),
    ("log_u must be a float tensor", TypeError, lambda q, k, v: AF.fenchel(q, k, v, log_u=torch.ones(5, dtype=torch.bool))),
    ("n_iters", ValueError, lambda q, k, v: AF.sinkhorn(q, k, v, n_iters=2.0)),
    ("templates_k", ValueError, lambda q, k, v: AF.ot(q, k, v, templates_k=torch.ones(2, 2, 1, 4))),
    ("is_causal", TypeError, lambda q, k, v: AF.l2(q, k, v, is_causal="yes")),
    ("learnable_bias", TypeError, lambda q, k, v: attnzoo.create("sigmoid(learnable_bias='no')", 8, 2)),
    ("tie_qk", TypeError, lambda q, k, v: attnzoo.create("l2(tie_qk='no')", 8, 2)),
    ("num_buckets", ValueError, lambda q, k, v: attnzoo.create("fenchel(preference='t5', num_buckets=2)", 8, 2)),
    ("max_distance", ValueError, lambda q, k, v: attnzoo.create("fenchel(preference='t5', max_distance=8)", 8, 2)),
    ("bidirectional", TypeError,
     lambda q, k, v: attnzoo.create("fenchel(preference='t5', bidirectional='no')", 8, 2)),
    ("context_hidden", ValueError, lambda q, k, v: attnzoo.create("fenchel(preference='context', context_hidden=0)", 8, 2)),
    ("key_padding_mask", TypeError, lambda q, k, v: _mha_call(key_padding_mask=torch.ones(2, 5, dtype=torch.int64))),
    ("attn_mask", TypeError, lambda q, k, v: _mha_call(attn_mask=torch.zeros(5, 5, dtype=torch.int64))),
    ("n_iter", TypeError, lambda q, k, v: _mha(kind="sinkhorn", n_iter=3)),
    ("n_iters", ValueError, lambda q, k, v: _mha(kind="sinkhorn", n_iters=-3)),
    ("dropout", ValueError, lambda q, k, v: _mha(dropout=1.5)),
    ("nested tensors", NotImplementedError, lambda q, k, v: _mha()(*[torch.nested.nested_tensor(
        [torch.randn(3, 8), torch.randn(5, 8)])] * 3)),
]


@pytest.mark.parametrize("name,exc,call", BAD_INPUTS, ids=[f"{i}-{b[0].split()[0]}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(name, exc, call):
    with pytest.raises(exc, match=name):
        call(*_qkv_small())


def test_layer_hook_parameters_follow_the_layers_dtype():
    """device=/dtype= of the constructor reach the parameters a variant adds (sigmoid's bias_shift,
    Fenchel's T5 table and context MLP), as they reach qkv and proj."""
    for spec in ("sigmoid(learnable_bias=True)", "fenchel(preference='t5')", "fenchel(preference='context')"):
        layer = attnzoo.create(spec, 8, num_heads=2, dtype=torch.float64)
        assert {p.dtype for p in layer.parameters()} == {torch.float64}, spec
        assert layer(torch.randn(2, 3, 8, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize("num_buckets,max_distance,bidirectional", [(4, 3, True), (2, 2, False), (32, 9, True)])
def test_smallest_t5_bucketings_run(num_buckets, max_distance, bidirectional):
    """The smallest bucketings the check lets through run and match the formula's buckets."""
    layer = attnzoo.create(f"fenchel(preference='t5', num_buckets={num_buckets}, max_distance={max_distance}, "
                           f"bidirectional={bidirectional})", DIM, num_heads=HEADS, dtype=torch.float64).eval()
    with torch.no_grad():
        layer.relative_bias.weight.normal_()
    x = torch.randn(B, N, DIM, dtype=torch.float64)
    torch.testing.assert_close(layer(x), layer_expected(layer, "fenchel", x, None, False), atol=1e-9, rtol=1e-9)


# --- grouped-query attention: k and v with fewer heads than q (enable_gqa=True) ----------------------------

GQA_HEADS, GQA_KV_HEADS = 4, 2  # two query heads share each key/value head


def gqa_cases():
    cases = []
    for variant in VARIANT_OPTS:
        for backend in backends_of(variant):
            if backend == "triton_implicit":  # 30 rounds under the interpreter: one case
                combos = [(None, False)]
            elif is_triton(backend):
                combos = [(None, True), ("heads", False)]
            else:
                combos = [(None, False), (None, True), ("heads", False), ("keys", True)]
            cases += [(variant, backend, mask, causal) for mask, causal in combos]
    return cases


GQA_CASES = gqa_cases()


@pytest.mark.parametrize("variant,backend,mask_kind,causal", GQA_CASES,
                         ids=[f"{v}-{b}-{m or 'nomask'}-{'causal' if c else 'full'}" for v, b, m, c in GQA_CASES])
def test_grouped_query_heads(variant, backend, mask_kind, causal):
    """enable_gqa=True: query head h reads key/value head h // (H / H_kv) (SDPA's convention), so the
    output is the formula on k, v with each head repeated for its group, and dk, dv sum the group's
    gradients. Backends that index the shared head (SDPA, the Triton softmax and pointwise kernels)
    and those that get k, v expanded by the call path must agree with it alike."""
    g = seeded(7)
    nq, nk = 5, 6
    q = torch.randn(B, GQA_HEADS, nq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, GQA_KV_HEADS, nk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, GQA_KV_HEADS, nk, DV, generator=g, dtype=torch.float64)
    mask = None
    if mask_kind == "heads":  # differs per query head, so sharing k, v must not share the mask
        mask = torch.rand(GQA_HEADS, nq, nk, generator=g) < 0.7
        mask[..., 0] = True
    elif mask_kind == "keys":
        mask = torch.randn(B, 1, 1, nk, generator=g, dtype=torch.float64)
    group = GQA_HEADS // GQA_KV_HEADS
    implicit = backend.endswith("_implicit")  # the converged plan's gradient: compare near the fixed point
    opts = {"n_iters": 30, "eps": 2.0} if implicit else VARIANT_OPTS[variant]
    leaves64 = [t.clone().requires_grad_() for t in (q, k, v)]
    want = expected(variant, leaves64[0], leaves64[1].repeat_interleave(group, 1),
                    leaves64[2].repeat_interleave(group, 1), mask, causal, None, opts)
    cot = torch.randn(want.shape, generator=g, dtype=torch.float64)
    want_g = torch.autograd.grad((want * cot).sum(), leaves64)
    dtype, device = (torch.float32, KERNEL_DEVICE) if is_triton(backend) else (torch.float64, "cpu")
    leaves = [t.to(dtype).to(device).requires_grad_() for t in (q, k, v)]
    m = None if mask is None else mask.to(device) if mask.dtype == torch.bool else mask.to(dtype).to(device)
    try:
        out = getattr(AF, variant)(*leaves, attn_mask=m, is_causal=causal, backend=backend, enable_gqa=True, **opts)
    except ValueError as e:
        assert backend not in ("auto", "reference"), f"{backend} refused a grouped-query call: {e}"
        assert "cannot run this" in str(e), str(e)
        return
    tol = dict(atol=1e-9, rtol=1e-9) if dtype == torch.float64 else dict(atol=5e-5, rtol=5e-5)
    if implicit:  # 30 rounds leave ~1e-7 of the fixed point
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float64 else dict(atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(out.double().cpu(), want.detach(), **tol)
    got_g = torch.autograd.grad((out * cot.to(dtype).to(device)).sum(), leaves)
    gtol = tol if dtype == torch.float64 or implicit else dict(atol=5e-4, rtol=5e-4)
    for name, a, b in zip("qkv", got_g, want_g):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        torch.testing.assert_close(a.double().cpu(), b, **gtol, msg=lambda s, n=name: f"grad {n}: {s}")
