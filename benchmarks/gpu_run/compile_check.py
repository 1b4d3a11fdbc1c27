"""torch.compile(fullgraph=True) of every registered layer name with the default backend ("auto"),
forward and backward under bf16 autocast, against the same layer run eagerly."""
from __future__ import annotations

import time
import traceback

import torch

from attnzoo import registry

NAMES = ["softmax", "l2", "fenchel(preference='t5')", "sigmoid", "relu", "sinkhorn", "linear", "ot", "masked",
         "multihead", "fenchel(preference='context')"]


def _step(model, x, name):
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = model(x, x, x, need_weights=False)[0] if name == "multihead" else model(x)
    grads = torch.autograd.grad(out.float().square().mean(), [p for p in model.parameters() if p.requires_grad])
    return out.float(), [g.float() for g in grads]


def check(name, device, dim=128, heads=2, n=64) -> dict:
    torch.manual_seed(0)
    layer = registry.create(name, dim, heads, **({"batch_first": True} if name == "multihead" else {}))
    layer = layer.to(device)
    x = torch.randn(2, n, dim, device=device)
    want, want_g = _step(layer, x, name)
    start = time.perf_counter()
    compiled = torch.compile(layer, fullgraph=True)
    got, got_g = _step(compiled, x, name)
    seconds = time.perf_counter() - start
    err = max([float((got - want).abs().max())] + [float((a - b).abs().max()) for a, b in zip(got_g, want_g)])
    scale = max([float(want.abs().max())] + [float(b.abs().max()) for b in want_g])
    return {"ok": err <= 0.05 * max(scale, 1e-3), "max_abs_diff": err, "compile_s": seconds}


def run(device, deadline: float, log) -> list[dict]:
    rows = []
    for name in NAMES:
        if time.time() > deadline:
            log(f"compile: deadline reached before {name}")
            break
        row = {"layer": name}
        try:
            row.update(check(name, device))
        except Exception as e:  # noqa: BLE001 - a failure is a result here
            row.update({"ok": False, "error": f"{type(e).__name__}: {e}"[:400], "trace": traceback.format_exc()[-1200:]})
        rows.append(row)
        log(f"compile {name}: {'ok' if row.get('ok') else row.get('error', row)}")
    return rows
