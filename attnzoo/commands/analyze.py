"""attnzoo analyze lipschitz|wasserstein|dynamics|fenchel|topolip: measure the papers' claims, write
JSON + PNG to --out (default runs/analysis/<tool>)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from . import UsageError

HELP = "check the papers with the library: Lipschitz, Wasserstein, dynamics, Fenchel dual, TopoLip"


def _csv(cast):
    def parse(s):
        return [cast(x) for x in s.split(",") if x]
    # argparse names the type in its error: "invalid comma-separated int list value: 'abc'"
    parse.__name__ = f"comma-separated {cast.__name__} list"
    return parse


def _shown(values) -> str:
    """A list default as it is typed on the command line: comma-separated, no brackets or quotes."""
    return ",".join(map(str, values))


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="tool", required=True, metavar="TOOL")
    p = sub.add_parser("lipschitz", help="query-Lipschitz estimate vs paper 002 / 001 bounds over N and R")
    default = ["softmax", "l2", "sinkhorn", "sigmoid", "multihead"]
    p.add_argument("--variants", type=_csv(str), default=default, metavar="V1,V2,...",
                   help=f"comma-separated variants to estimate (default {_shown(default)}); paper 002 bounds "
                   "softmax, l2, sinkhorn, sigmoid and multihead: any other is named on the figure, its estimates "
                   "in the JSON, and at least one bounded variant is needed")
    p.add_argument("--tokens", type=_csv(int), default=[2, 4, 8, 16], metavar="N1,N2,...",
                   help="comma-separated token counts N of the context X (default 2,4,8,16)")
    p.add_argument("--radii", type=_csv(float), default=[0.5, 1.0, 2.0], metavar="R1,R2,...",
                   help="comma-separated radii R of the ball B_R holding x and every token (default 0.5,1.0,2.0)")
    p.add_argument("--dim", type=int, default=3, help="token dimension d (default %(default)s)")
    p.add_argument("--samples", type=int, default=8,
                   help="random starting points (x, X) of the search for the sup, per N and R (default %(default)s)")
    p.add_argument("--ascent-steps", type=int, default=20,
                   help="gradient-ascent steps on ||D_x Gamma|| from each starting point (default %(default)s)")
    p = sub.add_parser("wasserstein", help="W1-Lipschitz ratios of attention on perturbed clouds")
    default = ["softmax", "l2", "sinkhorn", "sigmoid", "relu", "linear"]
    p.add_argument("--variants", type=_csv(str), default=default, metavar="V1,V2,...",
                   help=f"comma-separated variants to measure (default {_shown(default)})")
    p.add_argument("--tokens", type=int, default=16, help="points per cloud (default %(default)s)")
    p.add_argument("--dim", type=int, default=2, help="point dimension d (default %(default)s)")
    p.add_argument("--clouds", type=int, default=4,
                   help="random clouds, each perturbed by noise, dropped and added points (default %(default)s)")
    p = sub.add_parser("dynamics", help="particles vs Gaussian ODEs, d=2 cone study, limit-rank histograms")
    p.add_argument("--particles", type=int, default=20000,
                   help="particles sampled from the initial Gaussian (default %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="RK4 steps of the particle system up to t = 1 "
                   "(default %(default)s)")
    p.add_argument("--rank-points", type=int, default=30,
                   help="random starting covariances per histogram of limiting ranks (default %(default)s)")
    p = sub.add_parser("fenchel", help="paper 004 Fig 4: ||lambda* - alpha z|| / ||lambda*|| per layer and head")
    p.add_argument("--checkpoint", help="an `attnzoo train` run dir / .safetensors (needs --config)")
    p.add_argument("--config", help="the YAML config the checkpoint was trained with, or the run's metrics.json; "
                   "checked against the config the checkpoint records (model section and dataset)")
    p.add_argument("--train-seconds", type=float, default=60.0, help="without --checkpoint: train a tiny softmax "
                   "ViT on Fashion-MNIST this many seconds (default %(default)s)")
    p.add_argument("--images", type=int, default=64, help="Fashion-MNIST test images fed through the model "
                   "(default %(default)s)")
    p.add_argument("--alpha", type=float, default=1.0,
                   help="the scale alpha in ||lambda* - alpha z|| (> 0, default %(default)s)")
    p = sub.add_parser("topolip", help="TopoLip of ViTs with each attention variant vs a ResNet-18, clean and corrupted")
    default = ["softmax", "l2", "sigmoid", "linear"]
    p.add_argument("--variants", type=_csv(str), default=default, metavar="S1,S2,...",
                   help=f"comma-separated attention specs, one ViT each (default {_shown(default)})")
    p.add_argument("--train-seconds", type=float, default=30.0,
                   help="seconds of training on Fashion-MNIST per model (0: untrained; default %(default)s)")
    p.add_argument("--images", type=int, default=8, help="Fashion-MNIST test images, each one point cloud per layer "
                   "(default %(default)s)")
    p.add_argument("--max-points", type=int, default=64,
                   help="points kept per cloud (evenly spaced among its tokens) for the persistent homology "
                   "(default %(default)s)")
    for tool, q in sub.choices.items():
        q.add_argument("--out", help=f"output folder of the JSON and PNGs (default runs/analysis/{tool})")
        q.add_argument("--seed", type=int, default=0, help="seed of every random draw and of training "
                       "(default %(default)s)")
        q.add_argument("--threads", type=int, default=1, help="CPU threads torch uses (default %(default)s)")


POSITIVE = ("tokens", "dim", "samples", "ascent_steps", "clouds", "particles", "steps", "rank_points", "images",
            "max_points", "threads")


def check_arguments(args) -> None:
    """Every argument checked before any work or folder is made (UsageError)."""
    from .. import registry
    from ..analysis.fields import VARIANTS  # the fields the lipschitz / wasserstein formulas cover
    allowed = {"lipschitz": (*VARIANTS, "multihead"), "wasserstein": VARIANTS}.get(args.tool)
    if allowed is not None:
        for v in args.variants:
            if v not in allowed:
                close = [a for a in allowed if a.startswith(v[:3])] if v else []
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise UsageError(f"--variants: {args.tool} covers {', '.join(allowed)}; got {v!r}{hint}")
    elif args.tool == "topolip":
        for v in args.variants:
            try:
                registry.parse_spec(v)
            except (ValueError, TypeError) as e:
                raise UsageError(f"--variants: {e}") from None
    if getattr(args, "variants", None) == []:
        raise UsageError("--variants must name at least one variant")
    if args.tool == "lipschitz" and not any(map(_has_lipschitz_bound, args.variants)):
        bounded = [v for v in allowed if _has_lipschitz_bound(v)]
        raise UsageError(f"--variants: paper 002 gives no Lipschitz bound for {', '.join(args.variants)}, and the "
                         f"figure draws estimate / bound, so it would be empty; add a variant it bounds "
                         f"({', '.join(bounded)}): the others are then named on the figure, their estimates in the "
                         "JSON")
    for name in POSITIVE:
        values = getattr(args, name, None)
        for value in values if isinstance(values, list) else [values]:
            if value is not None and value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name, zero_allowed in (("radii", False), ("train_seconds", True), ("alpha", False)):
        values = getattr(args, name, None)
        for value in values if isinstance(values, list) else [values]:
            if value is not None and not (value >= 0 if zero_allowed else value > 0):
                raise UsageError(f"--{name.replace('_', '-')} must be {'>= 0' if zero_allowed else '> 0'}, got {value}")
    if args.tool == "fenchel":
        if args.checkpoint and not args.config:
            raise UsageError("--checkpoint needs --config (the YAML it was trained with, or the run's metrics.json)")
        for option, value in (("--checkpoint", args.checkpoint), ("--config", args.config)):
            if value and not Path(value).exists():
                raise UsageError(f"{option} {value!r} does not exist")
        if args.checkpoint:
            args.trained = _checked_checkpoint(args.checkpoint, args.config)
    if args.tool in ("fenchel", "topolip") and not (args.tool == "fenchel" and args.checkpoint):
        from ..train.datasets import FASHION_MNIST_INSTALL, fashion_mnist_present
        if not fashion_mnist_present():
            raise UsageError(f"analyze {args.tool} trains on Fashion-MNIST, which is not installed: "
                             f"{FASHION_MNIST_INSTALL}")


def _has_lipschitz_bound(variant: str) -> bool:
    """Whether paper 002 bounds the variant's query Lipschitz constant (``analysis.lipschitz.bounds``
    on any weights of the shapes ``_lipschitz`` draws: the bound's existence depends on the variant alone)."""
    import torch

    from ..analysis import lipschitz as L
    heads = variant == "multihead"
    x, v = (torch.ones(2, 1, 2), torch.eye(2).expand(2, 2, 2)) if heads else (torch.ones(2, 2), torch.eye(2))
    return L.main_bound("softmax" if heads else variant, x, x, v, radius=1.0) is not None


