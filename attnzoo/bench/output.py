"""Writing one run to a folder: ``<name>.json`` (every measurement + environment), ``<name>.md``
(Markdown tables) and ``<name>_time_*.png`` / ``<name>_memory_*.png`` (log-log plots)."""
from __future__ import annotations

from pathlib import Path

from .plots import plot_results
from .report import markdown_report
from .schema import validate, write_json, write_text


def write_outputs(result: dict, out_dir, name: str = "bench") -> dict:
    out_dir = Path(out_dir)
    validate(result)
    files = {"json": write_json(result, out_dir / f"{name}.json"),
             "markdown": write_text(markdown_report(result), out_dir / f"{name}.md")}
    try:
        files["plots"] = plot_results(result, out_dir, prefix=f"{name}_")
    except ImportError as e:  # matplotlib missing (a bare GPU box): the JSON and Markdown still count
        print(f"no plots written ({e}); rebuild them elsewhere with `attnzoo bench --from-jsonl` or from the JSON",
              flush=True)
        files["plots"] = []
    return files
