"""Grouped-query attention's surface: SDPA's ``enable_gqa`` convention, the errors, what explain says,
and the layer path. The numbers of every variant and backend are checked against float64 formulas in
tests/test_documented_inputs.py (test_grouped_query_heads)."""
import pytest
import torch
import torch.nn.functional as F

import attnzoo
import attnzoo.functional as AF


def _qkv(h=6, h_kv=2, n=7, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, h, n, d, generator=g, dtype=dtype)
    k = torch.randn(2, h_kv, n, d, generator=g, dtype=dtype)
    v = torch.randn(2, h_kv, n, d, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_matches_sdpa_enable_gqa(causal):
    q, k, v = (t.requires_grad_() for t in _qkv())
    ours = AF.softmax(q, k, v, is_causal=causal, enable_gqa=True)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-12)
    cot = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), cot), torch.autograd.grad(theirs, (q, k, v), cot)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_fewer_kv_heads_without_enable_gqa_is_refused_with_the_way_out():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        AF.softmax(q, k, v)


@pytest.mark.parametrize("h,h_kv,vh", [(6, 4, 4), (6, 2, 3)])
def test_bad_head_counts_are_named(h, h_kv, vh):
    q, k, _ = _qkv(h=h, h_kv=h_kv)
    v = torch.randn(2, vh, 7, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="head"):
        AF.sigmoid(q, k, v, enable_gqa=True)


def test_enable_gqa_must_be_a_bool():
    q, k, v = _qkv(h=2, h_kv=2)
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        AF.relu(q, k, v, enable_gqa="yes")


def test_explain_says_how_the_shared_heads_are_handled():
    q, k, v = _qkv(dtype=torch.float32)
    native = str(AF.explain("softmax", q, k, v, enable_gqa=True))
    assert "3 query heads per key/value head" in native and "indexes each shared key/value head" in native
    expanded = str(AF.explain("sinkhorn", q, k, v, enable_gqa=True))
    assert "expanded to q's heads first" in expanded


def test_the_layer_path_takes_enable_gqa():
    """A host model with its own projections (Llama) hands the layer's attend k, v of fewer heads."""
    layer = attnzoo.create("l2", dim=48, num_heads=6).double()
    q, k, v = _qkv()
    out = layer.attend(q, k, v, is_causal=True, enable_gqa=True)
    want = layer.attend(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
