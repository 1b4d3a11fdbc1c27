"""benchmarks/gpu_speed.py (benchmarks/gpu_run/session.py), the one GPU measurement, run on CPU with tiny
shapes and tiny models (its own code, not speed): rows for every case, the summary and full Markdown,
the measured ranking table auto reads, extrapolated skips, the models phase and its mirror of the
logs, and the device-call wrapper's syntax."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from attnzoo.bench import report
from attnzoo.bench import speed_grid as C
from attnzoo.bench.extrapolate import Extrapolation
from attnzoo.bench.flops import flops
from attnzoo.bench.ranking import measured_table

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def _gpu_speed():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_speed", ROOT / "benchmarks" / "gpu_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)   # the entry point's imports; main runs only as a script
    return module


def test_cpu_dry_run_writes_every_output(tmp_path):
    gpu_speed = _gpu_speed()
    args = ["--device", "cpu", "--head-dims", "8", "--seq-lens", "16", "32", "--causal", "no", "--tokens", "64",
            "--hidden", "16", "--phases", "speed", "--budget-seconds", "120", "--out", str(tmp_path),
            "--only", "sdpa", "l2 / torch", "l2 / cpu", "fenchel+log_u / torch"]
    assert gpu_speed.main(args, extra=(gpu_speed.PAPER,)) == 0
    rows = json.loads((tmp_path / "speed.json").read_text())["rows"]
    assert {r["case"] for r in rows} == {"sdpa", "l2 / torch", "l2 / cpu", "fenchel+log_u / torch"}
    assert all(r.get("fwd", 0) > 0 and r.get("fwd+bwd", 0) > 0 for r in rows), rows
    table = json.loads((tmp_path / "measured_table.json").read_text())
    l2 = [e for e in table["entries"] if e["variant"] == "l2" and e["n"] == 32 and e["direction"] == "fwd+bwd"]
    assert len(l2) == 1 and sorted(l2[0]["ranking"]) == ["cpu", "torch"]
    assert l2[0]["ranking"][0] == min(l2[0]["ms"], key=l2[0]["ms"].get)
    md = (tmp_path / "speed.md").read_text()
    assert "## Summary" in md and "| l2 |" in md and "D8 N32" in md
    assert [json.loads(line)["case"] for line in (tmp_path / "rows.jsonl").read_text().splitlines()] == \
        [r["case"] for r in rows]  # every row flushed as it finished


def test_cpu_dry_run_of_the_models_phase_writes_and_mirrors_every_case(tmp_path):
    gpu_speed = _gpu_speed()
    mirror = tmp_path / "out"
    args = ["--device", "cpu", "--phases", "models", "--budget-seconds", "120", "--out", str(tmp_path / "results"),
            "--mirror", str(mirror), "--models", "vit_s", "llama", "--model-variants", "l2",
            "--model-modes", "eager", "cudagraphs"]
    assert gpu_speed.main(args, extra=(gpu_speed.PAPER,)) == 0
    result = json.loads((tmp_path / "results" / "models.json").read_text())
    cases = [(r["model"], r["attention"], r["mode"], r["status"]) for r in result["results"]]
    assert cases == [("vit_s", "own", "eager", "ok"), ("vit_s", "l2", "eager", "ok"),
                     ("vit_s", "own", "cudagraphs", "skipped"), ("vit_s", "l2", "cudagraphs", "skipped"),
                     ("llama", "own", "eager", "ok"), ("llama", "l2", "eager", "ok"),
                     ("llama", "own", "cudagraphs", "skipped"), ("llama", "l2", "cudagraphs", "skipped")]
    # the device call's $OUT gets the log and every case as it finishes, then the report
    logged = (mirror / "models.jsonl").read_text().splitlines()
    assert json.loads(logged[0])["schema"] == result["schema"] and len(logged) == 1 + len(cases)
    assert "models vit_s" in (mirror / "log.txt").read_text()
    assert "## Throughput" in (mirror / "models.md").read_text()
    assert not (mirror / "rows.jsonl").exists()  # $OUT holds few files: the kernel rows go in the tarball


def _row(case, n, fwd, bwd, variant=None, backend=None, causal=False):
    return {"case": case, "table_variant": variant, "flavour": "plain", "backend": backend or case, "batch": 1,
            "heads": 1, "n": n, "head_dim": 64, "causal": causal, "dtype": "bfloat16", "fwd": fwd, "fwd+bwd": bwd}


def test_ranking_and_summary_from_rows():
    rows = [_row("sdpa", 4096, 1.0, 3.0), _row("l2 / torch", 4096, 1.25, 3.5, "l2", "torch"),
            _row("l2 / triton", 4096, 2.0, 3.0, "l2", "triton")]
    table = measured_table(rows, {"name": "x", "capability": [9, 0], "torch": "t"})
    rank = {e["direction"]: e["ranking"] for e in table["entries"]}
    assert rank == {"fwd": ["torch", "triton"], "fwd+bwd": ["triton", "torch"]}
    summary = report.speed_summary_markdown(rows)
    assert "| l2 | 0.80 (torch) | 1.00 (triton) |" in summary  # SDPA time / fastest attnzoo time


def test_hopeless_rows_are_predicted_from_smaller_n():
    # the one extrapolation rule (attnzoo bench and the GPU run): the largest smaller N, scaled by FLOPs
    problems = C.benchmark_problems([64, 128], [1024, 4096], [False], 16384, 2048, torch.bfloat16, "cpu")
    small, big, other_d = problems[0], problems[1], problems[3]
    work = {p: flops("l2", p.shape, "fwd+bwd") for p in problems}
    measured = Extrapolation()
    measured.record(("x", 64), small.shape.seq_q, work[small], 10.0)
    # 4x fewer rows of 16x the cost: 4x the FLOPs, from the variant's own formula
    assert measured.predict(("x", 64), big.shape.seq_q, work[big]) == pytest.approx(10.0 * 4)
    assert measured.predict(("x", 128), other_d.shape.seq_q, work[other_d]) is None
    measured.record(("x", 64), 2048, work[small] * 2, 30.0)  # the largest smaller N wins, not the latest
    measured.record(("x", 64), 512, work[small] / 2, 1.0)
    assert measured.predict(("x", 64), big.shape.seq_q, work[big]) == pytest.approx(30.0 * 2)


def test_shapes_follow_flash_attention_layout():
    problems = C.benchmark_problems([64, 128], [1024, 16384], [False], 16384, 2048, torch.bfloat16, "cpu")
    assert [(p.shape.batch, p.shape.heads, p.shape.seq_q, p.shape.head_dim) for p in problems] == [
        (16, 32, 1024, 64), (1, 32, 16384, 64), (16, 16, 1024, 128), (1, 16, 16384, 128)]
    assert C.problem_from_fields(C.row_fields(problems[1]), "cpu") == problems[1]


@pytest.mark.parametrize("causal", [False, True])
def test_flex_baseline_flavour_terms_add_what_the_formula_adds(causal):
    # the speed phase's flex-t5 and flex-keybias rows are FlexTarget with a flavour: its score_mod term
    # must add the T5 bucket bias (bidirectional unless causal) or the per-key mask to every logit
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    from attnzoo.bench.baselines import FLEX_TERMS
    from attnzoo.ops.fenchel.t5_reference import t5_log_preference
    problem = C.benchmark_problems([8], [24], [causal], 48, 16, torch.float32, "cpu")[0]
    b, h, n, d = problem.shape.batch, problem.shape.heads, problem.shape.seq_q, problem.shape.head_dim
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    logits = q @ k.transpose(-1, -2) / d ** 0.5
    kw, leaves = C.T5.inputs(problem)
    bias = kw["relative_bias"]._replace(table=leaves[0].detach().double())
    assert bias.bidirectional is not causal
    mask = C.KEY_BIAS.inputs(problem)[0]["attn_mask"].double()
    expected = {"t5": t5_log_preference(bias.table, 32, 128, not causal, n, n), "mask": mask}
    for name, inputs in (("t5", {"relative_bias": bias}), ("mask", {"attn_mask": mask})):
        term = FLEX_TERMS[name](problem, **inputs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex_attention's note that it runs uncompiled here
            out = flex_attention(q, k, v, score_mod=term)
        reference = torch.softmax(logits + expected[name], dim=-1) @ v
        torch.testing.assert_close(out, reference, atol=1e-12, rtol=0)


def test_device_call_wrapper_parses():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_session.sh")], check=True)
