"""Every report of the benchmark harness, one module: the grid benchmark's results (``attnzoo bench``)
as a rich terminal table and as Markdown (a summary pivot per mode, then every row); the GPU kernel
measurement's tables (``speed_report``: the fastest backend per variant against SDPA, the cost-model
table, every row); the model benchmark's tables (``models_report``)."""
from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from typing import Optional

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


def row_line(row: dict, elapsed: float | None = None, heads: bool = False) -> str:
    """One plain line per finished row, for logs and captured output where a progress bar is invisible:
    [elapsed] variant backend(->resolved) N [H, when ``heads``: a run of several head counts] mode dtype
    status median ratio first-call (reason)."""
    parts = [] if elapsed is None else [f"[{elapsed:7.1f}s]"]
    parts += [f"{row['variant'] + (' (causal)' if row['causal'] and row['variant'] != 'masked' else ''):<14}",
              f"{backend_label(row):<22}", f"N={row['seq_len']:<6}"] + ([f"H={row['heads']:<4}"] if heads else []) + [
              f"{row['mode']:<8}", f"{row['dtype']:<9}", f"{row['status']:<11}"]
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
                                       r["heads"], r["head_dim"], r["kind"] != "attnzoo", r["backend"] == "auto"))


def rich_table(result: dict, title: str | None = None):
    """Compact terminal table (fits ~120 columns); the reasons of non-ok rows are numbered below it."""
    from rich.table import Table
    env, rows = result["environment"], _sorted(result["results"])
    dtypes = sorted({r["dtype"] for r in rows})
    shapes = sorted({(r["heads"], r["head_dim"]) for r in rows})
    table = Table(title=title or f"attnzoo bench - {env.get('device_name')}, {', '.join(dtypes)}, "
                                 f"heads x dim {', '.join(f'{h}x{d}' for h, d in shapes)}, batch = batch_tokens / N",
                  caption_justify="left")
    # several head counts (--heads 1 4) or dtypes: a column for each, else rows of different problems look alike
    many_shapes = len(shapes) > 1
    columns = ["variant", "backend", "N"] + (["H x D"] if many_shapes else []) + ["mode"] + (
        ["dtype"] if len(dtypes) > 1 else []) + ["time", "TFLOP/s", "tok/s", "peak mem", "t/SDPA", "mem/SDPA"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("variant", "backend", "mode", "dtype", "time") else "right")
    reasons: OrderedDict = OrderedDict()
    for row in rows:
        time = time_cell(row)
        if row["status"] != OK or row.get("reason"):
            time += f" [{reasons.setdefault(row['reason'], len(reasons) + 1)}]"
        cells = [row["variant"] + (" (causal)" if row["causal"] and row["variant"] != "masked" else ""),
                 backend_label(row), str(row["seq_len"])] + ([f"{row['heads']}x{row['head_dim']}"] if many_shapes else []) + [
                 row["mode"]] + ([row["dtype"]] if len(dtypes) > 1 else [])
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


# -- the kernel speed measurement (speed_grid's cases: benchmarks/gpu_speed.py's speed.json rows) -----
# A row: {"case": "l2 / triton", "table_variant", "flavour", "backend", batch, heads, n, head_dim,
# causal, dtype, "fwd": ms, "fwd+bwd": ms, "mem_fwd_mb", "mem_fwd_bwd_mb", "first_call_s", ...}.

DIRECTIONS = ("fwd", "fwd+bwd")
SUMMARY_SHAPES = [(64, 4096, False), (128, 4096, False), (64, 16384, False), (64, 4096, True), (128, 16384, True),
                  (64, 1024, False)]
# the variants whose targets are written as "at most k times SDPA's time" (Sinkhorn, linear, OT)
COST_MODEL_VARIANTS = ("sinkhorn", "linear", "ot")


def shape_key(row) -> tuple:
    return (row["head_dim"], row["n"], row["causal"])


