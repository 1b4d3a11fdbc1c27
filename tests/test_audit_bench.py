"""Outside-in audit of `attnzoo bench` and `attnzoo analyze`: outputs that misled a user.

- several head counts (``--heads 1 4``): the terminal table and the --compare tables showed rows of
  different problems with identical labels (no heads column);
- ``--overhead`` with a spec repeated: two samples a round under one name, ratios paired with the
  wrong rounds and ``rounds`` twice the truth;
- ``analyze --train-seconds -0.5`` was accepted although the message says ">= 0".
"""
from __future__ import annotations

import argparse
import io

import pytest

from attnzoo.bench import BenchConfig, markdown_compare, rich_compare, rich_table, run
from attnzoo.bench.overhead import OverheadConfig
from attnzoo.bench.overhead import run as run_overhead
from attnzoo.commands import UsageError
from attnzoo.commands import analyze

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def two_head_counts():
    cfg = BenchConfig(variants=["softmax"], backends=["sdpa", "reference"], seq_lens=[8, 16], batch_tokens=32,
                      head_dim=8, heads=[1, 2], modes=["fwd"], warmup=1, min_repeats=1, max_repeats=1,
                      target_seconds=0.0, measure_memory=False)
    return run(cfg, progress=False)


def _rendered_rows(table) -> list[list[str]]:
    """The body rows of a rich table as cells (header first)."""
    from rich.console import Console
    console = Console(file=io.StringIO(), width=250, color_system=None)
    console.print(table)
    lines = console.file.getvalue().splitlines()
    header = next(line for line in lines if line.startswith("┃"))
    body = [line for line in lines if line.startswith("│")]
    split = lambda line: [c.strip() for c in line.strip("│┃").split(line[0])]  # noqa: E731
    return [split(header)] + [split(line) for line in body]


def _identities(rows: list[list[str]], first_measured: str) -> list[tuple]:
    """Each row's cells before the first measured column: what tells a reader which problem it is."""
    cut = rows[0].index(first_measured)
    return [tuple(r[:cut]) for r in rows[1:]]


def test_terminal_table_tells_head_counts_apart(two_head_counts):
    rows = _rendered_rows(rich_table(two_head_counts))
    labels = _identities(rows, "time")
    assert len(labels) == len(two_head_counts["results"]) == 8
    assert len(set(labels)) == len(labels), labels
    col = rows[0].index("H x D")
    assert {r[col] for r in rows[1:]} == {"1x8", "2x8"}


@pytest.mark.parametrize("render", ["rich", "markdown"])
def test_compare_tables_tell_head_counts_apart(two_head_counts, render):
    if render == "rich":
        rows = _rendered_rows(rich_compare(two_head_counts, two_head_counts))
    else:
        md = markdown_compare(two_head_counts, two_head_counts)
        lines = [line for line in md.splitlines() if line.startswith("| ")]
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    labels = _identities(rows, "old time")
    assert len(labels) == len(two_head_counts["results"])
    assert len(set(labels)) == len(labels), labels


def test_single_head_count_keeps_the_compact_columns(two_head_counts):
    one = {**two_head_counts, "results": [r for r in two_head_counts["results"] if r["heads"] == 1]}
    assert "H x D" not in _rendered_rows(rich_table(one))[0]
    assert "H x D" not in _rendered_rows(rich_compare(one, one))[0]


def test_overhead_repeated_spec_is_timed_once_per_round():
    rounds = 4
    result = run_overhead(OverheadConfig(rounds=rounds, inner=1, warmup=1, variants=["softmax", "l2", "softmax"]),
                          progress=False)
    names = [r["name"] for r in result["results"]]
    assert len(names) == len(set(names)), names
    assert all(r["rounds"] == rounds for r in result["results"] if r["status"] == "ok")
    assert names.index("attnzoo.functional.softmax") < names.index("attnzoo.functional.l2")  # order kept


def _analyze_args(tool, **kw):
    parser = argparse.ArgumentParser()
    analyze.add_arguments(parser)
    args = parser.parse_args([tool])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize("value", [-0.5, -1e-9])
def test_analyze_rejects_negative_train_seconds(value):
    with pytest.raises(UsageError, match="--train-seconds must be >= 0"):
        analyze.check_arguments(_analyze_args("topolip", train_seconds=value))


def test_compare_names_the_schema_of_a_models_result(tmp_path, capsys):
    from attnzoo import cli
    from attnzoo.bench.schema import MODELS_SCHEMA, validate_models, write_json
    models = validate_models({"schema": MODELS_SCHEMA, "created": "2026-01-01T00:00:00+00:00", "environment": {},
                              "settings": {}, "methods": {}, "models": {}, "results": []})
    path = write_json(models, tmp_path / "models.json")
    assert cli.main(["bench", "--compare", str(path), str(path)]) != 0
    err = capsys.readouterr().err
    assert "--compare" in err and "schema must be 'attnzoo.bench/1'" in err and MODELS_SCHEMA in err, err


