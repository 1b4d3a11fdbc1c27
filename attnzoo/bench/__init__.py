"""attnzoo.bench: time, throughput and peak memory of every variant and backend, with baselines.

``run(BenchConfig(...))`` returns a JSON-ready dict (see ``schema.validate``); ``write_outputs``
writes it as JSON, Markdown and PNG plots; ``compare`` diffs two runs; ``RowLog`` keeps a JSON-lines
log of the rows as they finish and ``load_rowlog`` rebuilds a result from it (a killed run included). The ``attnzoo bench``
command (attnzoo/commands/bench.py) is the front end; FLOP conventions are in ``flops``.
"""
from .compare import compare, markdown_compare, rich_compare
from .flops import Shape, flops
from .output import write_outputs
from .report import markdown_report, rich_table
from .rowlog import RowLog, load_rowlog
from .runner import ALL_VARIANTS, BenchConfig, run
from .schema import load, validate

__all__ = ["ALL_VARIANTS", "BenchConfig", "RowLog", "Shape", "compare", "flops", "load", "load_rowlog",
           "markdown_compare", "markdown_report", "rich_compare", "rich_table", "run", "validate", "write_outputs"]
