"""Sinkhorn's sliding window on the Triton backend (issue 29): the band in the kernels against the same
band folded into the mask (every tile visited), and a causal window solved as batched window problems
against the prefix loop (the band folded into the mask, is_causal=True: N growing prefixes).

Forward only, fp32 on the CPU under TRITON_INTERPRET=1 (there the time is about proportional to the
tiles the programs visit: a proxy, not a GPU speed), bf16 on a GPU. B = 1, H = 1, D = 16, n_iters = 3;
the best of --repeats after one warm-up call; the largest difference of the two outputs is printed too.

    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/sinkhorn_window.py --n 512 --window 16 --causal-n 64 \
        --causal-window 4
"""
from __future__ import annotations

import argparse
import time

import torch


def best_time(fn, repeats: int):
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        if out.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if out.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    import attnzoo.functional as AF
    from attnzoo.ops.logit_extras import window_band

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--window", type=int, default=16, help="left reach w of the window (w, 0)")
    parser.add_argument("--causal-n", type=int, default=64)
    parser.add_argument("--causal-window", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    for causal, n, w in ((False, args.n, args.window), (True, args.causal_n, args.causal_window)):
        q, k, v = (torch.randn(1, 1, n, 16, generator=gen).to(device, dtype) for _ in range(3))
        kw = dict(is_causal=causal, backend="triton", n_iters=3)
        native, a = best_time(lambda: AF.sinkhorn(q, k, v, window_size=(w, 0), **kw), args.repeats)
        band = window_band((w, 0), n, n, q.device)
        folded, b = best_time(lambda: AF.sinkhorn(q, k, v, attn_mask=band, **kw), args.repeats)
        what = ("causal: batched window problems vs the prefix loop" if causal
                else "non-causal: band in the kernels vs the folded mask")
        print(f"{what}, N = {n}, w = {w}, {device} {dtype}: {native:.3f} s vs {folded:.3f} s "
              f"({folded / native:.1f}x), max |diff| {float((a.float() - b.float()).abs().max()):.2e}")


if __name__ == "__main__":
    main()
