"""Training throughput of paper 004's models (issue 16): the paper-size ViT and OT-ViT on
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


def run(device, deadline: float, log, steps=50, warmup=10, runs=None) -> list[dict]:
    rows = []
    for label, config, overrides in [r for r in RUNS if runs is None or r[0] in runs]:
        if time.time() > deadline:
            log(f"paper: deadline reached before {label}")
            break
        row = {"run": label, "config": config, "overrides": overrides}
        try:
            row.update(images_per_second(config, device=str(device), steps=steps, warmup=warmup, overrides=overrides))
        except Exception as e:  # noqa: BLE001 - a failure is a result
            row.update({"error": f"{type(e).__name__}: {e}"[:300], "trace": traceback.format_exc()[-800:]})
        rows.append(row)
        log(f"paper {label}: {row.get('train_images_per_s', row.get('error'))}")
    return rows
