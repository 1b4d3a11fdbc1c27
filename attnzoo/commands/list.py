"""attnzoo list [NAME]: the registered variants and what each can do; with a NAME (or spec string), that
variant in full: its description, the formula its reference computes, capabilities, complexity,
parameters, paper, default scale, whether it couples queries, its FLOP count, constructor options with
their defaults, layer class, function and backends.

The table is printed when it fits the terminal (``COLUMNS``) with every word whole (the built-in
variants need about 115 columns); a narrower terminal gets the same facts as one short block per
variant instead of a table whose cells split words."""
from __future__ import annotations

import inspect
import re
import textwrap

from . import UsageError

HELP = "list the attention variants and their capabilities (with NAME: one variant in full)"
TABLE_COLUMNS = ("name", "class", "supports", "complexity", "parameters", "paper")
CAPABILITIES = ("causal", "cross", "masks")


def add_arguments(parser) -> None:
    parser.add_argument("name", nargs="?", metavar="NAME",
                        help="describe one variant in full: description, formula, capabilities, complexity, "
                             "parameters, paper, default scale, coupled queries, FLOPs, options with their "
                             "defaults, layer class, function and backends")


def run(args) -> int:
    from .. import registry
    try:
        name = registry.parse_spec(args.name)[0] if args.name else None
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    from rich.console import Console
    console = Console()
    if name is not None:
        _print_blocks(console, [in_full(name)])
    else:
        rows = [summary(n) for n in registry.available()]
        table = _table(rows)
        if _minimum_width(console, table) <= console.width:
            console.print(table)
        else:
            _print_blocks(console, rows)
    return 0


def supports(info: dict) -> str:
    """"causal, cross, masks" (what the variant supports of the three), or "none of causal, ..."."""
    have = [c for c in CAPABILITIES if info.get(c)]
    return ", ".join(have) if have else "none of " + ", ".join(CAPABILITIES)


def summary(name: str) -> dict[str, str]:
    """One table row: the fields of ``attnzoo.describe(name)``."""
    from .. import registry
    info = registry.describe(name)
    return {"name": name, "class": str(info.get("class", "")), "supports": supports(info),
            "complexity": str(info.get("complexity", "")), "parameters": str(info.get("parameters", "")),
            "paper": str(info.get("paper", ""))}


def in_full(name: str) -> dict[str, str]:
    """Everything ``attnzoo list NAME`` prints, as field -> text."""
    from .. import functional, layers, registry
    from ..ops import dispatch
    from ..ops import variant as catalog
    cls = registry.layer_classes()[name]
    info = registry.describe(name)
    public = f"attnzoo.{cls.__name__}" if getattr(layers, cls.__name__, None) is cls else \
        f"{cls.__module__}.{cls.__qualname__}"
    doc = cls.__doc__ or inspect.getmodule(cls).__doc__ or ""
    out = {"name": name, "description": _unwrap(inspect.cleandoc(doc)) or "(no docstring)",
           "supports": supports(info), "complexity": str(info.get("complexity", "")),
           "parameters": str(info.get("parameters", "")), "paper": str(info.get("paper", ""))}
    if name in registry.wrappers():
        own = _own_init_options(cls)
        out["options"] = _options_text(own) + "; and the kind's own options (attnzoo list KIND)"
        out["layer class"] = f"{public}; kind: one of {', '.join(catalog.names())}"
        out["example"] = f"attnzoo.create(\"{name}(kind='sinkhorn(n_iters=5)')\", dim, num_heads)"
    elif catalog.is_declared(getattr(cls, "variant", None)):
        record = catalog.get(cls.variant)
        out.update(_record_fields(record))
        options = record.hook.options()
        out["options"] = _options_text(options) or "none"
        out["layer class"] = (f"{public}(dim, num_heads=8, <timm's Attention arguments>"
                              + "".join(f", {k}={v!r}" for k, v in options.items()) + ")")
        where = f"attnzoo.functional.{record.name}" if getattr(functional, record.name, None) is record.functional \
            else f"attnzoo.functional.VARIANT_FUNCTIONS[{record.name!r}]"
        out["function"] = f"{where}{inspect.signature(record.functional)}"
        out["backends"] = ", ".join(dispatch.backends(record.name)) + " (highest priority first; attnzoo.explain " \
                                                                        "says which one a call runs)"
    else:
        out["options"] = _options_text(_own_init_options(cls)) or "none"
        out["layer class"] = f"{public}{inspect.signature(cls)}"
    return out


