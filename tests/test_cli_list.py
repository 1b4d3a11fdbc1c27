"""``attnzoo list`` fits the terminal without splitting a word, and ``attnzoo list NAME`` prints what
its help promises: capabilities, complexity, parameters, paper, the constructor options with their
defaults and the layer class. What must appear is read from ``attnzoo.describe`` and from the layer
class's signature, not from the command's own helpers."""
from __future__ import annotations

import inspect
import re

import pytest

import attnzoo
from attnzoo.cli import main
from attnzoo.layers import AttentionLayer

BASE_PARAMS = set(inspect.signature(AttentionLayer).parameters)
BOX = "│┃┏┓┗┛┡┩└┘┳┻╇━─┼"


def run_list(capsys, monkeypatch, columns, *argv):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["list", *argv]) == 0
    return capsys.readouterr().out


def words_shown(out: str) -> set[str]:
    """Every whitespace-separated word of the output, table borders taken as spaces."""
    return set(re.sub(f"[{BOX}]", " ", out).split())


def described_words(name: str) -> set[str]:
    d = attnzoo.describe(name)
    text = " ".join(str(d[k]) for k in ("name", "class", "complexity", "parameters", "paper"))
    return set(text.split())


def own_options(name: str) -> dict:
    """The constructor options a variant's class adds to the shared layer, from its signature; for a
    wrapper, the keyword parameters of its own constructor."""
    cls = attnzoo.registry.layer_classes()[name]
    params = inspect.signature(cls).parameters.values()
    if issubclass(cls, AttentionLayer) and cls.variant == name:
        return {p.name: p.default for p in params if p.name not in BASE_PARAMS and p.default is not p.empty}
    return {p.name: p.default for p in list(params)[2:] if p.default is not p.empty}


@pytest.mark.parametrize("columns", [80, 100, 200])
def test_the_list_fits_the_terminal_with_every_word_whole(capsys, monkeypatch, columns):
    out = run_list(capsys, monkeypatch, columns)
    too_long = [line for line in out.splitlines() if len(line) > columns]
    assert not too_long, "\n".join(too_long)
    shown = words_shown(out)
    for name in attnzoo.available():
        missing = described_words(name) - shown
        assert not missing, f"{name}: {sorted(missing)} split or cut in the {columns}-column list:\n{out}"
    if columns == 200:
        assert "┃ name" in out  # wide enough for the table itself


@pytest.mark.parametrize("name", attnzoo.available())
def test_list_name_describes_the_variant_in_full(capsys, monkeypatch, name):
    out = run_list(capsys, monkeypatch, 80, name)
    assert max(len(line) for line in out.splitlines()) <= 80
    flat = " ".join(out.split())  # undo the wrapping
    d = attnzoo.describe(name)
    for key in ("complexity", "parameters", "paper"):
        assert " ".join(str(d[key]).split()) in flat, (key, out)
    for capability in ("causal", "cross", "masks"):
        assert (capability in flat) == bool(d[capability])
    assert d["class"] in flat
    for option, default in own_options(name).items():
        assert f"{option}={default!r}" in flat, (option, out)
    assert len(out.splitlines()) > 5  # a description, not the one-line table row


def test_list_name_takes_a_spec_string(capsys, monkeypatch):
    out = run_list(capsys, monkeypatch, 100, "sinkhorn(n_iters=5)")
    assert out.startswith("sinkhorn\n") and "n_iters=3" in out  # the defaults, whatever the spec set


# issue 31 item 16: `list NAME` was one line of description for most variants (only ot's class had a
# long docstring); every variant now shows what its record knows: the formula its reference computes
# (the reference module's docstring), the default scale, whether queries are coupled and the FLOPs.
@pytest.mark.parametrize("name", [n for n in attnzoo.available() if n not in attnzoo.registry.wrappers()])
def test_list_name_shows_the_records_formula_scale_and_flops(capsys, monkeypatch, name):
    out = run_list(capsys, monkeypatch, 100, name)
    flat = " ".join(out.split())
    record = attnzoo.ops.variant.get(name)
    formula = inspect.getmodule(record.reference).__doc__
    assert " ".join(formula.split()) in flat, out
    scale = "1/sqrt(D)" if record.default_scale is None else f"{record.default_scale:g}"
    assert f"default scale {scale}" in flat
    assert f"couples queries {'yes' if record.couples_queries else 'no'}" in flat
    assert " ".join(record.flop_formula.split()) in flat