# ---- plots: what a folder holds after a run ---------------------------------------------------------

def _tiny_result(modes, measure_memory=True, heads=(2,)):
    cfg = BenchConfig(variants=["softmax"], backends=["sdpa"], seq_lens=[8, 16], batch_tokens=32, head_dim=8,
                      heads=list(heads), modes=modes, warmup=1, min_repeats=1, max_repeats=1, target_seconds=0.0,
                      measure_memory=measure_memory)
    return run(cfg, progress=False)


def test_no_memory_run_writes_no_empty_memory_plot(tmp_path):
    from attnzoo.bench.plots import plot_results
    result = _tiny_result(["fwd"], measure_memory=False)
    assert all(r["peak_memory_bytes"] is None for r in result["results"])
    written = plot_results(result, tmp_path, prefix="bench_")
    assert [p.name for p in written] == ["bench_time_fwd_float32.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_time_fwd_float32.png"]


def test_rerun_into_a_folder_removes_the_earlier_runs_plots_only(tmp_path):
    from attnzoo.bench import write_outputs
    write_outputs(_tiny_result(["fwd", "fwd+bwd"], heads=(1, 2)), tmp_path, "bench")
    assert (tmp_path / "bench_time_fwd_bwd_float32_h1_d8.png").exists()
    others = [tmp_path / "other_time_fwd_float32.png", tmp_path / "bench_time_notes.png", tmp_path / "mine.png"]
    for p in others:   # another run's plots and a user's files stay
        p.write_bytes(b"x")
    files = write_outputs(_tiny_result(["fwd"]), tmp_path, "bench")
    pngs = sorted(p.name for p in tmp_path.glob("bench_*.png"))
    assert pngs == sorted([p.name for p in files["plots"]] + ["bench_time_notes.png"])
    assert pngs == sorted(["bench_memory_fwd_float32.png", "bench_time_fwd_float32.png", "bench_time_notes.png"])
    assert all(p.exists() for p in others)


def test_one_panel_plot_keeps_its_title_inside_the_figure(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnzoo.bench.plots import plot_results
    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    plot_results(_tiny_result(["fwd"]), tmp_path)
    assert figures
    for fig in figures:
        fig.canvas.draw()
        box = fig._suptitle.get_window_extent()
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (box, fig.bbox.width, fig._suptitle.get_text())


def test_row_lines_tell_head_counts_apart(tmp_path, capsys):
    from attnzoo import cli
    assert cli.main(["bench", "--variants", "softmax", "--backends", "sdpa", "--seq-lens", "8", "--batch-tokens", "16",
                     "--head-dim", "4", "--heads", "1", "2", "--mode", "fwd", "--min-repeats", "1", "--repeats", "1",
                     "--target-seconds", "0", "--no-memory", "--out", str(tmp_path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(lines) == 2
    labels = [line.split(" ok ")[0].split("]", 1)[1] for line in lines]
    assert len(set(labels)) == 2 and "H=1" in labels[0] and "H=2" in labels[1], labels


def test_result_files_get_the_usual_permissions(tmp_path):
    """bench.json / bench.md were written 0600 (mkstemp's mode) while the PNGs beside them were 0644:
    a results folder shared with others could not be read by them."""
    import json
    import os
    import stat

    from attnzoo.bench import schema

    old = os.umask(0o022)
    try:
        schema.write_json({"a": 1, "p": tmp_path}, tmp_path / "r.json")
        schema.write_text("x\n", tmp_path / "r.md")
    finally:
        os.umask(old)
    for name in ("r.json", "r.md"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~schema._UMASK
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1, "p": str(tmp_path)}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_lipschitz_plot_names_the_variants_it_cannot_draw(tmp_path, monkeypatch):
    """A variant paper 002 gives no bound for (relu, linear) has no estimate / bound ratio to draw: it
    used to drop out of lipschitz.png without a word."""
    from attnzoo.analysis import plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig))
    row = {"weights": "random", "n_tokens": 4, "radius": 1.0, "estimate": 0.5}
    rows = [dict(row, variant="softmax", bound=1.0), dict(row, variant="relu", bound=None)]
    plots.lipschitz_plot(rows, tmp_path / "l.png")
    texts = [t.get_text() for t in figures[0].texts]
    assert any("relu" in t and "no bound" in t for t in texts), texts
    assert not any("softmax" in t for t in texts if "no bound" in t)
    plots.lipschitz_plot(rows[:1], tmp_path / "l.png")
    assert not [t for t in figures[1].texts if "no bound" in t.get_text()]
