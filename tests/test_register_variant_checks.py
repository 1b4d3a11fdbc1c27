"""register_variant checks the reference before registering it (issue 31 item 17): one without the
keyword arguments every call passes, or one whose output is not (B, H, Nq, Dv), was accepted and the
first call failed with a raw TypeError / RuntimeError. Now registration refuses it, naming the problem,
and leaves nothing registered."""
from __future__ import annotations

import pytest
import torch

import attnzoo


def good(q, k, v, *, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0, tau=2.0):
    """softmax_j(tau q_i . k_j) v_j, unmasked (enough for registration)."""
    return torch.softmax(tau * q @ k.transpose(-1, -2), -1) @ v


def no_dropout(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    return good(q, k, v)


def two_positional(q, k, *, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0):
    return q


def returns_weights(q, k, v, *, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0):
    return torch.softmax(q @ k.transpose(-1, -2), -1)


def returns_q_shape(q, k, v, *, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0):
    return torch.softmax(q @ k.transpose(-1, -2), -1) @ k


def raises(q, k, v, *, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0):
    return q @ v   # (.., 3, 4) @ (.., 5, 6): a RuntimeError


@pytest.mark.parametrize("reference,error,words", [
    (no_dropout, TypeError, r"register_variant\('probe_bad'\): the reference 'no_dropout' must accept .*lacks dropout_p"),
    (two_positional, TypeError, r"must take q, k, v as its first three positional arguments"),
    (returns_weights, ValueError, r"must return the \(B, H, Nq, Dv\) output: a probe call .* returned \(1, 2, 3, 5\)"),
    (returns_q_shape, ValueError, r"returned \(1, 2, 3, 4\), not \(1, 2, 3, 6\)"),
    (raises, ValueError, r"'raises' failed a probe call \(q \(1, 2, 3, 4\), k \(1, 2, 5, 4\), v \(1, 2, 5, 6\).*RuntimeError"),
])
def test_a_bad_reference_is_refused_at_registration(reference, error, words):
    with pytest.raises(error, match=words):
        attnzoo.register_variant(attnzoo.Variant(name="probe_bad", reference=reference))
    assert "probe_bad" not in attnzoo.available()
    assert "probe_bad" not in attnzoo.functional.VARIANT_FUNCTIONS


@pytest.mark.parametrize("reference", [
    good,
    lambda q, k, v, **kw: good(q, k, v),                                         # **kwargs takes them all
    lambda q, k, v, *, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0, tau: good(q, k, v, tau=tau),
])
def test_a_good_reference_registers_without_moving_the_random_stream(reference):
    torch.manual_seed(3)
    before = torch.get_rng_state()
    attnzoo.register_variant(attnzoo.Variant(name="probe_good", reference=reference))
    try:
        assert torch.equal(torch.get_rng_state(), before)
        assert "probe_good" in attnzoo.available()
    finally:
        attnzoo.unregister("probe_good")
