"""The variants that ship with attnzoo: importing a variant's package declares its record and
registers its backends (ops/<variant>/__init__.py). This order is the catalog's
(``attnzoo.functional.VARIANT_FUNCTIONS``); ``attnzoo.available()`` follows ``registry.BUILTIN_ORDER``."""
from __future__ import annotations

from . import softmax, l2, sinkhorn, sigmoid, relu, linear, fenchel, ot  # noqa: F401,I001
