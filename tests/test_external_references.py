"""attnzoo against implementations other people wrote, each re-written here in float64 from a reading of
their code (not copied), in their layout and with their conventions, beside the attnzoo call that
docs/usage.md ("Other implementations") says is the same computation:

- Sinkformers (Sander et al. 2022, github.com/michaelsdr/sinkformers): ``SinkhornDistance`` as their
  ViT and NLP models call it;
- fast-transformers (Katharopoulos et al. 2020, github.com/idiap/fast-transformers): ``LinearAttention``
  and ``CausalLinearAttention`` with their elu + 1 feature map, eps = 1e-6 and ``key_lengths``;
- FlashSigmoid's reference (apple/ml-sigmoid-attention, ``flash_sigmoid/tests/test_flash_attn.py``'s
  ``attention_ref``): sigmoid(QK^T / sqrt(d) + attn_bias + b), b a scalar, with its padding masks and
  bottom-right causal window;
- torch.nn.MultiheadAttention (torch's own module, weights copied both ways): gradients, every softmax
  backend, unbatched 3-D masks.

Every case runs on the backends attnzoo has on CPU: the reference, the blockwise CPU path (and SDPA
where the variant has it) in float64, and the Triton kernels in float32 under TRITON_INTERPRET=1 (or on
a GPU), at tiny shapes. Already covered elsewhere and not repeated here: Sinkformers' forward on the
non-Triton backends without masks (test_documented_inputs.py), nn.MultiheadAttention's forward and
weights over batch_first, kdim / vdim, bias, bool / float / 3-D masks, the is_causal hint,
add_bias_kv / add_zero_attn and dropout (test_documented_inputs.py, test_layers_multihead_torch.py).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnzoo
import attnzoo.functional as AF
from attnzoo.ops import dispatch
from tests.common import INTERPRET, KERNEL_DEVICE, ON_GPU, seeded

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = dict(atol=1e-10, rtol=1e-9)
F32 = dict(atol=3e-5, rtol=3e-5)  # a Triton kernel in fp32 against the float64 formula (errors ~1e-7)


def backends(variant: str, *, skip=()) -> list[str]:
    """The backends that run on this machine: Triton only under the interpreter or on a GPU."""
    out = [b for b in dispatch.backends(variant) if b not in skip and b != "flex"]
    return [b for b in out if not b.startswith("triton") or INTERPRET or ON_GPU]


def run_backend(fn, backend, tensors, go, **kwargs):
    """``fn`` on float64 leaves (float32 on KERNEL_DEVICE for Triton): its output and gradients,
    as float64 on the CPU, with ``go`` the output's gradient. ``fn(*leaves, backend=...)``."""
    triton = backend.startswith("triton")
    dtype, device = (torch.float32, KERNEL_DEVICE) if triton else (torch.float64, "cpu")
    leaves = [t.to(device=device, dtype=dtype).requires_grad_() for t in tensors]
    out = fn(*leaves, backend=backend, **kwargs)
    grads = torch.autograd.grad(out, leaves, go.to(device=device, dtype=dtype))
    return out.double().cpu(), [g.double().cpu() for g in grads], (F32 if triton else F64)