def run(args) -> int:
    check_arguments(args)
    import torch
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out or f"runs/analysis/{args.tool}")
    out.mkdir(parents=True, exist_ok=True)
    result = globals()[f"_{args.tool}"](args, out)
    path = out / f"{args.tool}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=float))
    tmp.replace(path)
    print(f"wrote {path} and the PNGs beside it")
    return 0


# ---- lipschitz ------------------------------------------------------------------------------------
def _lipschitz(args, out):
    import torch
    from tqdm import tqdm

    from ..analysis import lipschitz as L
    from ..analysis import plots
    d, rows = args.dim, []
    g = torch.Generator().manual_seed(args.seed)
    e = torch.zeros(1, d, dtype=torch.float64)
    e[0, 0] = 1.0
    weights = {}
    for v in args.variants:
        heads = v == "multihead"
        shape = (2, 1, d) if heads else (2, d)
        weights[(v, "random")] = (torch.randn(shape, generator=g, dtype=torch.float64) * 0.6,
                                  torch.randn(shape, generator=g, dtype=torch.float64) * 0.6,
                                  torch.randn((2, d, d) if heads else (d, d), generator=g, dtype=torch.float64)
                                  * (0.5 if heads else 1.0))
        if not heads:
            weights[(v, "aligned")] = (0.8 * e, 0.8 * e, torch.eye(d, dtype=torch.float64))
    jobs = [(v, w, n, R) for (v, w) in weights for n in args.tokens for R in args.radii]
    for v, w, n, R in tqdm(jobs, desc="lipschitz"):
        Q, K, V = weights[(v, w)]
        base = "softmax" if v == "multihead" else v
        kw = {"n_iters": 50} if v == "sinkhorn" else {}
        res = L.query_lipschitz(base, Q, K, V, n_tokens=n, radius=R, n_samples=args.samples,
                                ascent_steps=args.ascent_steps, seed=args.seed, **kw)
        rows.append({"variant": v, "weights": w, "n_tokens": n, "radius": R, "estimate": res["estimate"],
                     "max_trial": max(res["trials"]), "bound": L.main_bound(base, Q, K, V, radius=R),
                     "bounds": L.bounds(base, Q, K, V, radius=R)})
    plots.lipschitz_plot(rows, out / "lipschitz.png")
    return {"map": "D_x Gamma_X(x), X in B_R^N fixed, x in B_R (paper 002 Lemmas B.2-B.7)", "rows": rows}


