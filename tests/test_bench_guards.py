"""The harness's guards for runs on a lent GPU, checked on CPU with tiny shapes and fake backends
that sleep: the first/second-call timing rule, the per-call time limit, the time budget, the row
log (JSONL) written as rows finish and the result rebuilt from it, --skip-backends, the plain
line per row. Not speed."""
from __future__ import annotations

import itertools
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from attnzoo import cli
from attnzoo.bench import BenchConfig, load, run, validate
from attnzoo.bench.guard import CallInterrupted, interrupt_after
from attnzoo.bench.rowlog import RowLog, load_rowlog
from attnzoo.bench.runner import plan
from attnzoo.bench.timing import CallTooSlow, TimingRule, time_call
from attnzoo.ops import dispatch
from attnzoo.ops.softmax.reference import softmax_attention

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


TINY = dict(seq_lens=[8], batch_tokens=16, head_dim=4, heads=[1], modes=["fwd"], warmup=1, min_repeats=2,
            max_repeats=2, target_seconds=0.0, measure_memory=False)


def tiny(**kw) -> BenchConfig:
    return BenchConfig(**{**TINY, **kw})


def _rows(res, **match):
    return [r for r in res["results"] if all(r[k] == v for k, v in match.items())]


def _sleeping_backend(seconds_per_call):
    """A softmax backend that sleeps seconds_per_call(i) before call i (0-based), then computes."""
    calls = itertools.count()

    def fn(q, k, v, **kw):
        time.sleep(seconds_per_call(next(calls)))
        return softmax_attention(q, k, v, **kw)
    return dispatch.Backend("sleepy", fn, lambda *a, **k: None, priority=-1, description="test double")


@pytest.fixture
def sleepy(monkeypatch):
    def install(seconds_per_call):
        monkeypatch.setitem(dispatch._TABLE["softmax"], "sleepy", _sleeping_backend(seconds_per_call))
    return install


# ---- the timing rule, on a function whose calls take known times ------------------------------------

def _sleeper(durations):
    it = iter(durations)

    def fn():
        time.sleep(next(it, durations[-1]))
    return fn


# (name, call durations, rule, expected method, expected number of samples)
RULE_CASES = [
    ("first call compiles, the rest is fast", [0.25, 0.0], TimingRule(min_repeats=3, target_seconds=0), "repeats", 3),
    ("slow second call is the only sample", [0.0, 0.06], TimingRule(once_above_seconds=0.03), "once", 1),
    ("extra warm-ups are not samples", [0.2, 0.2, 0.0], TimingRule(warmup=2, min_repeats=2, max_repeats=2,
                                                                 target_seconds=0), "repeats", 2),
]


