"""Every place that names the built-in variants by hand (ops/variant.py's docstring lists them) agrees
with the catalog: the layer classes written in layers/variants.py, the export lists, the order of
``available()``, and the lists of what a tool covers. The built-in variants are read from the catalog
itself: the records declared by attnzoo's own variant folders."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import attnzoo
import attnzoo.functional as AF
import attnzoo.layers
from attnzoo import registry
from attnzoo.ops import variant as catalog

PACKAGE = Path(attnzoo.__file__).resolve().parent
BUILTIN = [r for r in catalog.records() if r.reference.__module__.startswith("attnzoo.ops.")]
BUILTIN_NAMES = [r.name for r in BUILTIN]
WRAPPER_CLASSES = {"MaskedAttention", "MultiheadAttention"}


def test_the_builtin_variants_are_found():
    assert len(BUILTIN) >= 8 and "sinkhorn" in BUILTIN_NAMES


def written_classes() -> dict[str, str]:
    """class name -> the ``variant = "..."`` its body sets, for each class statement in layers/variants.py."""
    tree = ast.parse((PACKAGE / "layers" / "variants.py").read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and [t.id for t in stmt.targets] == ["variant"]:
                    found[node.name] = ast.literal_eval(stmt.value)
    return found


def test_each_builtin_class_is_written_out():
    # grep finds "class SigmoidAttention": it is a class statement, not made at import time
    assert written_classes() == {r.class_name: r.name for r in BUILTIN}


@pytest.mark.parametrize("record", BUILTIN, ids=BUILTIN_NAMES)
def test_the_written_class_is_the_registered_one(record):
    cls = getattr(attnzoo.layers.variants, record.class_name)
    assert registry.layer_classes()[record.name] is cls
    assert getattr(attnzoo, record.class_name) is cls and getattr(attnzoo.layers, record.class_name) is cls
    assert cls.__doc__ == (record.doc or cls.__doc__) and cls.__doc__
    options = {p.name: p.default for p in inspect.signature(cls).parameters.values() if p.kind is p.KEYWORD_ONLY}
    assert record.hook.options().items() <= options.items()


def test_layer_exports_are_the_catalog_classes():
    expected = {r.class_name for r in BUILTIN} | WRAPPER_CLASSES
    for module in (attnzoo, attnzoo.layers):
        exported = {n for n in module.__all__ if n.endswith("Attention")}
        assert exported == expected, (module.__name__, sorted(exported ^ expected))


def test_functional_exports_are_the_catalog_functions():
    own = {n for n in AF.__all__ if n not in ("masked", "varlen", "explain", "VARIANT_FUNCTIONS")}
    assert own == set(BUILTIN_NAMES)
    for name in BUILTIN_NAMES:
        assert getattr(AF, name) is catalog.get(name).functional


def test_available_orders_every_builtin():
    order = registry.BUILTIN_ORDER
    assert set(order) == set(BUILTIN_NAMES) | set(registry.wrappers())
    assert attnzoo.available()[:len(order)] == list(order)


def test_builtin_py_imports_each_variant_folder():
    tree = ast.parse((PACKAGE / "ops" / "builtin.py").read_text())
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module != "__future__"
                for a in node.names}
    assert imported == set(BUILTIN_NAMES)


def test_the_analysis_fields_cover_every_builtin_variant():
    import torch

    from attnzoo.analysis import fields
    assert set(fields.VARIANTS) == set(BUILTIN_NAMES)
    X, eye = torch.randn(5, 2, dtype=torch.float64), torch.eye(2, dtype=torch.float64)
    for name in fields.VARIANTS:  # each has its field
        out = fields.query_velocity(name, X[:2], X, eye, eye, eye, n_iters=5)
        assert out.shape == (2, 2) and torch.isfinite(out).all(), name


def test_the_lists_of_what_a_tool_covers_name_declared_variants():
    from attnzoo.analysis import gaussian, particles
    from attnzoo.bench import baselines
    from attnzoo.commands import demo
    for listed in (gaussian.GAUSSIAN_VARIANTS, particles.FAST_VARIANTS, baselines.FLEX_TRIED,
                   baselines.FlexTarget.EXPRESSIBLE):
        assert set(listed) <= set(BUILTIN_NAMES), listed
    assert set(demo.DEFAULT_VARIANTS) - {demo.OTVIT} <= set(attnzoo.available())


def test_the_analyze_defaults_are_accepted(monkeypatch):
    from attnzoo.cli import build_parser
    from attnzoo.commands.analyze import check_arguments
    from attnzoo.train import datasets
    monkeypatch.setattr(datasets, "fashion_mnist_present", lambda *a, **k: True)  # topolip's data: not the point
    for tool in ("lipschitz", "wasserstein", "topolip"):
        args = build_parser().parse_args(["analyze", tool])
        assert args.variants
        check_arguments(args)  # a stale default name would be a UsageError
