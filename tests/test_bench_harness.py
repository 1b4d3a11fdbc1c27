"""The `attnzoo bench` harness on tiny shapes: records, JSON schema, OOM / unsupported / error rows,
guards, plots, Markdown, --compare and the command line. Not speed."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from attnzoo import cli
from attnzoo.bench import (BenchConfig, compare, load, markdown_compare, markdown_report, run, validate,
                           write_outputs)
from attnzoo.bench.flops import Shape, flops
from attnzoo.bench.memory import LiveTensorBytes
from attnzoo.bench.report import markdown_summary
from attnzoo.bench.timing import summarize
from attnzoo.ops import dispatch
from attnzoo.ops.softmax.reference import softmax_attention
from tests import benchmark_scripts

pytestmark = pytest.mark.usefixtures("one_thread")


TINY = dict(seq_lens=[8, 16], batch_tokens=32, head_dim=8, heads=[2], warmup=1, min_repeats=2, max_repeats=2,
            target_seconds=0.0)


def tiny(**kw) -> BenchConfig:
    return BenchConfig(**{**TINY, **kw})


@pytest.fixture(scope="module")
def result():
    cfg = tiny(variants=["softmax", "linear", "masked", "multihead(kind='relu')"],
               backends=["reference", "auto", "sdpa", "torch-mha"], modes=["fwd", "fwd+bwd"])
    return run(cfg, progress=False)


def _rows(res, **match):
    return [r for r in res["results"] if all(r[k] == v for k, v in match.items())]


def test_result_follows_schema_and_survives_json(result):
    validate(result)
    again = json.loads(json.dumps(result))
    assert validate(again)["results"] == result["results"]
    env = result["environment"]
    assert env["device_type"] == "cpu" and env["torch"] == torch.__version__
    assert result["settings"]["batch_tokens"] == 32


@pytest.mark.parametrize("variant,backend", [("softmax", "reference"), ("softmax", "auto"), ("softmax", "sdpa"),
                                             ("linear", "reference"), ("linear", "auto"), ("masked", "reference"),
                                             ("masked", "sdpa"), ("multihead(kind='relu')", "reference")])
@pytest.mark.parametrize("n", [8, 16])
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_every_combination_measured(result, variant, backend, n, mode):
    (row,) = _rows(result, variant=variant, backend=backend, seq_len=n, mode=mode)
    assert row["status"] == "ok", row["reason"]
    assert row["batch"] == 32 // n and row["heads"] == 2 and row["dtype"] == "float32"
    assert row["causal"] == (variant == "masked")
    t = row["time_s"]
    assert t["n"] == 2 and 0 < t["min"] <= t["median"] <= t["max"]
    name = variant.split("(")[0]
    kw = {"kind": "relu"} if name == "multihead" else {}
    assert row["flops"] == flops(name, Shape(32 // n, 2, n, 8), mode, causal=row["causal"], **kw)
    assert row["tflops"] == pytest.approx(row["flops"] / t["median"] / 1e12)
    assert row["tokens_per_s"] == pytest.approx(32 / t["median"])
    assert row["peak_memory_bytes"] > 0
    assert row["ratio_time_vs_sdpa"] > 0
    if backend == "auto":
        assert row["resolved_backend"] in dispatch.backends("relu" if name == "multihead" else
                                                            "softmax" if name == "masked" else name)


def test_sdpa_anchor_ratio_is_one(result):
    for row in _rows(result, backend="sdpa"):
        assert row["ratio_time_vs_sdpa"] == 1.0 and row["ratio_memory_vs_sdpa"] == 1.0


def test_baselines_recorded_even_when_missing(result):
    # torch.nn.MultiheadAttention is softmax only: recorded as unsupported for kind='relu'
    for row in _rows(result, backend="torch-mha"):
        assert row["status"] == "unsupported" and "softmax" in row["reason"]


def test_memory_of_fwd_bwd_exceeds_fwd(result):
    for n in (8, 16):
        fwd, = _rows(result, variant="softmax", backend="reference", seq_len=n, mode="fwd")
        both, = _rows(result, variant="softmax", backend="reference", seq_len=n, mode="fwd+bwd")
        assert both["peak_memory_bytes"] > fwd["peak_memory_bytes"]


# ---- memory tracker -------------------------------------------------------------------------------

MEMORY_CASES = [
    # (name, function of a pre-existing (64, 32) float32 tensor x, expected peak bytes)
    ("one new tensor", lambda x: x * 2, 64 * 32 * 4),
    ("view of an input is free", lambda x: x.view(32, 64).t(), 0),
    ("in-place on an input is free", lambda x: x.mul_(1.0), 0),
    # each x + 1 is freed once summed; the three 4-byte sums stay in the list
    ("temporaries freed before the next", lambda x: [(x + 1).sum() for _ in range(3)], 64 * 32 * 4 + 3 * 4),
    ("two live at once", lambda x: (x + 1, x + 2), 2 * 64 * 32 * 4),
    ("matmul", lambda x: x @ x.t(), 64 * 64 * 4),
]


@pytest.mark.parametrize("name,fn,expected", MEMORY_CASES, ids=[c[0] for c in MEMORY_CASES])
def test_live_tensor_bytes(name, fn, expected):
    x = torch.randn(64, 32)
    tracker = LiveTensorBytes()
    with tracker:
        out = fn(x)
    del out
    assert tracker.peak == expected


def test_live_tensor_bytes_sees_autograd_saved_tensors():
    q = torch.randn(1, 1, 32, 8, requires_grad=True)
    tracker = LiveTensorBytes()
    with tracker:
        out = softmax_attention(q, q, q, scale=0.5)
        torch.autograd.grad(out, q, torch.ones_like(out))
    # logits and weights (32 x 32 fp32 each) are alive together before backward frees them
    assert tracker.peak >= 2 * 32 * 32 * 4
    assert tracker.current <= 2 * 32 * 8 * 4  # only the output and the gradient are left


# ---- failures are rows, not crashes ------------------------------------------------------------------

def _fake(exc=None, supports=None):
    def fn(q, k, v, **kw):
        if exc is not None:
            raise exc
        return softmax_attention(q, k, v, **kw)
    return dispatch.Backend("fake", fn, supports or (lambda *a, **k: None), priority=-1, description="test double")


FAILURES = [
    ("cuda oom", _fake(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")), "oom",
     "out of memory"),
    ("cpu allocator", _fake(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
                                         "memory: you tried to allocate 274877906944 bytes")), "oom", "allocate"),
    ("generic runtime oom", _fake(RuntimeError("out of memory")), "oom", "out of memory"),
    ("python MemoryError", _fake(MemoryError()), "oom", "MemoryError"),
    ("supports refuses", _fake(supports=lambda q, k, v, **kw: "fake needs head_dim >= 128"), "unsupported",
     "fake needs head_dim >= 128"),
    ("not implemented", _fake(NotImplementedError("fake has no backward")), "unsupported", "no backward"),
    ("bug", _fake(ZeroDivisionError("boom")), "error", "ZeroDivisionError: boom"),
]


@pytest.mark.parametrize("name,backend,status,reason", FAILURES, ids=[f[0] for f in FAILURES])
def test_failures_are_recorded(monkeypatch, name, backend, status, reason):
    monkeypatch.setitem(dispatch._TABLE["softmax"], "fake", backend)
    res = run(tiny(variants=["softmax", "relu"], backends=["fake", "reference"], seq_lens=[8], modes=["fwd"]),
              progress=False)
    validate(res)
    (row,) = _rows(res, variant="softmax", backend="fake")
    assert row["status"] == status and reason in row["reason"]
    assert row["time_s"] is None and row["ratio_time_vs_sdpa"] is None
    # the run went on after the failure
    (after,) = _rows(res, variant="relu", backend="reference")
    assert after["status"] == "ok"


def test_unavailable_libraries_recorded():
    res = run(tiny(variants=["softmax", "linear"], backends=["flash-attn", "fla"], seq_lens=[8], modes=["fwd"]),
              progress=False)
    import importlib.util
    for backend, module in (("flash-attn", "flash_attn"), ("fla", "fla")):
        (row,) = _rows(res, backend=backend)
        if importlib.util.find_spec(module) is None:
            assert row["status"] == "unavailable" and "not installed" in row["reason"]
        else:
            assert row["status"] in ("ok", "unsupported")


def test_slow_rows_are_measured_then_predicted_and_skipped():
    res = run(tiny(variants=["softmax"], backends=["reference"], seq_lens=[8, 64], modes=["fwd"],
                   max_call_seconds=1e-9), progress=False)
    (first,) = _rows(res, backend="reference", seq_len=8)
    (second,) = _rows(res, backend="reference", seq_len=64)
    assert first["status"] == "skipped" and "measured" in first["reason"] and first["time_s"] is None
    assert first["first_call_s"] > 0
    assert second["status"] == "skipped" and "predicted" in second["reason"]


def test_rows_slower_than_once_above_are_timed_once():
    res = run(tiny(variants=["softmax"], backends=["reference"], seq_lens=[8], modes=["fwd"],
                   once_above_seconds=1e-9), progress=False)
    (row,) = _rows(res, backend="reference")
    assert row["status"] == "ok" and "timed once" in row["reason"] and row["time_s"]["n"] == 1
    assert row["first_call_s"] > 0 and row["peak_memory_bytes"] > 0


def test_slow_rows_run_once_with_time_and_memory_from_one_call():
    res = run(tiny(variants=["softmax"], backends=["reference"], seq_lens=[8, 16], modes=["fwd+bwd"],
                   once_above_seconds=1e-9), progress=False)
    (second,) = _rows(res, backend="reference", seq_len=16)
    (normal,) = [r for r in run(tiny(variants=["softmax"], backends=["reference"], seq_lens=[16], modes=["fwd+bwd"]),
                                progress=False)["results"] if r["backend"] == "reference"]
    assert second["status"] == "ok" and "run once" in second["reason"] and second["time_s"]["n"] == 1
    assert second["peak_memory_bytes"] == normal["peak_memory_bytes"]  # same call, same tensors


def test_time_budget_skips_the_rest():
    res = run(tiny(variants=["softmax", "relu"], backends=["reference", "auto"], seq_lens=[8], modes=["fwd"],
                   budget_seconds=0.0), progress=False)
    validate(res)
    assert res["results"] and all(r["status"] == "skipped" and "budget" in r["reason"] for r in res["results"])


def test_auto_rows_run_first_and_share_their_measurement(result):
    from attnzoo.bench.runner import plan
    order = [t.backend for _, t in plan(tiny(variants=["softmax", "relu"], backends=["reference", "auto", "sdpa"]))]
    last_first_pass = max(i for i, b in enumerate(order) if b == "auto")
    assert all(b in ("auto", "sdpa") for b in order[:last_first_pass + 1])
    for auto in _rows(result, backend="auto"):
        (named,) = _rows(result, variant=auto["variant"], backend=auto["resolved_backend"], seq_len=auto["seq_len"],
                         mode=auto["mode"]) or [None]
        if named is not None:
            assert named["shared_with"] == f"{auto['variant']}/auto" and named["time_s"] == auto["time_s"]


def test_huge_reference_rows_are_skipped_before_running():
    res = run(tiny(variants=["ot"], backends=["reference", "cpu"], seq_lens=[16], modes=["fwd"],
                   max_memory_gb=1e-6), progress=False)
    (ref,) = _rows(res, backend="reference")
    assert ref["status"] == "skipped" and "estimated peak" in ref["reason"]


def test_interpreted_triton_is_skipped_unless_asked(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("ATTNZOO_BENCH_INTERPRETER", raising=False)
    if "triton" not in dispatch.backends("softmax"):
        pytest.skip("no triton backend registered for softmax")
    res = run(tiny(variants=["softmax"], backends=["triton"], seq_lens=[8], modes=["fwd"]), progress=False)
    (row,) = _rows(res, backend="triton")
    assert row["status"] in ("skipped", "unsupported") and "interpreter" in row["reason"].lower()


# ---- outputs ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def written(result, tmp_path_factory):
    """The tiny run written once, where the CPU sweep puts its files (plots take seconds)."""
    root = tmp_path_factory.mktemp("repo")
    return root, write_outputs(result, root / "benchmarks" / "results" / "cpu", "bench_cpu")


def test_outputs_written(result, written):
    _, files = written
    assert load(files["json"])["results"] == result["results"]
    names = sorted(p.name for p in files["plots"])
    assert names == sorted(f"bench_cpu_{m}_{mode}_float32.png" for m in ("time", "memory")
                           for mode in ("fwd", "fwd_bwd"))
    for p in files["plots"]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    md = files["markdown"].read_text()
    assert "| variant | backend | N=8 | N=16 |" in md
    assert md.count("| softmax | reference |") >= 2  # summary table of each mode


def test_markdown_shows_status_and_reason(monkeypatch):
    monkeypatch.setitem(dispatch._TABLE["softmax"], "fake", _fake(supports=lambda *a, **k: "fake | refuses"))
    res = run(tiny(variants=["softmax"], backends=["fake"], seq_lens=[8], modes=["fwd"]), progress=False)
    md = markdown_summary(res["results"])
    assert "| softmax | fake | n/a [1] |" in md
    assert "1. backend='fake' cannot run this softmax call: fake \\| refuses" in md
    assert "x)" in markdown_report(res)  # the SDPA row carries its ratio


# ---- compare ---------------------------------------------------------------------------------------

def _scaled(res, factor_by_backend):
    new = copy.deepcopy(res)
    for row in new["results"]:
        f = factor_by_backend.get(row["backend"])
        if f and row["status"] == "ok":
            row["time_s"] = {k: (v * f if k != "n" else v) for k, v in row["time_s"].items()}
    return new


def test_compare_flags_speedups_and_regressions(result):
    new = _scaled(result, {"reference": 0.5, "sdpa": 2.0})
    changes, only_old, only_new = compare(result, new)
    assert not only_old and not only_new and len(changes) == len(result["results"])
    for c in changes:
        if c.new["status"] != "ok":
            assert c.verdict(0.1) == "same status"
        elif c.key[1] == "reference":
            assert c.speedup == pytest.approx(2.0) and c.verdict(0.1) == "faster"
        elif c.key[1] == "sdpa":
            assert c.speedup == pytest.approx(0.5) and c.verdict(0.1) == "REGRESSION"
    md = markdown_compare(result, new)
    assert "REGRESSION" in md and "faster" in md and "Summary:" in md


def test_compare_status_change_and_missing_rows(result):
    new = copy.deepcopy(result)
    row = next(r for r in new["results"] if r["backend"] == "reference")
    row.update(status="oom", reason="RuntimeError: out of memory", time_s=None)
    new["results"] = [r for r in new["results"] if r["variant"] != "linear"]
    changes, only_old, only_new = compare(result, new)
    assert any(c.verdict(0.1) == "ok -> oom" for c in changes)
    assert only_old and all(k[0] == "linear" for k in only_old) and not only_new


# ---- schema, config and timing ----------------------------------------------------------------------

@pytest.mark.parametrize("mutate,match", [
    (lambda r: r.pop("environment"), "environment"),
    (lambda r: r.update(schema="other/9"), "schema"),
    (lambda r: r["results"][0].update(status="fine"), "status"),
    (lambda r: r["results"][0].update(seq_len="8"), "seq_len"),
    (lambda r: r["results"][0].update(mode="bwd"), "mode"),
    (lambda r: r["results"][0].update(time_s=None), "time_s"),
    (lambda r: r["results"][0].update(status="oom", reason=None), "reason"),
])
def test_schema_rejects_bad_results(result, mutate, match):
    bad = copy.deepcopy(result)
    mutate(bad)
    with pytest.raises(ValueError, match=match):
        validate(bad)


@pytest.mark.parametrize("kw,match", [
    (dict(dtypes=["float8"]), "dtype"),
    (dict(modes=["bwd"]), "mode"),
    (dict(seq_lens=[]), "seq_lens"),
    (dict(heads=[0]), "heads"),
    (dict(variants=["nope"]), "unknown attention variant"),
    (dict(head_dim=0), "head_dim"),
    (dict(min_repeats=5, max_repeats=2), "max_repeats"),
])
def test_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kw).validate()


def test_dtype_aliases():
    assert tiny(dtypes=["bf16", "fp32", "Float16"]).validate().dtypes == ["bfloat16", "float32", "float16"]
    with pytest.raises(SystemExit):
        cli.main(["bench", "--dtype", "int8", "--compare", "x.json", "y.json"])


def test_summarize_quantiles():
    t = summarize([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (t.median, t.min, t.max, t.n) == (3.0, 1.0, 5.0, 5)
    assert t.p20 == pytest.approx(1.8) and t.p80 == pytest.approx(4.2)
    assert t.std == pytest.approx(1.5811388, rel=1e-6)


# ---- command line ----------------------------------------------------------------------------------

def test_cli_runs_writes_and_compares(tmp_path, capsys):
    args = ["bench", "--variants", "softmax", "relu", "--backends", "reference", "--seq-lens", "8", "--batch-tokens",
            "16", "--head-dim", "4", "--heads", "2", "--mode", "fwd", "--min-repeats", "1", "--repeats", "1",
            "--target-seconds", "0", "--quiet"]
    assert cli.main(args + ["--out", str(tmp_path / "a")]) == 0
    first = load(tmp_path / "a" / "bench.json")
    assert {(r["variant"], r["backend"]) for r in first["results"]} == {
        ("softmax", "sdpa"), ("softmax", "reference"), ("relu", "reference")}
    assert (tmp_path / "a" / "bench.md").exists() and (tmp_path / "a" / "bench_time_fwd_float32.png").exists()
    assert cli.main(args + ["--out", str(tmp_path / "b"), "--compare", str(tmp_path / "a" / "bench.json")]) == 0
    assert "speed-up" in (tmp_path / "b" / "bench_compare.md").read_text()
    capsys.readouterr()
    assert cli.main(["bench", "--compare", str(tmp_path / "a" / "bench.json"), str(tmp_path / "b" / "bench.json")]) == 0
    out = capsys.readouterr().out
    assert "compare" in out and "softmax" in out


def test_cli_compare_rejects_bad_json(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli.main(["bench", "--compare", str(bad), str(bad)]) == 2  # one error line, no traceback
    assert "not valid JSON" in capsys.readouterr().err


# ---- generated README section -----------------------------------------------------------------------

def test_docs_rendered_from_results(result, written):
    render = benchmark_scripts.load("readme_pages").render
    tmp_path, files = written
    doc = tmp_path / "docs" / "bench.md"
    text = render((result, files["json"]), None, doc)
    assert text.startswith("<!-- generated by benchmarks/render_readme.py from ../benchmarks/results/cpu/bench_cpu.json")
    assert "None committed: `benchmarks/gpu_speed.py`" in text
    assert "![bench_cpu_time_fwd_float32](../benchmarks/results/cpu/bench_cpu_time_fwd_float32.png)" in text
    # the headline names, per variant, the fastest measured attnzoo backend at the largest N
    for variant in ("softmax", "linear", "masked", "multihead(kind='relu')"):
        assert f"| {variant} | fwd+bwd | 16 |" in text
    for forward in result["flop_conventions"]["forward"].values():
        assert forward.replace("|", "\\|") in text  # escaped inside the Markdown table
    GpuSection = benchmark_scripts.load("readme_pages").GpuSection
    gpu = GpuSection(device="Fake GPU 80GB", summary="| path | x |", cost_model="| call | y |",
                     source=tmp_path / "benchmarks" / "results" / "gpu" / "fake" / "speed.md")
    text = render((result, files["json"]), gpu, doc)
    assert "### GPU results: Fake GPU 80GB" in text and "| path | x |" in text and "| call | y |" in text
    assert "(../benchmarks/results/gpu/fake/speed.md)" in text
    assert "None committed" not in text
