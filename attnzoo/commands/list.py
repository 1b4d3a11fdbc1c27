"""attnzoo list: the registered variants and what each can do."""
from __future__ import annotations

from . import UsageError

HELP = "list the attention variants and their capabilities"


def add_arguments(parser) -> None:
    parser.add_argument("name", nargs="?", help="describe one variant in full")


def run(args) -> int:
    from .. import registry
    try:
        names = [registry.parse_spec(args.name)[0]] if args.name else registry.available()
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    from rich.console import Console
    from rich.table import Table

    table = Table(title="attnzoo variants")
    for col in ("name", "class", "causal", "cross", "masks", "complexity", "parameters", "paper"):
        table.add_column(col, overflow="fold")
    for n in names:
        d = registry.describe(n)
        table.add_row(*(str(d.get(c, "")) for c in ("name", "class", "causal", "cross", "masks", "complexity",
                                                     "parameters", "paper")))
    Console().print(table)
    return 0