# ---- wasserstein ----------------------------------------------------------------------------------
def _wasserstein(args, out):
    import torch
    from tqdm import tqdm

    from ..analysis import plots
    from ..analysis import wasserstein as W
    from ..analysis.fields import query_velocity
    d = args.dim
    g = torch.Generator().manual_seed(args.seed)
    eye = torch.eye(d, dtype=torch.float64)
    V = eye * 0.8 + 0.1
    clouds = [torch.randn((args.tokens, d), generator=g, dtype=torch.float64) for _ in range(args.clouds)]
    rows, bounds = [], {}
    for v in tqdm(args.variants, desc="wasserstein"):
        def F(X, v=v):
            return query_velocity(v, X, X, eye, eye, V, **({"n_iters": 100} if v == "sinkhorn" else {}))
        for r in W.ratio_study(F, clouds, kinds=("noise", "drop", "add"), strengths=(0.01, 0.1, 0.5),
                               metric="cityblock", seed=args.seed):
            rows.append({"variant": v, **r})
    k_l = float(torch.linalg.matrix_norm(V, ord=1))
    bounds["l2"] = W.thm29_bound(d, args.tokens - 1, args.tokens + 1, k_l)
    # paper 001 Thm 29 is for G = exp(-|x - y|^2): "l2" with Q = K = I and scale 1 is exactly that map
    plots.wasserstein_plot(rows, bounds, out / "wasserstein.png")
    return {"metric": "W1 with l1 ground cost (papers 000/001)", "Q=K": "identity", "V": V.tolist(),
            "thm29_bound": bounds, "rows": rows}


