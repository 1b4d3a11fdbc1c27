"""Writing one run to a folder. The kernel benchmark: ``<name>.json`` (every measurement + environment),
``<name>.md`` (Markdown tables) and ``<name>_time_*.png`` / ``<name>_memory_*.png`` (log-log plots);
the model and overhead benchmarks: ``<name>.json`` and ``<name>.md``."""
from __future__ import annotations

from pathlib import Path

from .plots import plot_results
from .report import markdown_report, models_report, overhead_report
from .schema import validate, validate_models, validate_overhead, write_json, write_text


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


def write_models_outputs(result: dict, out_dir, name: str = "models") -> dict:
    validate_models(result)
    out_dir = Path(out_dir)
    return {"json": write_json(result, out_dir / f"{name}.json"),
            "markdown": write_text(models_report(result), out_dir / f"{name}.md")}


def write_overhead_outputs(result: dict, out_dir, name: str = "overhead") -> dict:
    validate_overhead(result)
    out_dir = Path(out_dir)
    return {"json": write_json(result, out_dir / f"{name}.json"),
            "markdown": write_text(overhead_report(result), out_dir / f"{name}.md")}
