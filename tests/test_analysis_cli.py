"""`attnzoo analyze` writes JSON + PNG; analysis entry points reject bad input with clear errors."""
import json

import pytest
import torch

from attnzoo import cli
from attnzoo.analysis import fields, gaussian, kernel_sums, particles


def test_analyze_wasserstein_writes_json_and_png(tmp_path):
    rc = cli.main(["analyze", "wasserstein", "--tokens", "5", "--clouds", "1", "--variants", "softmax,l2",
                   "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "wasserstein.json").read_text())
    assert data["rows"] and all(r["ratio"] > 0 for r in data["rows"])
    assert (tmp_path / "wasserstein.png").stat().st_size > 1000


X = torch.randn(4, 2, dtype=torch.float64)
W2 = torch.randn(2, 2, dtype=torch.float64)


@pytest.mark.parametrize("call,match", [
    (lambda: fields.query_velocity("nope", X, X, W2, W2, W2), "variant"),
    (lambda: fields.query_velocity("softmax", X[0], X, W2, W2, W2), "x must"),
    (lambda: fields.query_velocity("softmax", X, X, W2, W2[:1], W2), "Q and K"),
    (lambda: gaussian.affine_field("relu", X[0], W2 @ W2.T, W2, W2, W2), "Gaussian"),
    (lambda: gaussian.affine_field("sinkhorn", X[0], W2 @ W2.T, W2, W2, W2, sinkhorn_form="x"), "sinkhorn_form"),
    (lambda: kernel_sums.exp_kernel_sums(X, X[:, :1], X), "share p"),
    (lambda: kernel_sums.exp_kernel_sums(X, X, X, method="fast"), "method"),
    (lambda: particles.KernelSumField("relu", W2, W2, W2), "variant"),
    (lambda: particles.make_field("softmax", W2, W2, W2, engine="gpu"), "engine"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()
