"""Benchmark results as a rich terminal table and as Markdown (a summary pivot per mode, then every row)."""
from __future__ import annotations

from collections import OrderedDict

from .errors import OK

_SHORT_STATUS = {"oom": "OOM", "unsupported": "n/a", "unavailable": "not installed", "skipped": "skipped",
                 "error": "error"}


def fmt_time(seconds) -> str:
    if seconds is None:
        return ""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def fmt_bytes(n) -> str:
    if n is None:
        return ""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def fmt_ratio(x) -> str:
    return "" if x is None else f"{x:.3g}x"


def fmt_rate(x, unit="") -> str:
    if x is None:
        return ""
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{suffix}{unit}"
    return f"{x:.3g}{unit}"


def backend_label(row: dict) -> str:
    resolved = row.get("resolved_backend")
    if row["backend"] == "auto" and resolved:
        return f"auto -> {resolved}"
    return row["backend"]


def time_cell(row: dict) -> str:
    if row["status"] != OK:
        return _SHORT_STATUS.get(row["status"], row["status"])
    t = row["time_s"]
    spread = (t["p80"] - t["p20"]) / (2 * t["median"]) * 100 if t["median"] > 0 and t["n"] > 1 else None
    return fmt_time(t["median"]) + (f" +-{spread:.0f}%" if spread is not None else " (1 run)")


def row_line(row: dict, elapsed: float | None = None) -> str:
    """One plain line per finished row, for logs and captured output where a progress bar is invisible:
    [elapsed] variant backend(->resolved) N mode dtype status median ratio first-call (reason)."""
    parts = [] if elapsed is None else [f"[{elapsed:7.1f}s]"]
    parts += [f"{row['variant'] + (' (causal)' if row['causal'] and row['variant'] != 'masked' else ''):<14}",
              f"{backend_label(row):<22}", f"N={row['seq_len']:<6}", f"{row['mode']:<8}", f"{row['dtype']:<9}",
              f"{row['status']:<11}"]
    if row["status"] == OK:
        parts.append(f"{fmt_time(row['time_s']['median']):>10}")
        ratio = row.get("ratio_time_vs_sdpa")
        parts.append(f"{fmt_ratio(ratio) + ' SDPA' if ratio is not None else '':>12}")
        if row.get("first_call_s") is not None:
            parts.append(f"first call {fmt_time(row['first_call_s'])}")
        if row.get("shared_with"):
            parts.append(f"(= {row['shared_with']})")
    else:
        reason = " ".join(str(row.get("reason") or "").split())
        parts.append(reason if len(reason) <= 160 else reason[:157] + "...")
    return " ".join(parts).rstrip()


COLUMNS = ("variant", "backend", "N", "B x H", "mode", "dtype", "time (median +-spread)", "TFLOP/s", "tokens/s",
           "peak mem", "time x SDPA", "mem x SDPA", "note")


def row_cells(row: dict) -> list[str]:
    return [row["variant"] + (" (causal)" if row["causal"] and row["variant"] != "masked" else ""),
            backend_label(row), str(row["seq_len"]), f"{row['batch']} x {row['heads']}", row["mode"], row["dtype"],
            time_cell(row), "" if row.get("tflops") is None else f"{row['tflops']:.3g}",
            fmt_rate(row.get("tokens_per_s")), fmt_bytes(row.get("peak_memory_bytes")),
            fmt_ratio(row.get("ratio_time_vs_sdpa")), fmt_ratio(row.get("ratio_memory_vs_sdpa")),
            row.get("reason") or ""]


def _sorted(rows: list[dict]) -> list[dict]:
    variants = list(OrderedDict.fromkeys(r["variant"] for r in rows))
    return sorted(rows, key=lambda r: (r["mode"], r["dtype"], variants.index(r["variant"]), r["seq_len"],
                                       r["kind"] != "attnzoo", r["backend"] == "auto"))