def _record_fields(record) -> dict[str, str]:
    """What the variant record says beyond describe(): the formula its reference computes (the reference
    module's docstring, written from the paper; the function's own when the module has none), the
    default scale, whether queries are coupled, and the FLOP count the benchmark uses."""
    module = inspect.getmodule(record.reference)
    doc = (module.__doc__ if module is not None and module.__name__.startswith("attnzoo.ops.") else None) \
        or record.reference.__doc__ or ""
    scale = "1/sqrt(D)" if record.default_scale is None else f"{record.default_scale:g}"
    coupled = ("yes: one query's output depends on the others (padded queries are masked out, causal = "
               "each prefix solved on its own)" if record.couples_queries else "no: each row on its own")
    fields = {"formula": _unwrap(inspect.cleandoc(doc))} if doc.strip() else {}
    return {**fields, "default scale": scale, "couples queries": coupled, "FLOPs": record.flop_formula}


def _own_init_options(cls) -> dict:
    """The constructor's keyword options beyond (dim, num_heads), with their defaults."""
    params = list(inspect.signature(cls).parameters.values())[2:]
    return {p.name: p.default for p in params
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.default is not p.empty}


def _unwrap(doc: str) -> str:
    """A docstring's hard-wrapped lines joined into one line per paragraph or list item, so that the
    terminal's width decides the wrapping. A blank line ends a paragraph; a line starting with
    ``- ``, ``* `` or ``name=`` starts an item; any other line continues the one above."""
    out: list[str] = []
    for line in doc.splitlines():
        text = line.strip()
        if out and out[-1] and text and not re.match(r"(- |\* |\w+=)", line):
            out[-1] += " " + text
        else:
            out.append(text)
    return "\n".join(out)


def _options_text(options: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in options.items())


def _table(rows: list[dict[str, str]]):
    from rich.table import Table
    table = Table(title="attnzoo variants (attnzoo list NAME: one in full)")
    for col in TABLE_COLUMNS:
        # a cell wraps between words, never inside one: the table's minimum width is then its
        # longest words, which run() compares with the terminal's before choosing the table
        table.add_column(col, no_wrap=col in ("name", "class"), overflow="ellipsis")
    for row in rows:
        table.add_row(*(row[c] for c in TABLE_COLUMNS))
    return table


def _minimum_width(console, table) -> int:
    """The narrowest the table can be with every word whole (console.measure clamps to the terminal)."""
    from rich.measure import Measurement
    return Measurement.get(console, console.options.update_width(10_000), table).minimum


def _print_blocks(console, blocks: list[dict[str, str]]) -> None:
    """One block per variant: its name, then each field as ``label  text`` wrapped under the text."""
    width = max(console.width, 40)
    for i, block in enumerate(blocks):
        if i:
            console.print()
        fields = {k: v for k, v in block.items() if k != "name"}
        label_width = max(map(len, fields)) + 2
        console.print(block["name"], markup=False, highlight=False)
        for label, text in fields.items():
            lead = "  " + label.ljust(label_width)
            for j, paragraph in enumerate(text.split("\n")):
                lines = textwrap.wrap(paragraph, width - len(lead), break_on_hyphens=False) or [""]
                for k, line in enumerate(lines):
                    head = lead if j == 0 and k == 0 else " " * len(lead)
                    console.print((head + line).rstrip(), markup=False, highlight=False, soft_wrap=True)
