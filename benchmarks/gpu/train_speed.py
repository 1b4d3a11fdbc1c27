"""Training throughput of a timm ViT-S/16 (224 x 224, batch 128, bf16 autocast, fused AdamW) with
each attention layer swapped in through timm's ``attn_layer``: images per second, eager."""
from __future__ import annotations

import time
import traceback

import torch

import attnzoo
from attnzoo.train.throughput import step_profile

LAYERS = ["timm", "softmax", "l2", "sigmoid", "relu", "fenchel(preference='t5')", "sinkhorn", "ot"]


def images_per_second(spec: str, device, batch: int, warmup: int, steps: int, profile_steps: int = 0) -> dict:
    import timm
    torch.manual_seed(0)
    kw = {} if spec == "timm" else {"attn_layer": attnzoo.layer(spec)}
    model = timm.create_model("vit_small_patch16_224", num_classes=100, **kw).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    x = torch.randn(batch, 3, 224, 224, device=device)
    y = torch.randint(0, 100, (batch,), device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def timed(n):
        """(seconds of n steps, synchronised, and the last loss)."""
        start, loss = time.perf_counter(), None
        for _ in range(n):
            loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, loss

    first, _ = timed(warmup)
    seconds, loss = timed(steps)
    row = {"images_per_s": batch * steps / seconds, "warmup_s": first, "loss": float(loss.detach()),
           "finite": bool(torch.isfinite(loss))}
    if profile_steps:  # which kernels a step runs, and how long each takes, beside timm's own layer
        row["profile"] = step_profile(lambda: timed(profile_steps)[0], profile_steps, device)
    return row


def run(device, deadline: float, log, batch=128, warmup=3, steps=10, layers=None, profile_steps=2) -> list[dict]:
    rows = []
    for spec in LAYERS if layers is None else layers:
        if time.time() > deadline:
            log(f"train: deadline reached before {spec}")
            break
        row = {"layer": spec, "batch": batch}
        try:
            row.update(images_per_second(spec, device, batch, warmup, steps, profile_steps))
        except Exception as e:  # noqa: BLE001 - a failure is a result here
            row.update({"error": f"{type(e).__name__}: {e}"[:300], "trace": traceback.format_exc()[-800:]})
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        log(f"train {spec}: {row.get('images_per_s', row.get('error'))}")
    return rows
