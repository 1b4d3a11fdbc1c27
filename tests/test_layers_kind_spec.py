"""The wrappers' ``kind`` takes the spec strings that ``attnzoo.create`` takes:
``MultiheadAttention(kind="sinkhorn(n_iters=5)")`` runs exactly what ``kind="sinkhorn", n_iters=5``
runs; an option given both in the spec and as a keyword argument, a misspelt one or a malformed spec
is an error naming it."""
from __future__ import annotations

import pytest
import torch

import attnzoo

E, H = 32, 4


def mha_pair(**plain):
    """(built from the spec string, built from the name and keyword arguments), same weights."""
    spec = attnzoo.MultiheadAttention(E, H, batch_first=True, kind="sinkhorn(n_iters=5, eps=0.5)")
    ref = attnzoo.MultiheadAttention(E, H, batch_first=True, kind="sinkhorn", n_iters=5, eps=0.5, **plain)
    ref.load_state_dict(spec.state_dict())
    return spec, ref


def test_multihead_kind_spec_runs_the_options():
    spec, ref = mha_pair()
    assert spec.kind == "sinkhorn" and spec.kind_kwargs == {"n_iters": 5, "eps": 0.5}
    x = torch.randn(2, 7, E)
    out, weights = spec(x, x, x)
    out_ref, weights_ref = ref(x, x, x)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    torch.testing.assert_close(weights, weights_ref, rtol=0, atol=0)
    default = attnzoo.MultiheadAttention(E, H, batch_first=True, kind="sinkhorn")
    default.load_state_dict(spec.state_dict())
    assert (default(x, x, x)[0] - out).abs().max() > 1e-4  # the options reached the kernel


def test_masked_kind_spec_runs_the_options():
    spec = attnzoo.MaskedAttention(E, H, kind="sinkhorn(n_iters=5, eps=0.5)")
    ref = attnzoo.MaskedAttention(E, H, kind="sinkhorn", n_iters=5, eps=0.5)
    ref.load_state_dict(spec.state_dict())
    assert (spec.kind, spec.n_iters, spec.eps) == ("sinkhorn", 5, 0.5)
    x = torch.randn(2, 7, E)
    torch.testing.assert_close(spec(x), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("spec", ["masked(kind='sinkhorn(n_iters=5)')", "multihead(kind='sinkhorn(n_iters=5)')"])
def test_create_layer_and_resolve_take_a_kind_spec(spec):
    layer = attnzoo.create(spec, E, H)
    assert layer.kind == "sinkhorn"
    assert attnzoo.layer(spec)(E, H).kind == "sinkhorn"
    resolved = attnzoo.registry.resolve(spec)
    assert resolved.kind == "sinkhorn" and resolved.kernel_kwargs == {"n_iters": 5}


@pytest.mark.parametrize("build", [
    lambda: attnzoo.MultiheadAttention(E, H, kind="sinkhorn(n_iters=5)", n_iters=3),
    lambda: attnzoo.MaskedAttention(E, H, kind="sinkhorn(n_iters=5)", n_iters=3),
    lambda: attnzoo.MaskedAttention(E, H, kind="sinkhorn(n_iters=5)", kind_kwargs={"n_iters": 3}),
    lambda: attnzoo.create("masked(kind='sinkhorn(n_iters=5)', n_iters=3)", E, H),
], ids=["multihead", "masked", "masked kind_kwargs", "create"])
def test_an_option_given_twice_is_an_error(build):
    with pytest.raises(TypeError, match=r"n_iters.*give each option once"):
        build()


@pytest.mark.parametrize("cls", [attnzoo.MultiheadAttention, attnzoo.MaskedAttention])
def test_bad_kind_specs_name_the_problem(cls):
    with pytest.raises(TypeError, match="n_iter"):        # misspelt: the kind's options are listed
        cls(E, H, kind="sinkhorn(n_iter=5)")
    with pytest.raises(ValueError, match="n_iters"):      # a bad value: the kind's own check
        cls(E, H, kind="sinkhorn(n_iters=-1)")
    with pytest.raises(ValueError, match="sinkhorm"):     # an unknown kind
        cls(E, H, kind="sinkhorm(n_iters=5)")
    with pytest.raises(ValueError, match="not of the form"):
        cls(E, H, kind="sinkhorn(n_iters=5")
