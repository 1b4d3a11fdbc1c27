"""The per-call overhead benchmark (`attnzoo bench --overhead`): every candidate gets a row against its
reference, the measurements are interleaved round by round, the figures are the medians and ratios the
docstring promises (checked on known samples), and the command line writes its JSON and Markdown.
Not speed: no test compares two timings."""
from __future__ import annotations

import json
import statistics

import pytest
import torch

from attnzoo import cli
from attnzoo.bench import overhead
from attnzoo.bench.overhead import SDPA, SDPA_CAUSAL, TIMM, TIMM_CAUSAL, Candidate, OverheadConfig
from attnzoo.bench.schema import validate_overhead


@pytest.fixture(scope="module")
def result():
    return overhead.run(OverheadConfig(rounds=3, inner=2, warmup=1, variants=["softmax", "masked", "multihead",
                                                                              "sinkhorn(n_iters=1)"]), progress=False)


def test_every_candidate_is_measured_against_its_reference(result):
    validate_overhead(json.loads(json.dumps(result)))
    rows = {(r["group"], r["name"]): r for r in result["results"]}
    expected = {
        ("functional", SDPA): SDPA, ("functional", SDPA_CAUSAL): SDPA_CAUSAL,
        ("functional", "attnzoo.functional.softmax"): SDPA,
        ("functional", "attnzoo.functional.softmax(is_causal=True)"): SDPA_CAUSAL,       # masked: causal softmax
        ("functional", "attnzoo.functional.sinkhorn(n_iters=1)"): SDPA,
        ("layer", TIMM): TIMM, ("layer", TIMM_CAUSAL): TIMM_CAUSAL,
        ("layer", "attnzoo.create('softmax', 64, 2)"): TIMM,
        ("layer", "attnzoo.create('masked', 64, 2)"): TIMM_CAUSAL,
        ("layer", "attnzoo.create('multihead', 64, 2)"): TIMM,                            # a module: layers only
        ("layer", "attnzoo.create('sinkhorn(n_iters=1)', 64, 2)"): TIMM,
    }
    assert {key: r["reference"] for key, r in rows.items()} == expected
    for r in rows.values():
        assert r["status"] == "ok", r["reason"]
        ref = rows[(r["group"], r["reference"])]
        assert r["reference_us"] == ref["us"] and r["extra_us"] == pytest.approx(r["us"] - ref["us"])
        assert r["p20_us"] <= r["us"] <= r["p80_us"] and r["ratio_p20"] <= r["ratio"] <= r["ratio_p80"]
        assert r["rounds"] == 3
    assert rows[("layer", TIMM)]["ratio"] == 1.0


def test_threads_are_put_back():
    before = torch.get_num_threads()
    overhead.run(OverheadConfig(rounds=1, inner=1, warmup=0, variants=["relu"], threads=1), progress=False)
    assert torch.get_num_threads() == before


def test_rounds_interleave_and_rotate():
    calls = []
    candidates = [Candidate("g", name, "a", call=lambda name=name: calls.append(name)) for name in "abc"]
    samples = overhead._interleaved(candidates, OverheadConfig(rounds=4, inner=2), lambda: None)
    assert "".join(calls) == "aabbcc" + "bbccaa" + "ccaabb" + "aabbcc"  # every candidate once a round, rotated
    assert all(len(s) == 4 for s in samples.values())


def test_figures_are_medians_and_the_ratio_is_the_median_of_round_ratios():
    candidates = [Candidate("g", "ref", "ref", call=lambda: None), Candidate("g", "x", "ref", call=lambda: None)]
    ref, mine = [1e-6, 2e-6, 4e-6, 3e-6, 10e-6], [3e-6, 5e-6, 9e-6, 6e-6, 11e-6]
    rows = {r["name"]: r for r in overhead._rows(candidates, {"ref": ref, "x": mine})}
    x = rows["x"]
    assert x["us"] == pytest.approx(statistics.median(mine) * 1e6) and x["reference_us"] == pytest.approx(3.0)
    assert x["ratio"] == pytest.approx(statistics.median([m / r for m, r in zip(mine, ref)]))  # 2.25
    assert x["ratio"] != pytest.approx(statistics.median(mine) / statistics.median(ref))  # not 6 / 3


def test_a_candidate_that_fails_is_a_row_with_its_reason():
    def broken():
        raise RuntimeError("no kernel for this")
    candidates = [Candidate("g", "ref", "ref", call=lambda: None), Candidate("g", "x", "ref", call=broken)]
    overhead._warm(candidates, 1)
    rows = {r["name"]: r for r in overhead._rows(candidates, overhead._interleaved(candidates, OverheadConfig(
        rounds=2, inner=1), lambda: None))}
    assert rows["x"]["status"] == "error" and "no kernel for this" in rows["x"]["reason"]
    assert rows["ref"]["status"] == "ok"


def test_command_line(tmp_path, capsys):
    out = tmp_path / "o"
    assert cli.main(["bench", "--overhead", "--rounds", "2", "--inner", "1", "--variants", "l2", "--quiet",
                     "--out", str(out)]) == 0
    result = json.loads((out / "overhead.json").read_text())
    assert {r["name"] for r in result["results"]} == {SDPA, SDPA_CAUSAL, TIMM, TIMM_CAUSAL, "attnzoo.functional.l2",
                                                       "attnzoo.create('l2', 64, 2)"}
    md = (out / "overhead.md").read_text()
    assert "| attnzoo.functional.l2 |" in md and "| attnzoo.create('l2', 64, 2) |" in md
    capsys.readouterr()
    assert cli.main(["bench", "--overhead", "--device", "cuda", "--out", str(tmp_path / "x")]) == 2
    assert "--overhead measures on the CPU" in capsys.readouterr().err
    assert cli.main(["bench", "--overhead", "--variants", "l2(foo=1)", "--out", str(tmp_path / "x")]) == 2
    assert "l2 does not take ['foo']" in capsys.readouterr().err