def theirs_with_grads(fn, tensors, seed=99):
    """Their function on float64 leaves: output, a fixed output gradient, and the input gradients."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    go = torch.randn(out.shape, generator=seeded(seed), dtype=torch.float64)
    return out.detach(), go, torch.autograd.grad(out, leaves, go)


def assert_same(got, grads, tol, want, go_grads, what=""):
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what} output: {m}")
    for name, a, b in zip("qkv", grads, go_grads):
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{what} d{name}: {m}")


# --- Sinkformers ---------------------------------------------------------------------------------------
#
# Their SinkhornDistance takes C = -dots, dots = q.k / sqrt(d) of (B*H, Nq, Nk), and alternates for
# it = 0 .. max_iter-1: even it  u = eps (log(1/Nq) - lse_j M) + u  (rows), odd it  v = eps (log(1/Nk) -
# lse_i M) + v  (columns), with M = (dots + u_i + v_j) / eps; the plan is exp(M), multiplied by Nk in
# their ViT and NLP models. So max_iter = 2 n + 1 is n (row, column) rounds and a final row step:
# attnzoo's sinkhorn(n_iters=n, cost="dot", eps=eps), whose rows sum to 1 where theirs sum to Nk/Nq.
# Their NLP model masks padded keys with masked_fill(-1e9) before the call and resets potentials
# above 9e8 to 0 after each column step (so a padded key keeps weight 0): a bool mask here.

def sinkformers_plan(dots, max_iter, eps, reset_large_potentials=False):
    """(B*H, Nq, Nk) dots -> their plan times Nk. reset_large_potentials: the NLP model's
    ``v[v > 9e8] = 0`` after each column step (which also detaches v, as their code does)."""
    nq, nk = dots.shape[-2:]
    u = torch.zeros(dots.shape[:-1], dtype=dots.dtype)
    w = torch.zeros(dots.shape[:-2] + (nk,), dtype=dots.dtype)

    def M():
        return (dots + u[..., :, None] + w[..., None, :]) / eps
    for it in range(max_iter):
        if it % 2 == 0:
            u = eps * (math.log(1.0 / nq) - torch.logsumexp(M(), -1)) + u
        else:
            w = eps * (math.log(1.0 / nk) - torch.logsumexp(M().transpose(-2, -1), -1)) + w
            if reset_large_potentials:
                w = w.detach().masked_fill(w.detach() > 9e8, 0.0)
    return torch.exp(M()) * nk


def sinkformers_attention(q, k, v, max_iter, eps, key_padding=None, bias=None):
    """Their ViT / NLP attention on (B, H, N, D): dots (+ an additive bias, + -1e9 on padded keys:
    True = padded), the plan, plan @ v."""
    B, H, nq, d = q.shape
    dots = q @ k.transpose(-1, -2) / math.sqrt(d)
    if bias is not None:
        dots = dots + bias
    nlp = key_padding is not None
    if nlp:
        dots = dots.masked_fill(key_padding[:, None, None, :], -1e9)
    plan = sinkformers_plan(dots.reshape(B * H, nq, -1), max_iter, eps, reset_large_potentials=nlp)
    return plan.reshape(B, H, nq, -1) @ v


SINK_SHAPES = [(5, 5), (3, 6), (6, 3)]
SINK_UNROLLED = backends("sinkhorn", skip=("cpu_implicit", "triton_implicit"))


@pytest.mark.parametrize("backend", SINK_UNROLLED)
@pytest.mark.parametrize("nq,nk", SINK_SHAPES)
def test_sinkformers_forward_and_gradients(backend, nq, nk):
    """max_iter = 2 n + 1 (n = 0, 1, 2) is n_iters = n with cost="dot", output times Nk/Nq, on every
    unrolled backend, forward and the gradients of q, k, v (their ViT code differentiates through
    every iteration, as attnzoo's unrolled backward does)."""
    g = seeded(1)
    q, k, v = (torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64) for n in (nq, nk, nk))
    for n_iters in (0, 1, 2):
        want, go, want_grads = theirs_with_grads(lambda a, b, c: sinkformers_attention(a, b, c, 2 * n_iters + 1, 0.7),
                                                 (q, k, v))

        def mapped(a, b, c, backend):
            return AF.sinkhorn(a, b, c, n_iters=n_iters, eps=0.7, cost="dot", backend=backend) * (nk / nq)
        got, grads, tol = run_backend(mapped, backend, (q, k, v), go)
        assert_same(got, grads, tol, want, want_grads, f"n_iters={n_iters}")


@pytest.mark.parametrize("backend", SINK_UNROLLED)
def test_sinkformers_key_padding_is_a_bool_mask(backend):
    """Their NLP model's padding (-1e9 on padded keys and the reset of the potentials that run off to
    +1e9) removes the padded keys: attnzoo's bool key-padding mask, forward (their reset detaches the
    column potentials, so its gradient is not Sinkhorn's and only the forward is compared)."""
    g = seeded(2)
    nq, nk = 5, 6
    q, k, v = (torch.randn(2, 2, n, 4, generator=g, dtype=torch.float64) for n in (nq, nk, nk))
    pad = torch.zeros(2, nk, dtype=torch.bool)
    pad[1, -2:] = True
    for n_iters in (1, 2):
        want = sinkformers_attention(q, k, v, 2 * n_iters + 1, 1.0, key_padding=pad)

        def mapped(a, b, c, backend):
            keep = (~pad).to(a.device)[:, None, None, :]
            return AF.sinkhorn(a, b, c, attn_mask=keep, n_iters=n_iters, cost="dot", backend=backend) * (nk / nq)
        got, _, tol = run_backend(mapped, backend, (q, k, v), torch.zeros(2, 2, nq, 4, dtype=torch.float64))
        torch.testing.assert_close(got, want, **tol)