@pytest.mark.parametrize("name,durations,rule,method,n", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_timing_rule(name, durations, rule, method, n):
    timing = time_call(_sleeper(durations), "cpu", rule)
    assert timing.method == method and timing.stats.n == n
    assert timing.first_call_s >= durations[0]
    # the first (compiling) call is never a sample: every sample is near the steady duration
    steady = durations[-1] if method == "repeats" else durations[1]
    assert steady <= timing.stats.min and timing.stats.max < steady + 0.15


def test_timing_rule_stops_at_a_slow_second_call():
    with pytest.raises(CallTooSlow) as e:
        time_call(_sleeper([0.0, 0.08, 10.0]), "cpu", TimingRule(max_call_seconds=0.04))
    assert e.value.seconds >= 0.08 and e.value.first_call_s < 0.08  # stopped before the 10 s call


def test_eager_call_stops_at_a_slow_first_call():
    with pytest.raises(CallTooSlow) as e:
        time_call(_sleeper([0.08, 10.0]), "cpu", TimingRule(max_call_seconds=0.04), eager=True)
    assert e.value.from_first and e.value.seconds >= 0.08


def test_slow_reference_rows_skipped_after_one_call():
    res = run(tiny(variants=["softmax"], backends=["reference"], max_call_seconds=1e-9), progress=False)
    (row,) = _rows(res, backend="reference")
    assert row["status"] == "skipped" and "first call of the eager reference" in row["reason"]


def test_probe_runs_as_second_call_and_is_not_a_sample():
    counts = []

    def probe(first_call_s):
        def second():
            counts.append(first_call_s)
            time.sleep(0.2)  # the probe's own overhead: must not show in the samples
            return 123
        return second
    timing = time_call(_sleeper([0.0]), "cpu", TimingRule(min_repeats=2, max_repeats=2, target_seconds=0),
                       probe=probe)
    assert timing.probed == 123 and len(counts) == 1 and timing.stats.n == 2 and timing.stats.max < 0.15


class _FakeEvent:
    """torch.cuda.Event stand-in: records the host clock (the fake 'device' is synchronous)."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


@pytest.fixture
def fake_cuda(monkeypatch):
    """The CUDA branches of time_call on a CPU machine: synchronize, events and do_bench replaced."""
    import triton.testing
    bench_calls = []

    def do_bench(fn, warmup, rep, return_mode):
        bench_calls.append(return_mode)
        fn()
        return [1.0, 2.0, 3.0]  # ms
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    return bench_calls


def test_cuda_fast_calls_go_to_do_bench(fake_cuda):
    timing = time_call(_sleeper([0.1, 0.0]), "cuda", TimingRule(slow_call_seconds=0.05))
    assert timing.method == "do_bench" and fake_cuda == ["all"]
    assert timing.stats.median == pytest.approx(2e-3) and timing.first_call_s >= 0.1


def test_cuda_slow_calls_use_a_few_event_repeats(fake_cuda):
    timing = time_call(_sleeper([0.0, 0.06]), "cuda", TimingRule(slow_call_seconds=0.03, min_repeats=3,
                                                                 target_seconds=0))
    assert timing.method == "repeats" and not fake_cuda and timing.stats.n == 3
    assert 0.06 <= timing.stats.min < 0.2  # every sample, events included, is the 0.06 s call


# ---- the hard per-call limit -------------------------------------------------------------------------

def test_interrupt_after_cuts_a_call_and_restores_an_outer_timer():
    fired = []
    before = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    before_timer = signal.setitimer(signal.ITIMER_REAL, 60.0)  # pytest-timeout's, if it runs with signals
    try:
        start = time.perf_counter()
        with pytest.raises(CallInterrupted) as e:
            with interrupt_after(0.1):
                time.sleep(5)
        assert 0.09 <= e.value.seconds < 2 and time.perf_counter() - start < 2
        with interrupt_after(5.0):
            pass
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 55 < left <= 60  # the outer timer (pytest-timeout's, say) goes on with what it had left
        assert not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
        if before_timer[0] > 0:
            signal.setitimer(signal.ITIMER_REAL, *before_timer)


def test_a_call_past_call_timeout_is_interrupted_and_the_run_goes_on(sleepy):
    sleepy(lambda i: 30.0)
    start = time.perf_counter()
    res = run(tiny(variants=["softmax", "relu"], backends=["sleepy", "reference"], seq_lens=[8, 16],
                   call_timeout_seconds=0.2), progress=False)
    assert time.perf_counter() - start < 10
    validate(res)
    first, second = _rows(res, backend="sleepy")
    assert first["status"] == "skipped" and "interrupted" in first["reason"] and "call_timeout_seconds" in first["reason"]
    # not tried again at the larger N: that would cost another call_timeout_seconds
    assert second["status"] == "skipped" and "smaller N was interrupted" in second["reason"]
    for after in _rows(res, variant="relu", backend="reference"):
        assert after["status"] == "ok"


# ---- the slow-call guard and the budget in a run ------------------------------------------------------

def test_slow_step_is_skipped_with_its_measured_time(sleepy):
    sleepy(lambda i: 0.08)
    res = run(tiny(variants=["softmax"], backends=["sleepy"], max_call_seconds=0.04), progress=False)
    validate(res)
    (row,) = _rows(res, backend="sleepy")
    assert row["status"] == "skipped" and row["time_s"] is None
    measured = float(re.search(r"measured ([0-9.e+-]+) s per call", row["reason"]).group(1))
    assert measured >= 0.08 and "max_call_seconds=0.04" in row["reason"]
    assert row["first_call_s"] >= 0.08


def test_compiling_first_call_is_recorded_not_timed(sleepy):
    sleepy(lambda i: 0.3 if i == 0 else 0.0)
    res = run(tiny(variants=["softmax"], backends=["sleepy"]), progress=False)
    (row,) = _rows(res, backend="sleepy")
    assert row["status"] == "ok" and row["first_call_s"] >= 0.3 and row["time_s"]["max"] < 0.15


def test_budget_is_honoured_mid_row(sleepy):
    sleepy(lambda i: 0.2)
    start = time.perf_counter()
    res = run(tiny(variants=["softmax"], backends=["sleepy", "reference"], seq_lens=[8, 16], budget_seconds=0.3),
              progress=False)
    elapsed = time.perf_counter() - start
    validate(res)
    assert elapsed < 0.3 + 2.0  # without the budget: 2 rows x >= 4 calls x 0.2 s
    first, second = _rows(res, backend="sleepy")
    assert first["status"] == "skipped" and "interrupted" in first["reason"] and "budget" in first["reason"]
    assert second["status"] == "skipped" and "budget" in second["reason"]


def test_skip_backends_and_an_auto_pick_left_out():
    base = run(tiny(variants=["relu"], backends=["auto"]), progress=False)
    (auto,) = _rows(base, backend="auto")
    picked = auto["resolved_backend"]
    res = run(tiny(variants=["relu"], skip_backends=[picked, "sdpa-math"]), progress=False)
    validate(res)
    assert not _rows(res, backend=picked) and not _rows(res, backend="sdpa-math")
    (auto,) = _rows(res, backend="auto")
    assert auto["status"] == "skipped" and picked in auto["reason"] and "skip_backends" in auto["reason"]


def test_compiling_targets_are_planned_after_every_other_row():
    order = plan(tiny(variants=["softmax", "l2", "fenchel"], seq_lens=[8, 16], modes=["fwd", "fwd+bwd"], device="cuda"))
    compiles = [getattr(t, "compiles", False) for _, t in order]
    assert any(compiles) and compiles == sorted(compiles)  # all False ones, then all True ones
    assert {t.backend for _, t in order if getattr(t, "compiles", False)} == {"torch-flex", "flex"}


def test_recompile_limits_raised_during_the_run_only(monkeypatch):
    import torch._dynamo.config as dynamo_config
    seen = []
    monkeypatch.setitem(dispatch._TABLE["softmax"], "sleepy", _sleeping_backend(lambda i: 0.0))
    original = dispatch._TABLE["softmax"]["sleepy"].fn

    def fn(q, k, v, **kw):
        seen.append(dynamo_config.cache_size_limit)
        return original(q, k, v, **kw)
    monkeypatch.setattr(dispatch._TABLE["softmax"]["sleepy"], "fn", fn)
    before = dynamo_config.cache_size_limit
    run(tiny(variants=["softmax"], backends=["sleepy"]), progress=False)
    assert seen and min(seen) >= 512 and dynamo_config.cache_size_limit == before


def test_flex_attention_compiled_once_per_process(monkeypatch):
    from attnzoo.ops.kernels import flex
    compiles = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiles.append(kw) or fn)
    flex.compiled_flex_attention.cache_clear()
    try:
        assert flex.compiled_flex_attention() is flex.compiled_flex_attention()
        assert compiles == [{"dynamic": False}]
    finally:
        flex.compiled_flex_attention.cache_clear()  # the real torch.compile next time


# ---- the row log --------------------------------------------------------------------------------------

CONFIG = dict(variants=["softmax", "relu"], backends=["reference", "auto"], seq_lens=[8, 16])


def test_row_log_written_as_rows_finish_and_rebuilt(tmp_path):
    path = tmp_path / "run.jsonl"
    lines_seen = []
    with RowLog(path) as log:
        def on_row(row):
            log.row(row)
            lines_seen.append(len(path.read_text().splitlines()))  # read back by another reader, mid-run
        result = run(tiny(**CONFIG), progress=False, on_start=log.start, on_row=on_row)
    n = len(result["results"])
    assert lines_seen == list(range(2, n + 2))  # header + every finished row, on disk at once
    rebuilt = load_rowlog(path)
    assert rebuilt["results"] == result["results"]  # ratios included
    assert rebuilt["settings"]["complete"] and rebuilt["settings"]["rows_logged"] == n
    assert rebuilt["environment"]["device_type"] == "cpu"


def _logged_run(tmp_path, rows_kept=None, tail=""):
    path = tmp_path / "run.jsonl"
    with RowLog(path) as log:
        run(tiny(**CONFIG), progress=False, on_start=log.start, on_row=log.row)
    if rows_kept is not None:
        lines = path.read_text().splitlines()
        path.write_text("\n".join(lines[:1 + rows_kept]) + "\n" + tail)
    return path


def test_row_log_of_a_killed_run(tmp_path):
    path = _logged_run(tmp_path, rows_kept=3, tail='{"variant": "softm')  # killed while writing row 4
    rebuilt = load_rowlog(path)
    validate(rebuilt)
    assert len(rebuilt["results"]) == 3 and not rebuilt["settings"]["complete"]
    assert rebuilt["settings"]["planned_rows"] > 3


@pytest.mark.parametrize("text,match", [
    ("", "header"),
    ('{"variant": "softmax"}\n', "header"),
    ("{}\n{not json\n{}\n", "line 2"),
])
def test_row_log_rejects_broken_files(tmp_path, text, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_rowlog(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_rowlog(tmp_path / "missing.jsonl")


# ---- command line ---------------------------------------------------------------------------------------

CLI = ["bench", "--variants", "softmax", "relu", "--backends", "reference", "auto", "sdpa-math", "--seq-lens", "8",
       "--batch-tokens", "16", "--head-dim", "4", "--heads", "1", "--mode", "fwd", "--min-repeats", "1",
       "--repeats", "1", "--target-seconds", "0", "--no-memory"]


def test_cli_prints_a_line_per_row_and_keeps_a_row_log(tmp_path, capsys):
    assert cli.main(CLI + ["--out", str(tmp_path), "--skip-backends", "sdpa-math,torch-flex"]) == 0
    out = capsys.readouterr().out
    result = load(tmp_path / "bench.json")
    assert not _rows(result, backend="sdpa-math")
    row_lines = [line for line in out.splitlines() if re.match(r"\[\s*[0-9.]+s\] ", line)]
    assert len(row_lines) == len(result["results"])
    for row, line in zip(result["results"], row_lines):
        assert row["variant"] in line and f"N={row['seq_len']}" in line and row["status"] in line
    assert len((tmp_path / "bench.jsonl").read_text().splitlines()) == 1 + len(result["results"])
    assert cli.main(CLI + ["--out", str(tmp_path / "quiet"), "--quiet"]) == 0
    assert not re.search(r"^\[\s*[0-9.]+s\] ", capsys.readouterr().out, re.M)


def test_cli_rebuilds_from_a_row_log(tmp_path, capsys):
    path = _logged_run(tmp_path, rows_kept=2, tail="{")
    assert cli.main(["bench", "--from-jsonl", str(path), "--out", str(tmp_path / "rebuilt")]) == 0
    result = load(tmp_path / "rebuilt" / "run.json")
    assert len(result["results"]) == 2 and not result["settings"]["complete"]
    assert (tmp_path / "rebuilt" / "run.md").exists()
    assert "partial" in capsys.readouterr().out
