"""The "paper" phase of benchmarks/gpu_speed.py: training throughput of paper 004's models, the
paper-size ViT and OT-ViT on Fashion-MNIST-shaped data, with the training loop's own code
(attnzoo.train.throughput), compiled as the configs say, eagerly and with CUDA graphs. It lives here,
not in attnzoo.bench, because the harness sits below attnzoo.train in the package's layering."""
from __future__ import annotations

import time
import traceback

from attnzoo.train.throughput import images_per_second
from gpu_run.session import Phase

# (label, config, overrides)
RUNS = [
    ("vit compiled", "configs/vit_fashion_mnist.yaml", []),
    ("otvit compiled", "configs/otvit_fashion_mnist.yaml", []),
    ("vit eager", "configs/vit_fashion_mnist.yaml", ["train.compile=false"]),
    ("otvit eager", "configs/otvit_fashion_mnist.yaml", ["train.compile=false"]),
    ("otvit compiled blocks", "configs/otvit_fashion_mnist.yaml", ["train.compile=blocks"]),
    # CUDA graphs: a step of this small model is a few hundred short kernels, so launch overhead may rule
    ("vit compiled cudagraphs", "configs/vit_fashion_mnist.yaml", ["train.compile_mode=reduce-overhead"]),
    ("otvit compiled cudagraphs", "configs/otvit_fashion_mnist.yaml", ["train.compile_mode=reduce-overhead"]),
]


def selected(session) -> list[str]:
    """--paper-runs, "_" standing for " " (labels survive a shell's word splitting); default: all."""
    if session.args.paper_runs is None:
        return [r[0] for r in RUNS]
    runs = [label.replace("_", " ") for label in session.args.paper_runs]
    known = [r[0] for r in RUNS]
    unknown = [r for r in runs if r not in known]
    if unknown:
        raise SystemExit(f"--paper-runs: unknown runs {unknown}; known: {known}")
    return runs


def warm_paper(device: str, label: str) -> str:
    _, config, overrides = next(r for r in RUNS if r[0] == label)
    images_per_second(config, device=device, steps=1, warmup=1, overrides=overrides)
    return label


def run(session) -> list[dict]:
    """Each run's train images/s, and a profile of a few more steps (launches and host waits per step,
    the busiest operators): the paper-size models are small enough for overhead to rule."""
    steps, warmup = (50, 10) if session.device.type == "cuda" else (2, 1)
    deadline = session.deadline("paper")
    rows = []
    for label in selected(session):
        _, config, overrides = next(r for r in RUNS if r[0] == label)
        if time.time() > deadline:
            session.log(f"paper: deadline reached before {label}")
            break
        row = {"run": label, "config": config, "overrides": overrides}
        try:
            row.update(images_per_second(config, device=str(session.device), steps=steps, warmup=warmup,
                                         overrides=overrides, profile_steps=5))
        except Exception as e:  # noqa: BLE001 - a failure is a result
            row.update({"error": f"{type(e).__name__}: {e}"[:300], "trace": traceback.format_exc()[-800:]})
        rows.append(row)
        profiled = row.get("profile", {})
        session.log(f"paper {label}: {row.get('train_images_per_s', row.get('error'))}"
                    + (f" ({profiled['ms_per_step']:.1f} ms/step profiled, {profiled['launches_per_step']:.0f} launches, "
                       f"{profiled['host_waits_per_step']:.1f} host waits per step)" if profiled else ""))
    return rows


def add_arguments(parser) -> None:
    parser.add_argument("--paper-runs", nargs="*", default=None,
                        help="run labels for the paper phase, '_' for ' ' (default: all)")


PAPER = Phase("paper", run, share=0.15, add_arguments=add_arguments,
              warm_jobs=lambda session: [("paper", warm_paper, (str(session.device), label))
                                         for label in selected(session)])
