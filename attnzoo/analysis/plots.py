"""matplotlib figures for attnzoo.analysis results (Agg backend, one PNG per call)."""
from __future__ import annotations

import numpy as np


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def lipschitz_plot(rows, path):
    """rows: dicts(variant, weights, n_tokens, radius, estimate, bound). Estimate/bound vs N and vs R."""
    plt = _plt()
    variants = sorted({r["variant"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for v in variants:
        for w, ls in (("random", "-"), ("aligned", "--")):
            sel = [r for r in rows if r["variant"] == v and r["weights"] == w and r["bound"]]
            if not sel:
                continue
            rmax = max(r["radius"] for r in sel)
            by_n = sorted((r["n_tokens"], r["estimate"] / r["bound"]) for r in sel if r["radius"] == rmax)
            nmax = max(r["n_tokens"] for r in sel)
            by_r = sorted((r["radius"], r["estimate"] / r["bound"]) for r in sel if r["n_tokens"] == nmax)
            axes[0].plot(*zip(*by_n), ls, marker="o", label=f"{v} ({w})")
            axes[1].plot(*zip(*by_r), ls, marker="o", label=f"{v} ({w})")
    for ax, xl in zip(axes, ("tokens N (largest R)", "radius R (largest N)")):
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xlabel(xl)
        ax.set_ylabel("estimate / bound  (sup ||D_x Gamma||)")
        ax.set_ylim(0, 1.1)
    axes[0].set_xscale("log", base=2)
    axes[1].legend(fontsize=7)
    fig.suptitle("Query Lipschitz estimate vs paper 002 bounds (<= 1 everywhere)")
    unbounded = [v for v in variants if not any(r["bound"] for r in rows if r["variant"] == v)]
    if unbounded:  # no ratio to draw: say so on the figure rather than leave them out without a word
        fig.text(0.5, 0.005, f"no bound in paper 002 for {', '.join(unbounded)}: their estimates are in the "
                 "JSON only", ha="center", va="bottom", fontsize=8)
    return _save(fig, path)


def wasserstein_plot(rows, bounds, path):
    """rows: dicts(variant, kind, strength, ratio); bounds: {variant: bound or None}."""
    plt = _plt()
    variants = sorted({r["variant"] for r in rows})
    kinds = sorted({r["kind"] for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(len(kinds), 1)
    for j, kind in enumerate(kinds):
        for i, v in enumerate(variants):
            vals = [r["ratio"] for r in rows if r["variant"] == v and r["kind"] == kind]
            ax.scatter(np.full(len(vals), i + (j - len(kinds) / 2) * width), vals, s=12,
                       label=kind if i == 0 else None, color=f"C{j}")
    ax.set_xticks(range(len(variants)), variants)
    ax.set_ylabel("W1(F mu, F nu) / W1(mu, nu)")
    ax.set_yscale("log")
    for i, v in enumerate(variants):
        if bounds.get(v):
            ax.hlines(bounds[v], i - 0.4, i + 0.4, colors="k", linestyles="--")
    ax.legend(fontsize=8)
    ax.set_title("Wasserstein-Lipschitz ratios of attention on perturbed token clouds (dashed: paper 001 Thm 29)")
    return _save(fig, path)


def particles_plot(records, path):
    """records: {variant: dict(times, emp_cov (T,2,2), ode_times, ode_cov (T',2,2))}."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(records), figsize=(4 * len(records), 3.6))
    axes = np.atleast_1d(axes)
    for ax, (v, r) in zip(axes, records.items()):
        for (i, j), c in zip(((0, 0), (1, 1), (0, 1)), ("C0", "C1", "C2")):
            ax.plot(r["ode_times"], np.asarray(r["ode_cov"])[:, i, j], color=c, label=f"ODE Sigma_{i}{j}")
            ax.plot(r["times"], np.asarray(r["emp_cov"])[:, i, j], "o", color=c, ms=5)
        ax.set_title(f"{v}: n={r['n']} particles (dots) vs ODE")
        ax.set_xlabel("t")
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def cone_plot(studies, path):
    """studies: {name: d2_study result}. 3-D PSD cone for converging runs, trace-1 slice for diverging."""
    plt = _plt()
    fig = plt.figure(figsize=(5 * len(studies), 4.5))
    for k, (name, st) in enumerate(studies.items()):
        trajs = st["trajectories"]
        if name == "convergence":
            ax = fig.add_subplot(1, len(studies), k + 1, projection="3d")
            th = np.linspace(0, 2 * np.pi, 60)
            zmax = max(float(t["cone"][:, 2].max()) for t in trajs)
            for z in np.linspace(0, zmax, 6):
                ax.plot(z * np.cos(th), z * np.sin(th), z, color="0.8", lw=0.6)
            for t in trajs:
                c = np.asarray(t["cone"])
                ax.plot(c[:, 0], c[:, 1], c[:, 2], lw=1)
                ax.scatter(c[0, 0], c[0, 1], c[0, 2], s=8, color="k")
            ax.set_xlabel("a - b")
            ax.set_ylabel("2c")
            ax.set_zlabel("a + b")
        else:
            ax = fig.add_subplot(1, len(studies), k + 1)
            th = np.linspace(0, 2 * np.pi, 200)
            ax.plot(np.cos(th), np.sin(th), color="0.6", lw=0.8)
            for t in trajs:
                c = np.asarray(t["trace1"])
                ax.plot(c[:, 0], c[:, 1], lw=1)
                ax.scatter(c[0, 0], c[0, 1], s=8, color="k")
            ax.set_aspect("equal")
            ax.set_xlabel("(a - b) / tr")
            ax.set_ylabel("2c / tr")
        kinds = sorted({t["kind"] for t in trajs})
        ax.set_title(f"{name}: {st['variant']} ({', '.join(kinds)})")
    return _save(fig, path)


def rank_plot(hists, path):
    """hists: list of rank_histogram results (d x v_mode)."""
    plt = _plt()
    ds = sorted({h["d"] for h in hists})
    modes = sorted({h["v_mode"] for h in hists})
    fig, axes = plt.subplots(len(modes), len(ds), figsize=(3.2 * len(ds), 2.6 * len(modes)), squeeze=False)
    for i, m in enumerate(modes):
        for j, d in enumerate(ds):
            h = next(x for x in hists if x["d"] == d and x["v_mode"] == m)
            ax = axes[i, j]
            ax.hist(h["ranks"], bins=np.arange(-0.5, d + 1.5, 1), rwidth=0.8)
            ax.axvline(h["bound"] + 0.5, color="r", ls="--", lw=0.8)
            ax.set_title(f"d={d}, V={m} ({h['blowups']} blow-ups)", fontsize=9)
            ax.set_xlabel("rank of limit Sigma")
    return _save(fig, path)


def fenchel_plot(devs, path, *, title="||lambda* - alpha z|| / ||lambda*|| per layer (rows) and head"):
    """devs: {layer: array (H, n)}."""
    plt = _plt()
    layers = list(devs)
    H = max(np.asarray(v).shape[0] for v in devs.values())
    fig, axes = plt.subplots(len(layers), H, figsize=(2.4 * H, 1.7 * len(layers)), squeeze=False, sharex=True)
    for i, name in enumerate(layers):
        arr = np.asarray(devs[name])
        for h in range(arr.shape[0]):
            axes[i, h].hist(arr[h], bins=30, color=f"C{i % 10}")
            axes[i, h].tick_params(labelsize=6)
            if h == 0:
                axes[i, h].set_ylabel(name.replace(".attn", ""), fontsize=7)
            if i == 0:
                axes[i, h].set_title(f"head {h}", fontsize=8)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def topolip_plot(results, path):
    """results: {model: {corruption: model_topolip result}}."""
    plt = _plt()
    models = list(results)
    corr = sorted({c for r in results.values() for c in r})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for k, m in enumerate(models):
        r = results[m].get("clean") or next(iter(results[m].values()))
        axes[0].plot(r["wd_depth"], r["wd"], marker="o", label=m, color=f"C{k}")
        axes[1].plot(r["rate_depth"], r["rates"], marker="o", label=m, color=f"C{k}")
    width = 0.8 / max(len(models), 1)
    for k, m in enumerate(models):
        axes[2].bar(np.arange(len(corr)) + k * width, [results[m][c]["topolip"] if c in results[m] else np.nan
                                                        for c in corr], width, label=m, color=f"C{k}")
    axes[0].set(xlabel="depth (rescaled)", ylabel="WD(adjacent diagrams)", title="clean inputs")
    axes[1].set(xlabel="depth (rescaled)", ylabel="|(WD2 - WD1) / WD1|", title="change rate, clean")
    axes[2].set_xticks(np.arange(len(corr)) + width * (len(models) - 1) / 2, corr, fontsize=8)
    axes[2].set(ylabel="TopoLip = max change rate", title="TopoLip by corruption")
    axes[2].set_yscale("log")
    axes[1].legend(fontsize=7)
    return _save(fig, path)