# ---- dynamics -------------------------------------------------------------------------------------
def _dynamics(args, out):
    import torch
    from tqdm import tqdm

    from ..analysis import dynamics, gaussian, particles, plots
    DT = torch.float64
    A = torch.tensor([[-0.35, 0.45], [-0.15, -0.25]], dtype=DT)
    L = torch.tensor([[1.0, 0.0], [0.6, 0.35]], dtype=DT) * 0.6
    g = torch.Generator().manual_seed(args.seed)
    X0 = torch.tensor([0.1, -0.05], dtype=DT) + torch.randn((args.particles, 2), generator=g, dtype=DT) @ L.T
    m0, S0 = particles.moments(X0)
    records, summary = {}, {}
    for v, a_scale in tqdm((("softmax", 1.0), ("l2", 0.5), ("sinkhorn", 1.0)), desc="particles"):
        Q, K, V = A * a_scale, torch.eye(2, dtype=DT), 2 * torch.tensor([[1.0, 0.3], [-0.2, 0.8]], dtype=DT)
        times, states = particles.rk4(particles.KernelSumField(v, Q, K, V, tol=1e-7), X0, t_end=1.0,
                                      n_steps=args.steps)
        sol = gaussian.solve_gaussian(v, m0, S0, Q, K, V, t_end=1.0, n_steps=200)
        emp = [particles.moments(X)[1] for X in states]
        records[v] = {"n": args.particles, "times": times, "emp_cov": torch.stack(emp).tolist(),
                      "ode_times": sol["times"].tolist(), "ode_cov": sol["Sigmas"].tolist()}
        S_end = sol["Sigmas"][-1]
        summary[v] = {"rel_cov_error_t1": float((emp[-1] - S_end).norm() / S_end.norm())}
        if v == "sinkhorn":
            wrong = gaussian.solve_gaussian(v, m0, S0, Q, K, V, t_end=1.0, n_steps=200, sinkhorn_form="prop")
            summary[v]["rel_cov_error_t1_prop_4_15"] = float((emp[-1] - wrong["Sigmas"][-1]).norm() / S_end.norm())
    plots.particles_plot(records, out / "particles.png")
    studies = {name: dynamics.d2_study(name, n_grid=5, n_steps=1500) for name in ("convergence", "divergence", "blowup")}
    plots.cone_plot(studies, out / "cone.png")
    hists = [dynamics.rank_histogram(d, n_points=args.rank_points, v_mode=m, seed=args.seed, t_end=1e5, progress=True)
             for m in ("identity", "random") for d in (3, 4, 5)]
    plots.rank_plot(hists, out / "ranks.png")
    return {"particles": summary, "sampling_scale": (2 / args.particles) ** 0.5,
            "d2": {k: [t["kind"] for t in s["trajectories"]] for k, s in studies.items()},
            "ranks": [{k: h[k] for k in ("d", "v_mode", "ranks", "blowups", "bound")} for h in hists]}


# ---- models for fenchel / topolip ------------------------------------------------------------------
def _fashion(n, train, seed):
    import torch

    from ..train.datasets import load_split
    x, y = load_split("fashion_mnist", train=train, download=False)
    idx = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:n]
    return (x[idx].float() / 255.0 - 0.2860) / 0.3530, y[idx]


def _train_vit(attention, seconds, seed):
    """A tiny attnzoo ViT (embed 64, depth 4, 4 heads, patch 4) trained on Fashion-MNIST for ``seconds``."""
    import torch

    from ..models.vit import ViT
    torch.manual_seed(seed)
    model = ViT(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=64, depth=4, num_heads=4,
                dropout=0.0, attention=attention)
    return _train(model, seconds, seed)


