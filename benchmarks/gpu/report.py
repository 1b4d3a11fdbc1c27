"""Turning gpu_speed.py's rows into what people read: a Markdown report, the measured ranking table
that ``auto`` reads (attnzoo/ops/measured_tables/<device>.json), and one plot."""
from __future__ import annotations

import json
import math
from collections import defaultdict

DIRECTIONS = ("fwd", "fwd+bwd")
SUMMARY_SHAPES = [(64, 4096, False), (128, 4096, False), (64, 16384, False), (64, 4096, True), (128, 16384, True),
                  (64, 1024, False)]
# the variants whose targets are written as "at most k times SDPA's time" (Sinkhorn, linear, OT)
COST_MODEL_VARIANTS = ("sinkhorn", "linear", "ot")


def shape_key(row) -> tuple:
    return (row["head_dim"], row["n"], row["causal"])


def _fmt(x, digits=2):
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


def measured_table(rows, device: dict) -> dict:
    entries = []
    groups = defaultdict(list)
    for r in rows:
        if r.get("table_variant"):
            for d in DIRECTIONS:
                if d in r:
                    groups[(r["table_variant"], r["flavour"], r["dtype"], r["causal"], r["head_dim"], r["n"], d)].append(
                        (r[d], r["backend"]))
    for (variant, flavour, dtype, causal, hd, n, d), timed in sorted(groups.items(), key=str):
        timed.sort()
        entries.append({"variant": variant, "flavour": flavour, "dtype": dtype, "causal": causal, "head_dim": hd,
                        "n": n, "direction": d, "ranking": [b for _, b in timed],
                        "ms": {b: round(ms, 4) for ms, b in timed}})
    return {"device": device["name"], "capability": device["capability"], "torch": device["torch"],
            "triton": device.get("triton"), "source": "benchmarks/gpu_speed.py", "entries": entries}


def summary_markdown(rows) -> str:
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
                    cells.append(_fmt(base[s][d] / r[d]) if r else "")
                else:
                    hit = best.get((variant, s, d))
                    cells.append(f"{_fmt(base[s][d] / hit[0])} ({hit[1]})" if hit else "")
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
        ratio = [(_fmt(r[d] / b[d], 1) if d in r and d in b else "") for d in DIRECTIONS]
        shape = f"D{r['head_dim']} N{r['n']}{' causal' if r['causal'] else ''} (B{r['batch']} H{r['heads']})"
        lines.append(f"| {r['case']} | {shape} | {ratio[0]} | {ratio[1]} | {_fmt(r.get('mem_fwd_mb'), 0)} / "
                     f"{_fmt(r.get('mem_fwd_bwd_mb'), 0)} | {_fmt(b.get('mem_fwd_mb'), 0)} / {_fmt(b.get('mem_fwd_bwd_mb'), 0)} |")
    return "\n".join(lines)


_ORDER = [("softmax",), ("l2",), ("fenchel",), ("fenchel_t5",), ("sigmoid",), ("relu",), ("sinkhorn",), ("linear",),
          ("ot",)]


def full_markdown(rows) -> str:
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
            ratio = [(_fmt(b[d] / r[d]) if d in r and d in b else "") for d in DIRECTIONS]
            mem = f"{_fmt(r.get('mem_fwd_mb'), 0)} / {_fmt(r.get('mem_fwd_bwd_mb'), 0)}"
            note = r.get("skipped") or r.get("error") or ""
            out.append(f"| {r['case']} | {_fmt(r.get('fwd'), 3)} | {_fmt(r.get('fwd+bwd'), 3)} | {ratio[0]} | {ratio[1]} | "
                       f"{mem} | {_fmt(r.get('first_call_s'), 1)} | {note[:120]} |")
    return "\n".join(out)


def write_plot(rows, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    base = sdpa_ms(rows)
    best = best_per_variant(rows)
    shapes = [s for s in sorted(base)]
    variants = sorted({k[0] for k in best}, key=str)
    fig, axes = plt.subplots(1, 2, figsize=(16, 5.5), sharey=True)
    for ax, d in zip(axes, DIRECTIONS):
        width = 0.8 / max(1, len(variants))
        for i, var in enumerate(variants):
            ys = [base[s][d] / best[(var, s, d)][0] if (var, s, d) in best and d in base[s] else 0 for s in shapes]
            ax.bar([x + i * width for x in range(len(shapes))], ys, width,
                   label=var[0] + ("" if var[1] == "plain" else "+" + var[1]))
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks([x + 0.4 for x in range(len(shapes))])
        ax.set_xticklabels([f"D{h}\nN{n}{' c' if c else ''}" for h, n, c in shapes], fontsize=7)
        ax.set_title(f"{d}: SDPA time / attnzoo time (fastest backend; > 1 is faster than SDPA)")
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(obj, path) -> None:
    path.write_text(json.dumps(obj, indent=1, default=str))
