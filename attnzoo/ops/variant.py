"""One record per attention variant, declared beside its code, and the catalog of declared variants.

A variant is a folder ``ops/<variant>/`` whose ``__init__.py`` registers its backends and declares a
:class:`Variant`: its name, the reference (the eager ground truth, registered as backend
"reference"), its public function, the layer hook (the constructor options, parameters and per-call
keyword arguments it adds to the shared attention layer), the capabilities in which it differs from
the others, and its cost formulas. The functional API, the layers, the registry and spec strings,
``attnzoo.explain``, the benchmark harness and the model adapters all read these records. A variant
declared from outside the package (``attnzoo.register_variant``) is a record like any other, and
everything that reads the catalog picks it up.

The built-in variants are also named by hand in a few places, on purpose; tests/test_variant_lists.py
checks each against this catalog:

- what ships and in which order: ops/builtin.py (imports the variant folders) and
  ``registry.BUILTIN_ORDER`` (the order of ``attnzoo.available()``);
- the public names, written out so that readers, grep and static tools find them: the classes in
  layers/variants.py and the exports of attnzoo/__init__.py, attnzoo/layers/__init__.py and
  attnzoo/functional.py;
- what a tool covers, each a choice about its own math or defaults rather than a list of all the
  variants: analysis/fields.py (the velocity field of each variant), analysis/gaussian.py and
  analysis/particles.py (closed forms, fast kernel sums), the default ``--variants`` of
  ``attnzoo analyze`` and ``attnzoo demo`` (commands/), and the variants the benchmark tries
  FlexAttention for (bench/baselines.py).
"""
from __future__ import annotations

# The record, the catalog, the call path and explain each have a home of their own (record.py,
# catalog.py, call_path.py, explain.py, in that order from the bottom); the names stay importable
# from here for the code and docs that use them.
from .call_path import attend, backend_kwargs  # noqa: F401
from .catalog import declare, get, is_declared, names, records, remove  # noqa: F401
from .explain import check_keywords, explain  # noqa: F401
from .record import (DEFAULT_CAPABILITIES, SHARED_ARGS, LayerHook, OptionsHook, Variant,  # noqa: F401
                     check_on_stand_ins, make_functional, option_defaults)