def _train(model, seconds, seed):
    import torch
    x, y = _fashion(12000, True, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    model.train()
    t0, step = time.time(), 0
    while time.time() - t0 < seconds:
        i = torch.randint(0, len(x), (64,))
        loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
    model.eval()
    xt, yt = _fashion(1000, False, seed)
    with torch.no_grad():
        acc = float((model(xt).argmax(1) == yt).float().mean())
    return model, {"steps": step, "seconds": seconds, "test_acc_1000": acc}


def _train_config(path: str):
    """The TrainConfig of a YAML config, or of a run's metrics.json (which records the resolved config,
    overrides included); UsageError naming --config when the file cannot be read as one."""
    from ..train.config import from_dict, read_yaml
    try:
        if path.endswith(".json"):
            cfg = json.loads(Path(path).read_text()).get("config")
        else:
            cfg = read_yaml(path)
    except (ValueError, AttributeError) as e:  # JSONDecodeError is a ValueError; AttributeError: not an object
        raise UsageError(f"--config {path!r} cannot be read: {' '.join(str(e).split())}") from None
    model = cfg.get("model") if isinstance(cfg, dict) else None
    if not isinstance(model, dict) or "name" not in model:
        raise UsageError(f"--config {path!r} has no model section with a name (a training config, or a run's "
                         "metrics.json)")
    try:
        return from_dict(cfg)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--config {path!r}: {e}") from None


def _checked_checkpoint(checkpoint: str, config: str):
    """(the model --config describes, with the checkpoint's weights loaded; its description), after
    checking the checkpoint against --config as ``train --resume`` does (one comparison,
    ``check_same_model``): the model section and the dataset. Without it, weights of another attention
    or head count with the same shapes would load into a model that was never trained."""
    from ..train.checkpoint import CheckpointError, check_same_model, load_checkpoint
    from ..train.config import TrainConfig
    from ..train.datasets import dataset_info
    from ..train.loop import model_from_config
    cfg = _train_config(config)
    if cfg.data.dataset != "fashion_mnist":
        raise UsageError(f"--config {config!r} trains on {cfg.data.dataset}; analyze fenchel reads Fashion-MNIST "
                         "images, so it needs a model trained on fashion_mnist")
    try:
        weights, state = load_checkpoint(checkpoint)
        check_same_model(state, cfg.to_dict(), checkpoint, defaults=TrainConfig().to_dict(),
                         advice="pass the config it was trained with (its run folder's metrics.json records it)")
    except CheckpointError as e:
        raise UsageError(f"--checkpoint: {e}") from None
    model = model_from_config(cfg, dataset_info(cfg.data.dataset))
    model.load_state_dict(weights)
    return model.eval(), {"checkpoint": str(checkpoint), "epoch": state["epoch"], "attention": cfg.model.attention}


# ---- fenchel --------------------------------------------------------------------------------------
def _fenchel(args, out):
    import numpy as np

    from ..analysis import fenchel_dual, plots
    if args.checkpoint:
        model, info = args.trained
    else:
        model, info = _train_vit("softmax", args.train_seconds, args.seed)
    x, _ = _fashion(args.images, False, args.seed + 1)
    devs = fenchel_dual.model_deviation(model, list(x.split(16)), alpha=args.alpha, progress=True)
    devs = {k: v.numpy() for k, v in devs.items()}
    plots.fenchel_plot(devs, out / "fenchel.png")
    return {"model": info, "alpha": args.alpha,
            "note": "pretrained BERT / T5 cannot be downloaded here; a ViT on Fashion-MNIST instead",
            "per_layer_head": {k: {"median": np.median(v, axis=1).tolist(), "p90": np.quantile(v, 0.9, axis=1).tolist()}
                               for k, v in devs.items()}}


# ---- topolip --------------------------------------------------------------------------------------
def _topolip(args, out):
    import timm
    import torch
    from tqdm import tqdm

    from ..analysis import plots, topolip
    x, _ = _fashion(args.images, False, args.seed + 2)
    models, info = {}, {}
    for v in tqdm(args.variants, desc="training ViTs"):
        models[f"vit-{v}"], info[f"vit-{v}"] = _train_vit(v, args.train_seconds, args.seed)
    torch.manual_seed(args.seed)
    resnet = timm.create_model("resnet18", pretrained=False, num_classes=10, in_chans=1)
    # the same images, upsampled x2 (56 x 56) so that the last stage is a 2 x 2 map, not a single point
    wrapped = torch.nn.Sequential(torch.nn.Upsample(scale_factor=2, mode="bilinear"), resnet)
    models["resnet18"], info["resnet18"] = _train(wrapped, args.train_seconds, args.seed)
    results = {}
    g = torch.Generator().manual_seed(args.seed)
    for name, m in tqdm(models.items(), desc="topolip"):
        r = m[1] if isinstance(m, torch.nn.Sequential) else m
        mods = list(m.blocks) if hasattr(m, "blocks") else [r.conv1, r.layer1, r.layer2, r.layer3, r.layer4]
        results[name] = {c: topolip.model_topolip(m, topolip.corrupt(x, c, generator=g), mods,
                                                  max_points=args.max_points)
                         for c in topolip.CORRUPTIONS}
    plots.topolip_plot(results, out / "topolip.png")
    strip = {m: {c: {k: r[k] for k in ("topolip", "wd", "rates", "wd_depth", "rate_depth")} for c, r in rs.items()}
             for m, rs in results.items()}
    return {"models": info, "clouds": "ViT: block outputs, tokens as points; ResNet-18: conv1 and stage outputs, "
            "each spatial position's channel vector as a point; the ResNet sees the images upsampled to 56 x 56",
            "results": strip}