def _fixed(x, digits=2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return f"{x:.{digits}f}"


def sdpa_ms(rows) -> dict:
    """(head_dim, n, causal) -> {direction: ms} of SDPA's default dispatch."""
    return {shape_key(r): r for r in rows if r["case"] == "sdpa" and "fwd" in r}


def best_per_variant(rows) -> dict:
    """((table_variant, flavour), shape, direction) -> (ms, backend) of the fastest attnzoo backend."""
    best = {}
    for r in rows:
        if not r.get("table_variant"):
            continue
        for d in DIRECTIONS:
            if d not in r:
                continue
            key = ((r["table_variant"], r["flavour"]), shape_key(r), d)
            if key not in best or r[d] < best[key][0]:
                best[key] = (r[d], r["backend"])
    return best


def speed_summary_markdown(rows) -> str:
    """The issues' table: the fastest attnzoo path per variant as a ratio to SDPA (higher is faster)."""
    base = sdpa_ms(rows)
    best = best_per_variant(rows)
    shapes = [s for s in SUMMARY_SHAPES if s in base] or sorted(base)
    head = "| path | " + " | ".join(f"D{d} N{n}{' causal' if c else ''} {x}" for d, n, c in shapes for x in DIRECTIONS) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(shapes))]
    order = [x[0] for x in _ORDER]
    variants = sorted({k[0] for k in best}, key=lambda v: (order.index(v[0]) if v[0] in order else 99, v[1] != "plain",
                                                          v[1]))
    for variant in [("sdpa-flash", "plain"), ("sdpa-cudnn", "plain"), ("flex", "plain")] + variants:
        cells = []
        for s in shapes:
            for d in DIRECTIONS:
                if variant[0].startswith(("sdpa-", "flex")):
                    r = next((r for r in rows if r["case"] == variant[0] and shape_key(r) == s and d in r), None)
                    cells.append(_fixed(base[s][d] / r[d]) if r else "")
                else:
                    hit = best.get((variant, s, d))
                    cells.append(f"{_fixed(base[s][d] / hit[0])} ({hit[1]})" if hit else "")
        name = variant[0] + ("" if variant[1] == "plain" else f" + {variant[1]}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cost_model_markdown(rows) -> str:
    """Sinkhorn, linear and OT as multiples of SDPA's time (lower is faster) and their extra peak
    memory next to SDPA's, per measured shape: the form their cost-model targets take."""
    base = sdpa_ms(rows)
    lines = ["| call | shape | fwd x SDPA | fwd+bwd x SDPA | extra MB fwd / fwd+bwd | SDPA's MB fwd / fwd+bwd |",
             "|---|---|---|---|---|---|"]
    for r in sorted((r for r in rows if r.get("table_variant") in COST_MODEL_VARIANTS and "fwd" in r),
                    key=lambda r: (COST_MODEL_VARIANTS.index(r["table_variant"]), r["case"], r["head_dim"], r["n"],
                                   r["causal"])):
        b = base.get(shape_key(r))
        if not b:
            continue
        ratio = [(_fixed(r[d] / b[d], 1) if d in r and d in b else "") for d in DIRECTIONS]
        shape = f"D{r['head_dim']} N{r['n']}{' causal' if r['causal'] else ''} (B{r['batch']} H{r['heads']})"
        lines.append(f"| {r['case']} | {shape} | {ratio[0]} | {ratio[1]} | {_fixed(r.get('mem_fwd_mb'), 0)} / "
                     f"{_fixed(r.get('mem_fwd_bwd_mb'), 0)} | {_fixed(b.get('mem_fwd_mb'), 0)} / {_fixed(b.get('mem_fwd_bwd_mb'), 0)} |")
    return "\n".join(lines)


_ORDER = [("softmax",), ("l2",), ("fenchel",), ("fenchel_t5",), ("sigmoid",), ("relu",), ("sinkhorn",), ("linear",),
          ("ot",)]


def speed_rows_markdown(rows) -> str:
    base = sdpa_ms(rows)
    out = []
    by_shape = defaultdict(list)
    for r in rows:
        by_shape[(r["head_dim"], r["causal"], r["n"])].append(r)
    for (hd, causal, n), group in sorted(by_shape.items()):
        b = base.get((hd, n, causal), {})
        r0 = group[0]
        out.append(f"\n### D{hd} N{n} {'causal' if causal else 'non-causal'} (B{r0['batch']} H{r0['heads']}, {r0['dtype']})\n")
        out.append("| case | fwd ms | fwd+bwd ms | fwd vs SDPA | fwd+bwd vs SDPA | extra MB fwd / fwd+bwd | first call s | note |")
        out.append("|---|---|---|---|---|---|---|---|")
        for r in group:
            ratio = [(_fixed(b[d] / r[d]) if d in r and d in b else "") for d in DIRECTIONS]
            mem = f"{_fixed(r.get('mem_fwd_mb'), 0)} / {_fixed(r.get('mem_fwd_bwd_mb'), 0)}"
            note = r.get("skipped") or r.get("error") or ""
            out.append(f"| {r['case']} | {_fixed(r.get('fwd'), 3)} | {_fixed(r.get('fwd+bwd'), 3)} | {ratio[0]} | {ratio[1]} | "
                       f"{mem} | {_fixed(r.get('first_call_s'), 1)} | {note[:120]} |")
    return "\n".join(out)




def speed_report(rows: list[dict], device: dict) -> str:
    """speed.md: the summary (fastest attnzoo backend per variant against SDPA), the cost-model table
    and every row; ``device``: {"name", "torch", "triton", ...}."""
    return "\n".join([
        f"# attnzoo on {device['name']} (torch {device['torch']}, triton {device.get('triton')})\n",
        "Ratios are SDPA default time / path time (higher is faster; 1.0 = as fast as SDPA softmax), "
        "measured side by side in one process by `benchmarks/gpu_speed.py`.\n",
        "## Summary: the fastest attnzoo backend per variant\n", speed_summary_markdown(rows),
        "\n## Sinkhorn, linear and OT as multiples of SDPA's time (lower is faster)\n", cost_model_markdown(rows),
        "\n## Every row", speed_rows_markdown(rows)]) + "\n"


# -- the model benchmark (attnzoo bench --models; model_bench.py's rows) -----------------------------

_MODES = ("eager", "compile", "cudagraphs")
_SHORT_MODE = {"eager": "eager", "compile": "compiled", "cudagraphs": "compiled + CUDA graphs"}


def _attention_label(row: dict, result: dict) -> str:
    if row["attention"] == "own":
        return f"own ({result['models'].get(row['model'], {}).get('own', 'own')})"
    return row["attention"]


def _launches(row: dict) -> str:
    if row.get("launches_per_step") is None:
        return ""
    text = f"{row['launches_per_step']:.0f}"
    if row.get("graph_launches_per_step"):
        text += f" + {row['graph_launches_per_step']:.0f} graphs"
    return text


def _model_cell(row: Optional[dict]) -> str:
    """'4.6k (0.82x)' or the status."""
    if row is None:
        return ""
    if row["status"] != OK:
        return _SHORT_STATUS.get(row["status"], row["status"])
    ratio = row.get("ratio_vs_own")
    return fmt_rate(row["items_per_s"]) + ("" if ratio is None or row["attention"] == "own" else f" ({ratio:.2f}x)")


MODEL_COLUMNS = ("attention", "mode", "throughput", "x own", "step", "host ms", "op host ms", "launches", "aten ops",
                 "GPU ms", "warm-up", "note")


def model_row_cells(row: dict, result: dict) -> list[str]:
    ok = row["status"] == OK
    step = row.get("step_s") or {}
    return [_attention_label(row, result), row["mode"],
            (fmt_rate(row["items_per_s"]) + " " + row["unit"]) if ok else _SHORT_STATUS.get(row["status"], row["status"]),
            "" if row.get("ratio_vs_own") is None else f"{row['ratio_vs_own']:.3f}",
            fmt_time(step.get("median")) if ok else "",
            "" if row.get("host_ms_per_step") is None else f"{row['host_ms_per_step']:.3g}",
            "" if row.get("op_host_ms_per_step") is None else f"{row['op_host_ms_per_step']:.3g}",
            _launches(row), "" if row.get("aten_ops_per_step") is None else f"{row['aten_ops_per_step']:.0f}",
            "" if row.get("device_ms_per_step") is None else f"{row['device_ms_per_step']:.3g}",
            fmt_time(row.get("warmup_s")), row.get("reason") or ""]


def models_summary_markdown(result: dict, modes=_MODES) -> str:
    """One table: a row per attention, a column per (model, mode); each cell the throughput and its
    ratio to the model's own attention in the same mode."""
    rows = result["results"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    modes = [m for m in modes if any(r["mode"] == m for r in rows)]
    columns = [(m, mode) for m in models for mode in modes
               if any(r["model"] == m and r["mode"] == mode and r["status"] == OK for r in rows)]
    if not columns:
        return "_no case finished_"
    attentions = list(dict.fromkeys(r["attention"] for r in rows))
    by_key = {(r["model"], r["mode"], r["attention"]): r for r in rows}
    lines = ["| attention | " + " | ".join(f"{m} {_SHORT_MODE[mode]}" for m, mode in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for attention in attentions:
        cells = [_model_cell(by_key.get((m, mode, attention))) for m, mode in columns]
        if any(cells):
            label = "own attention" if attention == "own" else attention
            lines.append(f"| {_md_escape(label)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def models_settings_line(result: dict) -> str:
    s, env = result["settings"], result["environment"]
    shapes = ", ".join(f"{name} batch {v['batch'] if s.get('batch') is None else s['batch']} x {v['seq']} tokens"
                       for name, v in s.get("shapes", {}).items())
    partial = (f"; stopped early, after {s.get('rows_logged')} of {s.get('planned_rows', '?')} cases"
               if s.get("complete") is False else "")
    return (f"{env.get('device_name')}, torch {env.get('torch')}, triton {env.get('triton')}; {s.get('size')} size: "
            f"{shapes}; {s.get('warmup')} warm-up steps, {s.get('blocks')} blocks of {s.get('steps')} steps, "
            f"{s.get('profile_steps')} profiled; run {result['created']}{partial}")


def models_report(result: dict) -> str:
    """models.md: the summary table, then per model every case with its host time and launches."""
    methods = result.get("methods", {})
    parts = [f"# attnzoo bench --models: {result['environment'].get('device_name')}", "", models_settings_line(result),
             ""] + [f"- {k}: {v}" for k, v in methods.items()] + [
        "", "## Throughput (x the model's own attention in the same mode)", "", models_summary_markdown(result), ""]
    for name, info in result["models"].items():
        rows = [r for r in result["results"] if r["model"] == name]
        if not rows:
            continue
        parts += [f"## {name}: {info['title']}", "", "| " + " | ".join(MODEL_COLUMNS) + " |",
                  "|" + "---|" * len(MODEL_COLUMNS)]
        parts += ["| " + " | ".join(_md_escape(c) for c in model_row_cells(r, result)) + " |" for r in rows]
        parts.append("")
    return "\n".join(parts)


def rich_models_table(result: dict):
    from rich.table import Table
    table = Table(title=f"attnzoo bench --models - {result['environment'].get('device_name')}")
    for col in ("model",) + MODEL_COLUMNS[:-1]:
        table.add_column(col, justify="left" if col in ("model", "attention", "mode") else "right")
    reasons: OrderedDict = OrderedDict()
    for r in result["results"]:
        cells = model_row_cells(r, result)[:-1]
        if r.get("reason"):
            cells[2] += f" [{reasons.setdefault(r['reason'], len(reasons) + 1)}]"
        table.add_row(r["model"], *cells, style=None if r["status"] == OK else "dim")
    table.caption = "\n".join(f"[{i}] {reason}" for reason, i in reasons.items())
    return table


def model_row_line(row: dict, elapsed: Optional[float] = None) -> str:
    """One plain line per finished case, for logs."""
    head = ("" if elapsed is None else f"[{elapsed:7.1f}s] ") + f"{row['model']:<6} {row['attention']:<22} {row['mode']:<10}"
    if row["status"] != OK:
        return f"{head} {row['status']}: {' '.join(str(row.get('reason')).split())[:200]}"
    ratio = "" if row.get("ratio_vs_own") is None else f" ({row['ratio_vs_own']:.3f}x own)"
    return (f"{head} {fmt_rate(row['items_per_s'])} {row['unit']}{ratio}, step {fmt_time(row['step_s']['median'])}, "
            f"host {row['host_ms_per_step']:.3g} ms, launches {_launches(row) or '-'}, "
            f"aten ops {row['aten_ops_per_step']:.0f}, warm-up {fmt_time(row['warmup_s'])}")


# -- the per-call overhead benchmark (attnzoo bench --overhead; overhead.py's rows) -------------------

def overhead_markdown(result: dict) -> str:
    """Per group (functional, layer): each candidate's median microseconds per fwd+bwd call, the
    reference's, the difference and the ratio (median of per-round ratios, with its p20-p80)."""
    out = []
    for group, title in (("functional", "`attnzoo.functional.<variant>` against `F.scaled_dot_product_attention`"),
                         ("layer", "`attnzoo.create(name, 64, 2)` against timm's `Attention(64, 2)`")):
        rows = [r for r in result["results"] if r["group"] == group and r["name"] != r["reference"]]
        if not rows:
            continue
        out += [f"**{title}**", "", "| call | us per fwd+bwd | reference us | extra us | ratio (p20-p80) |",
                "|---|---|---|---|---|"]
        for r in rows:
            if r["status"] != OK:
                out.append(f"| {_md_escape(r['name'])} | {_SHORT_STATUS.get(r['status'], r['status'])}: "
                           f"{_md_escape(r['reason'])} | | | |")
                continue
            ref = " (causal)" if r["reference"].endswith("(causal)") else ""
            out.append(f"| {_md_escape(r['name'])} | {r['us']:.1f} | {r['reference_us']:.1f}{ref} | {r['extra_us']:+.1f} | "
                       f"{r['ratio']:.2f} ({r['ratio_p20']:.2f}-{r['ratio_p80']:.2f}) |")
        out.append("")
    return "\n".join(out)


def overhead_report(result: dict) -> str:
    s, env = result["settings"], result["environment"]
    load = env.get("load_average")
    return "\n".join([
        f"# attnzoo bench --overhead: {env.get('device_name')}", "",
        f"{s['threads']} thread, q/k/v ({s['batch']}, {s['heads']}, {s['seq_len']}, {s['head_dim']}), layers "
        f"({s['batch']}, {s['seq_len']}, {s['dim']}) with {s['layer_heads']} heads; {s['rounds']} interleaved rounds of "
        f"{s['inner']} calls; torch {env.get('torch')}; load average {load[0] if load else '?'} at the end; "
        f"run {result['created']}", ""] + [f"- {k}: {v}" for k, v in result.get("methods", {}).items()] + [
        "", overhead_markdown(result)])


def rich_overhead_table(result: dict):
    from rich.table import Table
    table = Table(title="attnzoo bench --overhead (CPU, fwd+bwd per call, interleaved medians)")
    for col in ("call", "us", "reference", "ref us", "extra us", "ratio", "p20-p80"):
        table.add_column(col, justify="left" if col in ("call", "reference") else "right")
    for r in result["results"]:
        if r["name"] == r["reference"]:
            continue
        if r["status"] != OK:
            table.add_row(r["name"], r["status"], r["reference"], "", "", "", r.get("reason") or "", style="dim")
            continue
        table.add_row(r["name"], f"{r['us']:.1f}", r["reference"], f"{r['reference_us']:.1f}", f"{r['extra_us']:+.1f}",
                      f"{r['ratio']:.2f}", f"{r['ratio_p20']:.2f}-{r['ratio_p80']:.2f}")
    return table
