"""attnzoo.MultiheadAttention against torch.nn.MultiheadAttention with the same weights: unbatched
(L, E) inputs under either batch_first, and ``is_causal`` as torch's hint next to an explicit mask
(self and cross attention, L != S). float64, so the comparison is to rounding."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import attnzoo
from attnzoo.layers.multihead import is_causal_mask

E, HEADS, L, S = 12, 3, 9, 6
TOL = dict(rtol=1e-9, atol=1e-10)


def _pair(batch_first, kdim=None, vdim=None, kind="softmax"):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, HEADS, batch_first=batch_first, kdim=kdim, vdim=vdim, dtype=torch.float64)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)  # non-zero biases too
    ours = attnzoo.MultiheadAttention(E, HEADS, batch_first=batch_first, kdim=kdim, vdim=vdim, kind=kind,
                                      dtype=torch.float64)
    ours.load_state_dict(ref.state_dict())
    return ref.eval(), ours.eval()


def _inputs(batched, batch_first, cross, kdim=None, vdim=None, B=2):
    g = torch.Generator().manual_seed(1)
    n_k = S if cross else L

    def make(n, width):
        shape = (n, width) if not batched else ((B, n, width) if batch_first else (n, B, width))
        return torch.randn(shape, generator=g, dtype=torch.float64)
    q = make(L, E)
    return q, (make(n_k, kdim or E) if cross else q), (make(n_k, vdim or E) if cross else q)


def _compare(ref, ours, args, **kw):
    for need_weights in (True, False):
        for average in (True, False):
            a = ref(*args, need_weights=need_weights, average_attn_weights=average, **kw)
            b = ours(*args, need_weights=need_weights, average_attn_weights=average, **kw)
            torch.testing.assert_close(b[0], a[0], **TOL)
            if need_weights:
                torch.testing.assert_close(b[1], a[1], **TOL)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("cross", [False, True])
def test_unbatched_input_matches_torch(batch_first, cross):
    kdim, vdim = (5, 7) if cross else (None, None)
    ref, ours = _pair(batch_first, kdim, vdim)
    q, k, v = _inputs(False, batch_first, cross, kdim, vdim)
    _compare(ref, ours, (q, k, v))
    out = ours(q, k, v)[0]
    assert out.shape == (L, E)
    # the same tokens as a batch of one give the same outputs: L stays the sequence axis
    batched = ours(*(t.unsqueeze(0 if batch_first else 1) for t in (q, k, v)))[0]
    torch.testing.assert_close(batched.squeeze(0 if batch_first else 1), out, **TOL)


@pytest.mark.parametrize("batch_first", [True, False])
def test_unbatched_key_padding_mask_matches_torch(batch_first):
    ref, ours = _pair(batch_first)
    q, k, v = _inputs(False, batch_first, cross=True)
    kpm = torch.tensor([False, True, False, False, True, False])
    _compare(ref, ours, (q, k, v), key_padding_mask=kpm)


def _top_left_causal(n_q, n_k):
    return torch.ones(n_q, n_k, dtype=torch.bool).triu(1)  # True = masked, torch's convention


MASKS = {
    "square causal (bool)": lambda: _top_left_causal(L, L),
    "square causal (float)": lambda: nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64),
    "cross, top-left causal": lambda: _top_left_causal(L, S),
    "cross, any mask": lambda: torch.rand(L, S, generator=torch.Generator().manual_seed(3)) < 0.4,
}


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("batch_first", [True, False])
def test_is_causal_with_an_explicit_mask_applies_the_mask_as_torch_does(name, batch_first):
    """torch treats is_causal as a hint: the mask it is given is what it applies (need_weights=True
    path; for the cross masks that are not causal in attnzoo's bottom-right sense)."""
    cross = name.startswith("cross")
    mask = MASKS[name]()
    if mask.dtype == torch.bool:
        mask[:, 0] = False  # every query keeps a key (torch gives NaN rows otherwise)
    ref, ours = _pair(batch_first)
    q, k, v = _inputs(True, batch_first, cross)
    want = ref(q, k, v, attn_mask=mask, is_causal=True, need_weights=True)
    for need_weights in (True, False):
        got = ours(q, k, v, attn_mask=mask, is_causal=True, need_weights=need_weights)
        torch.testing.assert_close(got[0], want[0], **TOL)
        if need_weights:
            torch.testing.assert_close(got[1], want[1], **TOL)
    # and the same as the mask alone
    torch.testing.assert_close(ours(q, k, v, attn_mask=mask)[0], want[0], **TOL)


def test_is_causal_mask_recognises_exactly_the_causal_pattern():
    assert is_causal_mask(_top_left_causal(5, 5), 5, 5)
    assert is_causal_mask(nn.Transformer.generate_square_subsequent_mask(5), 5, 5)
    assert is_causal_mask(_top_left_causal(5, 5).expand(6, 5, 5), 5, 5)
    bottom_right = ~attnzoo.ops.masking.causal_keep(3, 5)
    assert is_causal_mask(bottom_right, 3, 5) and not is_causal_mask(_top_left_causal(3, 5), 3, 5)
    off = _top_left_causal(5, 5)
    off[4, 0] = True
    assert not is_causal_mask(off, 5, 5)
    assert not is_causal_mask(nn.Transformer.generate_square_subsequent_mask(5) * 0.5 + 1.0, 5, 5)


def test_sinkhorn_with_a_causal_mask_and_the_hint_runs_prefix_sinkhorn():
    """The causal mask with is_causal=True reaches the kernel as is_causal alone: Sinkhorn's outputs
    for early tokens do not depend on later ones (they would through the column normalisation)."""
    torch.manual_seed(0)
    mha = attnzoo.MultiheadAttention(E, HEADS, batch_first=True, kind="sinkhorn", dtype=torch.float64).eval()
    x = torch.randn(2, L, E, dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    out = mha(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(out, mha(x, x, x, is_causal=True, need_weights=False)[0], **TOL)
    y = x.clone()
    y[:, -1] += 1.0
    moved = mha(y, y, y, attn_mask=mask, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(moved[:, :-1], out[:, :-1], **TOL)


@pytest.mark.parametrize("call,match", [
    (lambda m: m(torch.randn(2, L, E), torch.randn(S, E), torch.randn(S, E)), "batched"),
    (lambda m: m(torch.randn(2, L, E + 1), torch.randn(2, S, E), torch.randn(2, S, E)), "query must have 12"),
    (lambda m: m(torch.randn(2, L, E), torch.randn(2, S, E), torch.randn(2, S + 1, E)), "key and value"),
])
def test_bad_inputs_name_the_layer(call, match):
    with pytest.raises(ValueError, match=match):
        call(attnzoo.MultiheadAttention(E, HEADS, batch_first=True))
