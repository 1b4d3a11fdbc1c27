"""`attnzoo bench` refuses what cannot run before any work (issue 23, items 6 and 8): a spec string
that `attnzoo.create` refuses fails with create's own message (not a benchmark of the defaults under
the bad label, nor a table of n/a rows), and `--device cuda` without a visible GPU is one error line."""
from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.bench import BenchConfig, run
from attnzoo.cli import main

# the tiniest run, so that code which wrongly benchmarks a bad spec fails the test quickly
TINY_ARGS = ["--seq-lens", "8", "--batch-tokens", "8", "--backends", "auto", "--mode", "fwd", "--quiet"]

BAD_SPECS = ["l2(foo=1)", "sinkhorn(n_iter=3)", "sinkhorn(n_iters=-1)", "masked(kind='sinkhorn', n_iters=-1)",
             "multihead(kind='l2', foo=1)"]


def create_message(spec: str) -> str:
    """What attnzoo.create says about the spec: the message the benchmark must repeat."""
    with pytest.raises((ValueError, TypeError)) as info:
        attnzoo.create(spec, 64, 2)
    return " ".join(str(info.value).split())


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_a_bad_spec_fails_before_any_work_with_creates_message(tmp_path, capsys, spec):
    out = tmp_path / "out"
    assert main(["bench", "--variants", "softmax", spec, "--out", str(out), *TINY_ARGS]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("attnzoo bench: error: --variants") and err.count("\n") == 1, err
    assert create_message(spec) in err and repr(spec) in err
    assert "Traceback" not in err + captured.out
    assert not out.exists()  # nothing measured, nothing written


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_the_python_api_refuses_a_bad_spec_too(spec):
    with pytest.raises((ValueError, TypeError)) as info:
        run(BenchConfig(variants=[spec], seq_lens=[8], batch_tokens=8, modes=["fwd"], backends=["auto"]),
            progress=False)
    assert " ".join(str(info.value).split()) == create_message(spec)


def test_good_specs_with_options_still_run(tmp_path):
    result = run(BenchConfig(variants=["sinkhorn(n_iters=1)", "fenchel(alpha=0.5)"], seq_lens=[8], batch_tokens=8,
                             modes=["fwd"], backends=["reference"], min_repeats=1, max_repeats=1,
                             target_seconds=0.0, measure_memory=False), progress=False)
    rows = [r for r in result["results"] if r["kind"] == "attnzoo"]
    assert {r["variant"] for r in rows} == {"sinkhorn(n_iters=1)", "fenchel(alpha=0.5)"}
    assert all(r["status"] == "ok" for r in rows), rows


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_a_visible_gpu_is_one_line(tmp_path, capsys, monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    assert main(["bench", "--device", device, "--variants", "softmax", "--out", str(out), *TINY_ARGS]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("attnzoo bench: error: no CUDA device is visible"), captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err + captured.out
    assert not out.exists()
