"""Training throughput of paper 004's models: the paper-size ViT and OT-ViT on
Fashion-MNIST-shaped data, with the training loop's own code (attnzoo.train.throughput), compiled as
the configs say and eagerly."""
from __future__ import annotations

import time
import traceback

from attnzoo.train.throughput import images_per_second

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


def run(device, deadline: float, log, steps=50, warmup=10, runs=None, profile_steps=5) -> list[dict]:
    """Each run's train images/s, and a profile of ``profile_steps`` more steps (launches and host
    waits per step, the busiest operators): the paper-size models are small enough for overhead to rule."""
    rows = []
    for label, config, overrides in [r for r in RUNS if runs is None or r[0] in runs]:
        if time.time() > deadline:
            log(f"paper: deadline reached before {label}")
            break
        row = {"run": label, "config": config, "overrides": overrides}
        try:
            row.update(images_per_second(config, device=str(device), steps=steps, warmup=warmup, overrides=overrides,
                                         profile_steps=profile_steps))
        except Exception as e:  # noqa: BLE001 - a failure is a result
            row.update({"error": f"{type(e).__name__}: {e}"[:300], "trace": traceback.format_exc()[-800:]})
        rows.append(row)
        profiled = row.get("profile", {})
        log(f"paper {label}: {row.get('train_images_per_s', row.get('error'))}"
            + (f" ({profiled['ms_per_step']:.1f} ms/step profiled, {profiled['launches_per_step']:.0f} launches, "
               f"{profiled['host_waits_per_step']:.1f} host waits per step)" if profiled else ""))
    return rows
