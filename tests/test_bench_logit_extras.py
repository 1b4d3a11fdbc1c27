"""attnzoo bench rows for softcap, sinks and sliding windows (issue 29 item 6): a spec's extras reach the
timed call, the SDPA baseline computes the same attention with its dense mask (checked against attnzoo's
float64 reference, outputs and every gradient), rows nothing can compute say why, and the GPU run's grid
has the rows. Tiny float64 shapes on CPU."""
from __future__ import annotations

import pytest
import torch

from attnzoo.bench import errors, speed_grid
from attnzoo.bench.baselines import FlexExtrasTarget, SdpaExtrasTarget, baseline_targets
from attnzoo.bench.flops import Shape
from attnzoo.bench.problem import Problem
from attnzoo.bench.runner import BenchConfig, run
from attnzoo.bench.targets import AttnzooTarget, parse_variant

SPECS = ["softmax(sinks=True)", "softmax(window_size=(5, 2))", "masked(window_size=(5, 0))",
         "masked(sinks=True, window_size=(4, 0))"]


def problem(causal=False):
    return Problem(Shape(batch=2, heads=3, seq_q=17, head_dim=8), torch.float64, torch.device("cpu"), "fwd+bwd",
                   causal, seed=3)


def run_case(case, p):
    prepared = case.prepare(p)
    out = prepared.forward()
    grads = torch.autograd.grad(out, prepared.leaves, torch.ones_like(out).cos())  # d/d q, k, v (and sinks)
    return out, grads


@pytest.mark.parametrize("spec_text", SPECS)
def test_sdpa_with_the_dense_mask_computes_the_spec(spec_text):
    spec = parse_variant(spec_text)
    p = problem()
    want, want_grads = run_case(AttnzooTarget(spec, "reference"), p)
    got, got_grads = run_case(SdpaExtrasTarget(spec, "sdpa"), p)
    assert (got - want).abs().max() <= 1e-12
    assert len(got_grads) == len(want_grads)
    assert all((a - b).abs().max() <= 1e-12 for a, b in zip(got_grads, want_grads))
    # the extras reach the timed call: the same problem without them is far away
    plain, _ = run_case(AttnzooTarget(parse_variant(spec_text.split("(")[0]), "reference"), p)
    assert (plain - want).abs().max() > 1e-3


def test_rows_that_cannot_compute_the_spec_say_why():
    spec = parse_variant("softmax(softcap=30)")
    with pytest.raises(errors.Unsupported, match="SDPA cannot cap its logits"):
        SdpaExtrasTarget(spec, "sdpa").prepare(problem())
    with pytest.raises(errors.Unsupported, match="CUDA only"):
        FlexExtrasTarget(spec, "torch-flex").prepare(problem())
    # the baselines of a spec with extras are those that compute them, not plain SDPA / Flex / flash-attn
    assert [type(t).__name__ for t in baseline_targets(spec, torch.device("cpu"))] == [
        "SdpaExtrasTarget", "FlexExtrasTarget"]


def test_bench_run_on_cpu_records_every_row():
    config = BenchConfig(variants=["masked(window_size=(7, 0))", "softmax(softcap=30)"], seq_lens=[32],
                         batch_tokens=32, heads=[2], head_dim=8, modes=["fwd+bwd"], min_repeats=1, max_repeats=1,
                         target_seconds=0.0, measure_memory=False, backends=["cpu", "sdpa", "torch-flex"])
    rows = run(config.validate(), progress=False)["results"]
    status = {(r["variant"], r["backend"]): (r["status"], r["reason"] or "") for r in rows}
    assert status[("masked(window_size=(7, 0))", "cpu")][0] == errors.OK
    assert status[("masked(window_size=(7, 0))", "sdpa")][0] == errors.OK
    assert status[("softmax(softcap=30)", "cpu")][0] == errors.OK
    assert status[("softmax(softcap=30)", "sdpa")] == (errors.UNSUPPORTED, status[("softmax(softcap=30)", "sdpa")][1])
    for spec in ("masked(window_size=(7, 0))", "softmax(softcap=30)"):
        assert status[(spec, "torch-flex")][0] == errors.UNSUPPORTED
        assert "CUDA only" in status[(spec, "torch-flex")][1]


def test_the_gpu_grid_has_the_rows():
    cases = {c.label: c for c in speed_grid.speed_cases(torch.device("cuda"))}
    long = Problem(Shape(batch=1, heads=16, seq_q=16384, head_dim=128), torch.bfloat16, torch.device("cuda"),
                   "fwd+bwd", True)
    short = Problem(Shape(batch=16, heads=16, seq_q=1024, head_dim=128), torch.bfloat16, torch.device("cuda"),
                    "fwd+bwd", True)
    for name in ("softcap", "sinks", "window256", "window1024"):
        sdpa = cases[f"sdpa+{name}"]
        assert isinstance(sdpa, SdpaExtrasTarget) and sdpa.applies(long) and not sdpa.applies(short)
        assert isinstance(cases[f"flex+{name}"], FlexExtrasTarget)
        assert cases[f"softmax+{name} / triton"].applies(long)
    assert cases["sdpa+window1024"].spec.kwargs["window_size"] == (1023, 0)


@pytest.mark.parametrize("spec_text", SPECS + ["softmax(softcap=2)", "masked(sinks=True, softcap=3, window_size=(4, 0))"])
def test_flex_with_the_same_mods_computes_the_spec(spec_text, monkeypatch):
    """The FlexAttention row's mask_mod / score_mod / sink renormalisation, checked on CPU through eager
    flex_attention (forward only: the timed rows are compiled, on CUDA)."""
    import warnings

    import attnzoo.ops.kernels.flex as flex_kernels
    from torch.nn.attention.flex_attention import flex_attention

    from attnzoo.bench import logit_extras
    monkeypatch.setattr(flex_kernels, "compiled_flex_attention", lambda: flex_attention)
    spec = parse_variant(spec_text)
    p = Problem(Shape(batch=1, heads=2, seq_q=32, head_dim=8), torch.float64, torch.device("cpu"), "fwd", False,
                seed=4)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is unfused
        want = AttnzooTarget(spec, "reference").prepare(p).forward()
        got = logit_extras.flex(spec, p, "torch-flex", any_device=True).forward()
    assert (got - want).abs().max() <= 1e-12