def test_sinkformers_float_padding_is_not_a_mask_for_sinkhorn():
    """What the docs warn about: a finite penalty on a whole key column (-1e9 as an additive mask) is
    absorbed by the column normalisation, which gives the column its mass back; only a bool mask or
    -inf removes the key (their NLP code needs its potential reset for the same reason)."""
    g = seeded(3)
    q, k, v = (torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64) for n in (5, 5, 5))
    pad = torch.tensor([False, False, False, True, True])
    plan = AF.sinkhorn(q, k, torch.eye(5, dtype=torch.float64).expand(1, 2, 5, 5), cost="dot", n_iters=3,
                       attn_mask=torch.zeros(5, dtype=torch.float64).masked_fill(pad, -1e9))
    assert (plan[..., pad].sum(-2) > 0.5).all()      # the "masked" keys are back, columns near 1
    removed = AF.sinkhorn(q, k, torch.eye(5, dtype=torch.float64).expand(1, 2, 5, 5), cost="dot", n_iters=3,
                          attn_mask=torch.zeros(5, dtype=torch.float64).masked_fill(pad, -math.inf))
    assert (removed[..., pad] == 0).all()


@pytest.mark.parametrize("backend", SINK_UNROLLED)
def test_sinkformers_additive_bias_maps_to_mask_over_eps(backend):
    """A bias their code adds to the dots (before the division by eps) is attn_mask = bias / eps here,
    where the float mask is added to the logits s / eps."""
    g = seeded(4)
    nq, nk, eps = 4, 6, 0.5
    q, k, v = (torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64) for n in (nq, nk, nk))
    bias = torch.randn(nq, nk, generator=g, dtype=torch.float64)
    want, go, want_grads = theirs_with_grads(lambda a, b, c: sinkformers_attention(a, b, c, 5, eps, bias=bias),
                                             (q, k, v))

    def mapped(a, b, c, backend):
        return AF.sinkhorn(a, b, c, attn_mask=(bias / eps).to(a), n_iters=2, eps=eps, cost="dot",
                           backend=backend) * (nk / nq)
    got, grads, tol = run_backend(mapped, backend, (q, k, v), go)
    assert_same(got, grads, tol, want, want_grads)