def rich_table(result: dict, title: str | None = None):
    """Compact terminal table (fits ~120 columns); the reasons of non-ok rows are numbered below it."""
    from rich.table import Table
    env, rows = result["environment"], _sorted(result["results"])
    dtypes = sorted({r["dtype"] for r in rows})
    shapes = sorted({(r["heads"], r["head_dim"]) for r in rows})
    table = Table(title=title or f"attnzoo bench - {env.get('device_name')}, {', '.join(dtypes)}, "
                                 f"heads x dim {', '.join(f'{h}x{d}' for h, d in shapes)}, batch = batch_tokens / N",
                  caption_justify="left")
    columns = ["variant", "backend", "N", "mode"] + (["dtype"] if len(dtypes) > 1 else []) + [
        "time", "TFLOP/s", "tok/s", "peak mem", "t/SDPA", "mem/SDPA"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("variant", "backend", "mode", "dtype", "time") else "right")
    reasons: OrderedDict = OrderedDict()
    for row in rows:
        time = time_cell(row)
        if row["status"] != OK or row.get("reason"):
            time += f" [{reasons.setdefault(row['reason'], len(reasons) + 1)}]"
        cells = [row["variant"] + (" (causal)" if row["causal"] and row["variant"] != "masked" else ""),
                 backend_label(row), str(row["seq_len"]), row["mode"]] + ([row["dtype"]] if len(dtypes) > 1 else [])
        cells += [time, "" if row.get("tflops") is None else f"{row['tflops']:.3g}", fmt_rate(row.get("tokens_per_s")),
                  fmt_bytes(row.get("peak_memory_bytes")), fmt_ratio(row.get("ratio_time_vs_sdpa")),
                  fmt_ratio(row.get("ratio_memory_vs_sdpa"))]
        table.add_row(*cells, style=None if row["status"] == OK else "dim")
    table.caption = "\n".join(f"[{i}] {reason}" for reason, i in reasons.items())
    return table


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_rows(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in _sorted(rows):
        lines.append("| " + " | ".join(_md_escape(c) for c in row_cells(row)) + " |")
    return "\n".join(lines)


def _group_key(row: dict) -> tuple:
    return (row["mode"], row["dtype"], row["heads"], row["head_dim"])


def markdown_summary(rows: list[dict]) -> str:
    """Per (mode, dtype, heads, head dim): rows (variant, backend) x columns N; each cell
    'median time (x SDPA), peak memory' or the status; reasons listed once below the table."""
    out = []
    groups = OrderedDict()
    for row in _sorted(rows):
        groups.setdefault(_group_key(row), []).append(row)
    for (mode, dtype, heads, head_dim), members in groups.items():
        ns = sorted({r["seq_len"] for r in members})
        cells: OrderedDict = OrderedDict()
        reasons: OrderedDict = OrderedDict()
        for r in members:
            key = (r["variant"] + (" (causal)" if r["causal"] and r["variant"] != "masked" else ""), r["backend"])
            if r["status"] == OK:
                # auto may pick different backends at different N: named in each cell
                picked = f"-> {r['resolved_backend']}: " if r["backend"] == "auto" and r.get("resolved_backend") else ""
                text = picked + fmt_time(r["time_s"]["median"])
                if r.get("ratio_time_vs_sdpa") is not None:
                    text += f" ({r['ratio_time_vs_sdpa']:.3g}x)"
                if r.get("peak_memory_bytes") is not None:
                    text += f", {fmt_bytes(r['peak_memory_bytes'])}"
            else:
                note = reasons.setdefault(r["reason"], len(reasons) + 1)
                text = f"{_SHORT_STATUS.get(r['status'], r['status'])} [{note}]"
            cells.setdefault(key, {})[r["seq_len"]] = text
        out.append(f"**{mode}, {dtype}, {heads} head(s) of dim {head_dim}** - median time (x SDPA softmax), "
                   f"peak memory\n")
        out.append("| variant | backend | " + " | ".join(f"N={n}" for n in ns) + " |")
        out.append("|---|---|" + "---|" * len(ns))
        for (variant, backend), by_n in cells.items():
            out.append(f"| {_md_escape(variant)} | {_md_escape(backend)} | "
                       + " | ".join(_md_escape(by_n.get(n, "")) for n in ns) + " |")
        if reasons:
            out.append("")
            out.extend(f"{i}. {_md_escape(reason)}" for reason, i in reasons.items())
        out.append("")
    return "\n".join(out)


def settings_line(result: dict) -> str:
    s, env = result["settings"], result["environment"]
    load = env.get("load_average_at_start")
    busy = f", load average {load[0]:.3g} at start / {env['load_average'][0]:.3g} at end" if load and env.get(
        "load_average") else ""
    threads = env.get("torch_threads")
    return (f"{env.get('device_name')} ({threads} thread{'' if threads == 1 else 's'}{busy}), torch {env.get('torch')}, "
            f"triton {env.get('triton')}, CUDA {env.get('cuda')}; batch_tokens={s.get('batch_tokens')} "
            f"(batch = batch_tokens / N), heads={s.get('heads')}, head_dim={s.get('head_dim')}, "
            f"causal={s.get('causal')}; run {result['created']}")


def markdown_report(result: dict) -> str:
    methods = result.get("methods", {})
    parts = [f"# attnzoo bench: {result['environment'].get('device_name')}", "", settings_line(result), "",
             f"- timing: {methods.get('timing', '')}", f"- memory: {methods.get('memory', '')}",
             f"- {methods.get('auto', '')}", f"- {methods.get('ratios', '')}", "", "## Summary", "",
             markdown_summary(result["results"]), "## Every row", "", markdown_rows(result["results"]), ""]
    return "\n".join(parts)
