"""A layer on a packed batch: x (T, dim) with cu_seqlens / max_seqlen, or a torch.nested jagged
(B, j, dim) tensor, gives what the layer gives each sequence on its own (outputs and the gradients of
every parameter), in the input's layout, for every registered layer (the wrappers included) and the
variants' forms that read more than q, k, v (Fenchel's context tokens, l2's tied keys). float64."""
from __future__ import annotations

import pytest
import torch

import attnzoo

DIM, HEADS = 16, 2
LENGTHS = [3, 1, 5]
SPECS = [s for s in attnzoo.available() if s != "multihead"] + ["fenchel(preference='context')", "l2(tie_qk=True)"]


def layer_and_tokens(spec):
    torch.manual_seed(0)
    layer = attnzoo.create(spec, DIM, HEADS).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # parameters a variant adds may start at zero: draw them
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    g = torch.Generator().manual_seed(2)
    return layer, [torch.randn(n, DIM, generator=g, dtype=torch.float64) for n in LENGTHS]


def param_grads(layer, out):
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    return torch.autograd.grad((out * weights).sum(), list(layer.parameters()))


@pytest.mark.parametrize("layout", ["cu_seqlens", "nested"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("spec", SPECS)
def test_packed_layer_equals_each_sequence_alone(spec, causal, layout):
    layer, xs = layer_and_tokens(spec)
    alone = torch.cat([layer(x[None], is_causal=causal)[0] for x in xs])
    if layout == "cu_seqlens":
        cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
        out = layer(torch.cat(xs), cu_seqlens=cu, max_seqlen=max(LENGTHS), is_causal=causal)
        packed = out
    else:
        out = layer(torch.nested.nested_tensor(xs, layout=torch.jagged), is_causal=causal)
        assert out.is_nested and out.layout == torch.jagged and out.offsets().tolist() == [0, 3, 4, 9]
        packed = out.values()
    assert packed.shape == (sum(LENGTHS), DIM)
    torch.testing.assert_close(packed, alone, atol=1e-10, rtol=1e-10)
    for got, want in zip(param_grads(layer, packed), param_grads(layer, alone)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_packed_layer_errors_name_the_argument():
    layer, xs = layer_and_tokens("softmax")
    x, cu = torch.cat(xs), torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="a packed batch takes no attn_mask"):
        layer(x, cu_seqlens=cu, attn_mask=torch.ones(9, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"x must be the packed \(T, dim\) tokens"):
        layer(x[None], cu_seqlens=cu)
    with pytest.raises(ValueError, match="carries its own offsets"):
        layer(torch.nested.nested_tensor(xs, layout=torch.jagged), cu_seqlens=cu)
    with pytest.raises(ValueError, match="sequence 1 length 0"):
        layer(x, cu_seqlens=torch.tensor([0, 3, 3, 9], dtype=torch.int32))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", ["softmax", "sinkhorn", "relu"])
def test_multihead_attention_takes_jagged_tensors(kind, causal):
    """attnzoo.MultiheadAttention(batch_first=True) on jagged query / key / value (cross-attention lengths
    differ per sequence) equals the module on each sequence alone; the output keeps the query's offsets."""
    torch.manual_seed(0)
    mha = attnzoo.MultiheadAttention(DIM, HEADS, batch_first=True, kind=kind).double()
    g = torch.Generator().manual_seed(2)
    queries = [torch.randn(n, DIM, generator=g, dtype=torch.float64) for n in LENGTHS]
    keys = [torch.randn(n + 1, DIM, generator=g, dtype=torch.float64) for n in LENGTHS]
    nested_q = torch.nested.nested_tensor(queries, layout=torch.jagged)
    nested_k = torch.nested.nested_tensor(keys, layout=torch.jagged)
    out, weights = mha(nested_q, nested_k, nested_k, need_weights=False, is_causal=causal)
    assert weights is None and out.is_nested and out.offsets().tolist() == [0, 3, 4, 9]
    alone = torch.cat([mha(q[None], k[None], k[None], need_weights=False, is_causal=causal)[0][0]
                       for q, k in zip(queries, keys)])
    torch.testing.assert_close(out.values(), alone, atol=1e-10, rtol=1e-10)
    for got, want in zip(param_grads(mha, out.values()), param_grads(mha, alone)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_multihead_attention_jagged_errors():
    mha = attnzoo.MultiheadAttention(DIM, HEADS, batch_first=True).double()
    x = torch.nested.nested_tensor([torch.randn(n, DIM, dtype=torch.float64) for n in LENGTHS], layout=torch.jagged)
    with pytest.raises(ValueError, match="pass need_weights=False"):
        mha(x, x, x)
    with pytest.raises(ValueError, match="batch_first=True"):
        attnzoo.MultiheadAttention(DIM, HEADS).double()(x, x, x, need_weights=False)