def test_sinkformers_nlp_multihead_is_attnzoo_multihead():
    """Their NLP model's MultiHeadAttention (WQ, WK, WV, linear with biases; heads; the padded keys of a
    (B, L, L) mask; Sinkhorn with eps = 1 and n_it half-steps) on self-attention is
    attnzoo.MultiheadAttention(kind="sinkhorn", cost="dot", n_iters=(n_it - 1) / 2) with in_proj = their
    three projections, out_proj = their output linear and key_padding_mask = their pad mask: outputs
    and per-head weights (theirs: the plan times Nk; Nq = Nk here, so rows sum to 1 in both)."""
    g = seeded(15)
    d_model, heads, n, n_it = 8, 2, 5, 5
    WQ, WK, WV, WO = (nn.Linear(d_model, d_model, dtype=torch.float64) for _ in range(4))
    with torch.no_grad():
        for lin in (WQ, WK, WV, WO):
            lin.weight.copy_(torch.randn(d_model, d_model, generator=g, dtype=torch.float64) * 0.4)
            lin.bias.copy_(torch.randn(d_model, generator=g, dtype=torch.float64) * 0.4)
    x = torch.randn(2, n, d_model, generator=g, dtype=torch.float64)
    pad = torch.zeros(2, n, dtype=torch.bool)
    pad[1, -2:] = True

    def split(t):
        return t.view(2, n, heads, -1).transpose(1, 2)
    q, k, v = split(WQ(x)), split(WK(x)), split(WV(x))
    dots = (q @ k.transpose(-1, -2) / math.sqrt(d_model // heads)).masked_fill(pad[:, None, None, :], -1e9)
    plan = sinkformers_plan(dots.reshape(2 * heads, n, n), n_it, 1.0, reset_large_potentials=True).view(2, heads, n, n)
    want = WO((plan @ v).transpose(1, 2).reshape(2, n, d_model))

    ours = attnzoo.MultiheadAttention(d_model, heads, batch_first=True, kind="sinkhorn", cost="dot",
                                      n_iters=(n_it - 1) // 2, dtype=torch.float64)
    with torch.no_grad():
        ours.in_proj_weight.copy_(torch.cat([WQ.weight, WK.weight, WV.weight]))
        ours.in_proj_bias.copy_(torch.cat([WQ.bias, WK.bias, WV.bias]))
        ours.out_proj.weight.copy_(WO.weight)
        ours.out_proj.bias.copy_(WO.bias)
    out, weights = ours(x, x, x, key_padding_mask=pad, average_attn_weights=False)
    torch.testing.assert_close(out, want, **F64)
    torch.testing.assert_close(weights, plan, **F64)


# --- fast-transformers ---------------------------------------------------------------------------------
#
# Layout (N, L, H, E). LinearAttention: Q = elu(q) + 1, K = (elu(k) + 1) * key_mask, out_i = Q_i . (sum_j
# K_j v_j^T) / (Q_i . sum_j K_j + eps), eps = 1e-6, no scale: attnzoo's linear(feature_map="elu") (scale
# defaults to 1) with a bool key-padding mask. CausalLinearAttention: the same over j <= i, where for
# L < S it first slices K to its first L rows (top-left alignment: query i sees keys 0..i), so for
# L <= S it is attnzoo's linear on k[:L], v[:L] with is_causal=True (attnzoo's is_causal is bottom-right:
# passing all S keys would show query i keys 0..i + S - L).

def _elu1(x):
    return F.elu(x) + 1


def _key_keep(key_lengths, S):
    return torch.arange(S)[None, :] < key_lengths[:, None]


def ft_linear_attention(Q, K, V, key_lengths, eps=1e-6):
    Qf, Kf = _elu1(Q), _elu1(K) * _key_keep(key_lengths, K.shape[1]).to(K.dtype)[:, :, None, None]
    KV = torch.einsum("nshd,nshm->nhmd", Kf, V)
    Z = 1 / (torch.einsum("nlhd,nhd->nlh", Qf, Kf.sum(1)) + eps)
    return torch.einsum("nlhd,nhmd,nlh->nlhm", Qf, KV, Z)


def ft_causal_linear_attention(Q, K, V, key_lengths, eps=1e-6):
    L = Q.shape[1]
    assert L <= K.shape[1]
    Qf, Kf = _elu1(Q), _elu1(K) * _key_keep(key_lengths, K.shape[1]).to(K.dtype)[:, :, None, None]
    Kf = Kf[:, :L]                                   # their _make_sizes_compatible
    Z = 1 / (torch.einsum("nlhi,nlhi->nlh", Qf, Kf.cumsum(1)) + eps)
    rows = [torch.einsum("nhd,nshd,nshm->nhm", Qf[:, i], Kf[:, :i + 1], V[:, :i + 1]) for i in range(L)]
    return torch.stack(rows, 1) * Z[..., None]


FT_CASES = [(5, 5, False), (3, 6, False), (6, 3, False), (5, 5, True), (3, 6, True)]


@pytest.mark.parametrize("backend", backends("linear"))
@pytest.mark.parametrize("L,S,causal", FT_CASES)
def test_fast_transformers_linear_attention(backend, L, S, causal):
    """Both classes, key_lengths with a fully padded sequence (their output there: 0 / eps = 0), and
    inputs where eps matters (phi(q) ~ 1e-5, so the denominator is of eps's size): forward and the
    gradients of queries, keys and values. The eps case runs on the float64 backends (in fp32, elu(x)
    + 1 loses phi's digits to cancellation at x ~ -12, in their code as in attnzoo's reference)."""
    g = seeded(5)
    n_rows = 2
    for shift in (0.0, -12.0):
        if shift and backend.startswith("triton"):
            continue
        Q = torch.randn(n_rows, L, 2, 4, generator=g, dtype=torch.float64) * (0.3 if shift else 1.0) + shift
        K = torch.randn(n_rows, S, 2, 4, generator=g, dtype=torch.float64) - (2.0 if shift else 0.0)
        V = torch.randn(n_rows, S, 2, 3, generator=g, dtype=torch.float64)
        lengths = torch.tensor([S, 0 if not causal else 2])
        theirs = ft_causal_linear_attention if causal else ft_linear_attention
        if shift:  # eps must matter, or the case tests nothing about it
            assert (theirs(Q, K, V, lengths, eps=0.0)[0] - theirs(Q, K, V, lengths)[0]).abs().max() > 1e-2
        want, go, want_grads = theirs_with_grads(lambda a, b, c: theirs(a, b, c, lengths), (Q, K, V))
        n = L if causal else S

        def mapped(a, b, c, backend):
            keep = _key_keep(lengths, n).to(a.device)[:, None, None, :]
            out = AF.linear(a.transpose(1, 2), b[:, :n].transpose(1, 2), c[:, :n].transpose(1, 2),
                            attn_mask=keep, is_causal=causal, backend=backend)
            return out.transpose(1, 2)
        got, grads, tol = run_backend(mapped, backend, (Q, K, V), go)
        assert_same(got, grads, tol, want, want_grads, f"shift={shift}")


def test_fast_transformers_causal_is_top_left_for_fewer_queries():
    """For L < S their causal attention is top-left aligned and attnzoo's is_causal bottom-right: the
    mapping slices the keys (above); passing all S keys with is_causal=True is a different call."""
    g = seeded(6)
    Q, K, V = (torch.randn(1, n, 2, 4, generator=g, dtype=torch.float64) for n in (3, 6, 6))
    theirs = ft_causal_linear_attention(Q, K, V, torch.tensor([6]))
    all_keys = AF.linear(*(t.transpose(1, 2) for t in (Q, K, V)), is_causal=True).transpose(1, 2)
    assert (all_keys - theirs).abs().max() > 1e-2
    top_left = torch.ones(3, 6, dtype=torch.bool).tril()   # the same as an explicit top-left mask
    explicit = AF.linear(*(t.transpose(1, 2) for t in (Q, K, V)), attn_mask=top_left).transpose(1, 2)
    torch.testing.assert_close(explicit, theirs, **F64)


# --- FlashSigmoid (apple/ml-sigmoid-attention) ---------------------------------------------------------
#
# attention_ref (their tests' reference for the FlashSigmoid kernels), layout (B, N, H, D):
# sigmoid(q k^T / sqrt(d) + attn_bias + sigmoid_bias) v, masked entries -inf (weight 0), sigmoid_bias a
# scalar (the paper's b = -log n is passed by the caller as a number). Causal is a window with
# col > row + sk - sq masked, sk / sq the *unpadded* lengths (varlen alignment). attnzoo: sigmoid(q, k, v,
# bias=sigmoid_bias, attn_mask=keep or attn_bias, is_causal=causal) in (B, H, N, D); attnzoo's default
# bias (None) is -log n_i with n_i the keys row i keeps, which for causal rows is the prefix length, so
# FlashSigmoid's b = -log(n) is an explicit bias=-math.log(n). Padded causal sequences are the per-
# sequence call on the unpadded tokens (padding at the end, as their tests generate it).

def flash_sigmoid_ref(q, k, v, sigmoid_bias, key_padding_mask=None, query_padding_mask=None, causal=False,
                      attn_bias=None):
    """Padding masks: True = a real token (theirs)."""
    B, nq, _, d = q.shape
    nk = k.shape[1]
    s = torch.einsum("bthd,bshd->bhts", q / math.sqrt(d), k)
    if key_padding_mask is not None:
        s = s.masked_fill(~key_padding_mask[:, None, None, :], -math.inf)
    hidden = None
    if causal:
        sk = nk if key_padding_mask is None else key_padding_mask.sum(-1).view(B, 1, 1, 1)
        sq = nq if query_padding_mask is None else query_padding_mask.sum(-1).view(B, 1, 1, 1)
        hidden = torch.arange(nk)[None, :] > torch.arange(nq)[:, None] + sk - sq
        s = s.masked_fill(hidden, -math.inf)
    if attn_bias is not None:
        s = s + attn_bias
    a = torch.sigmoid(s + sigmoid_bias)
    if hidden is not None:
        a = a.masked_fill(hidden.all(-1, keepdim=True), 0.0)
    if query_padding_mask is not None:
        a = a.masked_fill(~query_padding_mask[:, None, :, None], 0.0)
    out = torch.einsum("bhts,bshd->bthd", a, v)
    if query_padding_mask is not None:
        out = out.masked_fill(~query_padding_mask[:, :, None, None], 0.0)
    return out


def alibi(nq, nk, H):
    """FlashAttention's ALiBi bias -slope |i + nk - nq - j| (their attn_bias), per head."""
    slopes = torch.tensor([0.25, 0.0625][:H], dtype=torch.float64).view(H, 1, 1)
    rel = (torch.arange(nq)[:, None] + nk - nq - torch.arange(nk)[None, :]).abs()
    return -slopes * rel


@pytest.mark.parametrize("backend", backends("sigmoid"))
@pytest.mark.parametrize("nq,nk", [(5, 5), (3, 6), (6, 3)])
def test_flash_sigmoid_reference(backend, nq, nk):
    """b = -log(Nk) and a positive b, causal or not, with and without an ALiBi attn_bias (a float
    mask here): forward and gradients. Nq > Nk causal: the first Nq - Nk rows see no key (zeros) in
    both."""
    g = seeded(7)
    q, k, v = (torch.randn(2, n, 2, 4, generator=g, dtype=torch.float64) for n in (nq, nk, nk))
    for b, causal, with_alibi in ((-math.log(nk), False, False), (-math.log(nk), True, False),
                                  (0.5, True, True), (-2.0, False, True)):
        bias = alibi(nq, nk, 2) if with_alibi else None
        want, go, want_grads = theirs_with_grads(
            lambda a, c, e: flash_sigmoid_ref(a, c, e, b, causal=causal, attn_bias=bias), (q, k, v))

        def mapped(a, c, e, backend):
            mask = None if bias is None else bias.to(a)
            out = AF.sigmoid(a.transpose(1, 2), c.transpose(1, 2), e.transpose(1, 2), attn_mask=mask,
                             is_causal=causal, bias=b, backend=backend)
            return out.transpose(1, 2)
        got, grads, tol = run_backend(mapped, backend, (q, k, v), go)
        assert_same(got, grads, tol, want, want_grads, f"b={b} causal={causal} alibi={with_alibi}")


@pytest.mark.parametrize("backend", backends("sigmoid"))
def test_flash_sigmoid_padding(backend):
    """Key and query padding (True = real token in theirs): not causal, attnzoo's bool mask keep_q &
    keep_k (a padded query's row keeps no key: zeros, as theirs); causal, their window aligns the
    unpadded lengths, which is attnzoo's is_causal on each sequence's unpadded tokens."""
    g = seeded(8)
    nq, nk = 4, 6
    q, k, v = (torch.randn(2, n, 2, 4, generator=g, dtype=torch.float64) for n in (nq, nk, nk))
    kpm = torch.ones(2, nk, dtype=torch.bool)
    kpm[1, -3:] = False
    qpm = torch.ones(2, nq, dtype=torch.bool)
    qpm[1, -1] = False
    b = -math.log(nk)
    want, go, want_grads = theirs_with_grads(lambda a, c, e: flash_sigmoid_ref(a, c, e, b, kpm, qpm), (q, k, v))

    def mapped(a, c, e, backend):
        keep = (qpm[:, None, :, None] & kpm[:, None, None, :]).to(a.device)
        return AF.sigmoid(a.transpose(1, 2), c.transpose(1, 2), e.transpose(1, 2), attn_mask=keep, bias=b,
                          backend=backend).transpose(1, 2)
    got, grads, tol = run_backend(mapped, backend, (q, k, v), go)
    assert_same(got, grads, tol, want, want_grads, "padding")

    want = flash_sigmoid_ref(q, k, v, b, kpm, qpm, causal=True)
    for i in range(2):
        lq, lk = int(qpm[i].sum()), int(kpm[i].sum())

        def one(a, c, e, backend):
            return AF.sigmoid(a[i:i + 1, :lq].transpose(1, 2), c[i:i + 1, :lk].transpose(1, 2),
                              e[i:i + 1, :lk].transpose(1, 2), is_causal=True, bias=b, backend=backend).transpose(1, 2)
        got, _, tol = run_backend(one, backend, (q, k, v), torch.zeros(1, lq, 2, 4, dtype=torch.float64))
        torch.testing.assert_close(got, want[i:i + 1, :lq], **tol)
        assert (want[i, lq:] == 0).all()


def test_sigmoid_default_bias_is_flash_sigmoids_minus_log_n_without_masks():
    """The default bias is -log n_i over the keys row i keeps: FlashSigmoid's -log(Nk) when every key
    takes part, a different (prefix) count under causal, so there the mapping passes bias=-log(n)."""
    g = seeded(9)
    q, k, v = (torch.randn(1, n, 2, 4, generator=g, dtype=torch.float64) for n in (5, 5, 5))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    torch.testing.assert_close(AF.sigmoid(qt, kt, vt).transpose(1, 2), flash_sigmoid_ref(q, k, v, -math.log(5)), **F64)
    causal = flash_sigmoid_ref(q, k, v, -math.log(5), causal=True)
    assert (AF.sigmoid(qt, kt, vt, is_causal=True).transpose(1, 2) - causal).abs().max() > 1e-2
    torch.testing.assert_close(AF.sigmoid(qt, kt, vt, is_causal=True, bias=-math.log(5)).transpose(1, 2), causal, **F64)


# --- torch.nn.MultiheadAttention -----------------------------------------------------------------------
#
# attnzoo.MultiheadAttention(E, H, ..., kind="softmax") with torch's state_dict is torch's module, call
# for call (the forward and weights are tested in the files named above); here: the gradients of every
# parameter and input, weights copied from attnzoo to torch, and each softmax backend.

E, HEADS, L, S = 6, 2, 4, 5


def _torch_module(**kw):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, HEADS, dtype=torch.float64, **kw)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.4)  # non-zero biases, bias_k, bias_v
    return ref


def _inputs(batched, batch_first, kdim=None, vdim=None, B=2):
    g = seeded(10)

    def make(n, width):
        shape = (n, width) if not batched else ((B, n, width) if batch_first else (n, B, width))
        return torch.randn(shape, generator=g, dtype=torch.float64)
    return make(L, E), make(S, kdim or E), make(S, vdim or E)


def _outputs_and_grads(module, inputs, **kw):
    """Output, weights and the gradients of a loss on both w.r.t. every parameter and input."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    out, w = module(*leaves, **kw)
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum()
    if w is not None:
        loss = loss + (w ** 2).sum()
    params = [p for p in module.parameters() if p.requires_grad]
    return out, w, torch.autograd.grad(loss, params + leaves)


MHA_CONFIGS = {
    "plain": {},
    "kdim/vdim, no bias": dict(kdim=3, vdim=5, bias=False),
    "bias_kv + zero_attn": dict(add_bias_kv=True, add_zero_attn=True, kdim=3, vdim=5),
}
_pad = torch.zeros(2, S, dtype=torch.bool)
_pad[1, -2:] = True
MHA_MASKS = {
    "none": lambda: {},
    "kpm bool + attn_mask 2-D bool": lambda: {"key_padding_mask": _pad,
                                              "attn_mask": torch.eye(L, S, dtype=torch.bool).roll(1, -1)},
    "kpm float + attn_mask 3-D float": lambda: {
        "key_padding_mask": torch.zeros(2, S, dtype=torch.float64).masked_fill(_pad, -math.inf),
        "attn_mask": torch.randn(2 * HEADS, L, S, generator=seeded(11), dtype=torch.float64)},
}


@pytest.mark.parametrize("masks", list(MHA_MASKS))
@pytest.mark.parametrize("config", list(MHA_CONFIGS))
@pytest.mark.parametrize("batch_first", [False, True])
def test_multihead_gradients_match_torch(batch_first, config, masks):
    """Cross attention (L != S), weights per head and averaged, in training mode with dropout 0 (the
    path a model trains on) and in eval: output, weights and every gradient equal torch's."""
    kw = dict(MHA_CONFIGS[config], batch_first=batch_first)
    ref = _torch_module(**kw)
    ours = attnzoo.MultiheadAttention(E, HEADS, dtype=torch.float64, **kw)
    ours.load_state_dict(ref.state_dict(), strict=True)
    inputs = _inputs(True, batch_first, kw.get("kdim"), kw.get("vdim"))
    for train in (True, False):
        ref.train(train)
        ours.train(train)
        for average in (True, False):
            call = dict(MHA_MASKS[masks](), average_attn_weights=average)
            want = _outputs_and_grads(ref, inputs, **call)
            got = _outputs_and_grads(ours, inputs, **call)
            torch.testing.assert_close(got[0], want[0], **F64)
            torch.testing.assert_close(got[1], want[1], **F64)
            for a, b in zip(got[2], want[2]):
                torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("batch_first", [False, True])
def test_multihead_unbatched_3d_mask_and_float_padding_match_torch(batch_first):
    """Unbatched (L, E) inputs take a 3-D attn_mask of (H, L, S) and an (S,) key_padding_mask in torch:
    bool and float, with gradients."""
    ref = _torch_module(batch_first=batch_first)
    ours = attnzoo.MultiheadAttention(E, HEADS, dtype=torch.float64, batch_first=batch_first)
    ours.load_state_dict(ref.state_dict())
    inputs = _inputs(False, batch_first)
    hide = torch.rand(HEADS, L, S, generator=seeded(12)) < 0.3
    hide[..., 0] = False
    for call in ({"attn_mask": hide, "key_padding_mask": torch.tensor([False, True, False, False, True])},
                 {"attn_mask": torch.randn(HEADS, L, S, generator=seeded(13), dtype=torch.float64),
                  "key_padding_mask": torch.tensor([0.0, -math.inf, 0.5, 0.0, -1.0], dtype=torch.float64)}):
        for average in (True, False):
            want = _outputs_and_grads(ref, inputs, average_attn_weights=average, **call)
            got = _outputs_and_grads(ours, inputs, average_attn_weights=average, **call)
            torch.testing.assert_close(got[0], want[0], **F64)
            torch.testing.assert_close(got[1], want[1], **F64)
            for a, b in zip(got[2], want[2]):
                torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("config", list(MHA_CONFIGS))
def test_multihead_weights_load_into_torch(config):
    """The other way: attnzoo's own initialised weights load into torch's module (strict) and give
    torch's results."""
    kw = dict(MHA_CONFIGS[config], batch_first=True)
    torch.manual_seed(3)
    ours = attnzoo.MultiheadAttention(E, HEADS, dtype=torch.float64, **kw).eval()
    ref = nn.MultiheadAttention(E, HEADS, dtype=torch.float64, **kw).eval()
    ref.load_state_dict(ours.state_dict(), strict=True)
    inputs = _inputs(True, True, kw.get("kdim"), kw.get("vdim"))
    want, got = _outputs_and_grads(ref, inputs, key_padding_mask=_pad), _outputs_and_grads(ours, inputs, key_padding_mask=_pad)
    torch.testing.assert_close(got[0], want[0], **F64)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning")  # torch, mixed mask dtypes
@pytest.mark.parametrize("backend", backends("softmax"))
def test_multihead_every_softmax_backend_matches_torch(backend):
    """backend= of the module (each softmax kernel: SDPA, the blockwise CPU path, the reference, Triton
    in fp32): output, weights and input gradients against torch's float64 module, masks of both kinds."""
    kw = dict(kdim=3, vdim=5, batch_first=True)
    ref = _torch_module(**kw).eval()
    triton = backend.startswith("triton")
    dtype, device = (torch.float32, KERNEL_DEVICE) if triton else (torch.float64, "cpu")
    ours = attnzoo.MultiheadAttention(E, HEADS, backend=backend, **kw).to(device=device, dtype=dtype).eval()
    ours.load_state_dict(ref.state_dict())
    tol = F32 if triton else F64
    q, k, v = _inputs(True, True, 3, 5)
    attn_mask = torch.randn(L, S, generator=seeded(14), dtype=torch.float64)
    for call in ({}, {"key_padding_mask": _pad, "attn_mask": attn_mask}):
        for need_weights in (True, False):
            want = ref(q, k, v, need_weights=need_weights, **call)
            leaves = [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]
            ours_call = {n: m.to(device=device, dtype=dtype if m.is_floating_point() else m.dtype) for n, m in call.items()}
            got = ours(*leaves, need_weights=need_weights, **ours_call)
            torch.testing.assert_close(got[0].double().cpu(), want[0], **tol)
            if need_weights:
                torch.testing.assert_close(got[1].double().cpu(), want[1], **tol)
            ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            want_grads = torch.autograd.grad(ref(*ref_leaves, need_weights=False, **call)[0].sum(), ref_leaves)
            for a, b in zip(torch.autograd.grad(got[0].sum(), leaves), want_grads):
                torch.testing.assert_close(a.double().cpu(), b, **tol)


def test_multihead_row_without_keys_is_zeros_as_torchs_sdpa_path():
    """The documented difference: a query whose every key is masked gets zeros before out_proj (so
    out_proj's bias) and zero weights; torch gives that on its need_weights=False path and NaN on its
    need_weights=True path. The other rows are torch's."""
    ref = _torch_module(batch_first=True).eval()
    ours = attnzoo.MultiheadAttention(E, HEADS, dtype=torch.float64, batch_first=True).eval()
    ours.load_state_dict(ref.state_dict())
    q, k, v = _inputs(True, True)
    mask = torch.zeros(L, S, dtype=torch.bool)
    mask[0] = True
    out, w = ours(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out[:, 0], ref.out_proj.bias.expand(2, E), **F64)
    assert (w[:, 0] == 0).all()
    torch.testing.assert_close(out, ref(q, k, v, attn_mask=mask, need_weights=False)[0], **F64)
    want_out, want_w = ref(q, k, v, attn_mask=mask)
    assert want_out[:, 0].isnan().all() and want_w[:, 0].isnan().all()
    torch.testing.assert_close(out[:, 1:], want_out[:, 1:], **F64)
    torch.testing.assert_close(w[:, 1:], want_w[:, 1:], **F64)
