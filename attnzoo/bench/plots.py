"""PNG plots: time and peak memory against N, log-log, one panel per variant, one line per backend (the
grid benchmark); the GPU kernel measurement's ratios to SDPA (``plot_speed``)."""
from __future__ import annotations

import math
import re
from collections import OrderedDict
from pathlib import Path

from .errors import OK
from .report import DIRECTIONS, best_per_variant, fmt_bytes, fmt_time, sdpa_ms

# (y label, value, tick format, log base of the y ticks): bytes read best at powers of two
METRICS = {"time": ("median time", lambda r: r["time_s"]["median"], fmt_time, 10),
           "memory": ("peak memory", lambda r: r.get("peak_memory_bytes"), fmt_bytes, 2)}


def _axes_style(ax, xs, ys, fmt, base, ticker) -> None:
    """Plain-text ticks (matplotlib's default log ticks are mathtext, slow to lay out) at whole
    decades, with the y range widened to whole decades so every panel shows at least two labels."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=base)
    ax.yaxis.set_major_locator(ticker.LogLocator(base=base, numticks=6))
    ax.xaxis.set_major_locator(ticker.FixedLocator(sorted(set(xs))))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: fmt(y)))
    ax.yaxis.set_minor_locator(ticker.NullLocator())
    if ys:
        lo, hi = math.log(min(ys), base), math.log(max(ys), base)
        ax.set_ylim(base ** math.floor(lo - 0.05), base ** math.ceil(hi + 0.05))


def _slug(mode: str, dtype: str, heads: int, head_dim: int, many: bool) -> str:
    base = f"{mode.replace('+', '_')}_{dtype}"
    return base + (f"_h{heads}_d{head_dim}" if many else "")


def _stale_plots(out_dir: Path, prefix: str) -> list[Path]:
    """The plots an earlier run named ``prefix`` left in ``out_dir`` (exactly the names ``_slug`` makes)."""
    pattern = re.compile(re.escape(prefix) + rf"({'|'.join(METRICS)})_(fwd|fwd_bwd)_[a-z0-9]+(_h\d+_d\d+)?\.png")
    return [p for p in out_dir.iterdir() if pattern.fullmatch(p.name)]


# a figure narrower than this cuts its title off (one panel of 3.6 inches)
MIN_FIGURE_WIDTH = 7.2


def _colours(rows: list[dict], plt) -> dict:
    """One colour per backend name, the same in every panel of a figure."""
    names = sorted({r["backend"] for r in rows})
    cycle = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {name: cycle(i % cycle.N) for i, name in enumerate(names)}


def plot_results(result: dict, out_dir, prefix: str = "") -> list[Path]:
    """Write ``{prefix}time_<mode>_<dtype>.png`` and ``{prefix}memory_<mode>_<dtype>.png``; return the paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # a re-run into the same folder: the plots of modes, dtypes or shapes this run lacks would sit
    # beside a JSON they do not belong to
    for path in _stale_plots(out_dir, prefix):
        path.unlink()
    # "auto" duplicates the line of the backend it resolves to: left out of the plots
    rows = [r for r in result["results"] if r["status"] == OK and r["backend"] != "auto"]
    groups = OrderedDict()
    for r in rows:
        groups.setdefault((r["mode"], r["dtype"], r["heads"], r["head_dim"]), []).append(r)
    many = len({(h, d) for (_, _, h, d) in groups}) > 1
    device = result["environment"].get("device_name", "")
    written = []
    for (mode, dtype, heads, head_dim), members in groups.items():
        variants = list(OrderedDict.fromkeys(r["variant"] for r in members))
        for metric, (ylabel, value, fmt, base) in METRICS.items():
            if not any(value(r) for r in members):  # --no-memory: no plot of empty axes
                continue
            ncols = min(5, len(variants))
            nrows = math.ceil(len(variants) / ncols)
            colours = _colours(members, plt)
            height = 2.9 * nrows + 0.7
            width = max(3.6 * ncols, MIN_FIGURE_WIDTH)
            fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False)
            for ax, variant in zip(axes.flat, variants):
                lines = OrderedDict()
                for r in members:
                    if r["variant"] == variant and value(r):
                        lines.setdefault((r["backend"], r["kind"]), []).append((r["seq_len"], value(r)))
                for (backend, kind), points in lines.items():
                    points.sort()
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, marker="o", markersize=3, linestyle="--" if kind == "baseline" else "-",
                            color=colours[backend], label=backend)
                _axes_style(ax, [x for pts in lines.values() for x, _ in pts],
                            [y for pts in lines.values() for _, y in pts], fmt, base, ticker)
                ax.set_title(variant, fontsize=9)
                ax.set_xlabel("N", fontsize=8)
                ax.tick_params(labelsize=7)
                if lines:
                    ax.legend(fontsize=6)
            for ax in list(axes.flat)[len(variants):]:
                ax.axis("off")
            axes[0][0].set_ylabel(ylabel, fontsize=8)
            fig.suptitle(f"{metric} vs N - {mode}, {dtype}, {heads} head(s) x {head_dim}, batch*N fixed - {device}",
                         fontsize=10)
            # fixed margins: tight_layout costs seconds per figure on a small machine
            fig.subplots_adjust(left=0.9 / width, right=0.98, bottom=0.5 / height, top=1 - 0.6 / height,
                                wspace=0.35, hspace=0.45)
            path = out_dir / f"{prefix}{metric}_{_slug(mode, dtype, heads, head_dim, many)}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written


def plot_speed(rows: list[dict], path) -> None:
    """The GPU kernel measurement's bar chart: per shape and direction, SDPA's time over the fastest
    attnzoo backend's, one bar per variant flavour (log scale; > 1 is faster than SDPA)."""
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
