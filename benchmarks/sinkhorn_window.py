"""Sinkhorn's sliding window (issue 29): on the Triton and CPU backends a non-causal band in the passes
against the same band folded into the mask (every tile visited), and a causal window solved as
batched window problems against the prefix loop (the band folded into the mask, is_causal=True: N
growing prefixes), with --key-padding also under a per-key mask (a quarter of the keys padded: what a
Hugging Face sliding layer hands the kernel).

Forward, or forward + backward with --backward. Triton: fp32 on the CPU under TRITON_INTERPRET=1 (there
the time is about proportional to the tiles the programs visit: a proxy, not a GPU speed), bf16 on a GPU.
CPU backend ("cpu", the streaming PyTorch passes): fp32, real CPU time, --threads torch threads (1). B = 1,
H = 1, D = 16, n_iters = 3; the best of --repeats after one warm-up call; the largest difference of the two
outputs is printed too.

    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/sinkhorn_window.py --n 512 --window 16 --causal-n 64 \
        --causal-window 4
    PYTHONPATH=$PWD python benchmarks/sinkhorn_window.py --backends cpu --causal-n 512 --causal-window 16 \
        --key-padding
    PYTHONPATH=$PWD python benchmarks/sinkhorn_window.py --backends cpu --n 2048 --window 128 --causal-n 0 \
        --backward --repeats 3

On "cpu" the non-causal case compares the passes that walk only the band's tiles with the band folded
into the mask (every tile visited); --causal-n 0 leaves the causal cases out.
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


def step(call, backward: bool):
    """The timed function: the call, and with ``backward`` its backward too (the output, detached)."""
    def run():
        out = call()
        if backward:
            out.sum().backward()
        return out.detach()
    return run


def main() -> None:
    import attnzoo.functional as AF
    from attnzoo.ops.logit_extras import window_band

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--window", type=int, default=16, help="left reach w of the window (w, 0)")
    parser.add_argument("--causal-n", type=int, default=64)
    parser.add_argument("--causal-window", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--backends", default="triton,cpu", help="comma-separated: triton, cpu")
    parser.add_argument("--key-padding", action="store_true", help="causal rows also under a per-key mask")
    parser.add_argument("--backward", action="store_true", help="time forward + backward (sum of the output)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: on a shared machine more threads wait on each other per tile)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    for backend in args.backends.split(","):
        device = "cuda" if torch.cuda.is_available() and backend == "triton" else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        cases = [(False, args.n, args.window, False)]
        if args.causal_n > 0:
            cases.append((True, args.causal_n, args.causal_window, False))
        if args.key_padding and args.causal_n > 0:
            cases.append((True, args.causal_n, args.causal_window, True))
        for causal, n, w, padded in cases:
            q, k, v = (torch.randn(1, 1, n, 16, generator=gen).to(device, dtype).requires_grad_(args.backward)
                       for _ in range(3))
            keys = None
            if padded:
                keys = (torch.rand(1, 1, 1, n, generator=gen) > 0.25).to(device)
            kw = dict(is_causal=causal, backend=backend, n_iters=3)
            native, a = best_time(step(lambda: AF.sinkhorn(q, k, v, attn_mask=keys, window_size=(w, 0), **kw),
                                       args.backward), args.repeats)
            band = window_band((w, 0), n, n, q.device)
            mask = band if keys is None else band & keys
            folded, b = best_time(step(lambda: AF.sinkhorn(q, k, v, attn_mask=mask, **kw), args.backward),
                                  args.repeats)
            what = ("causal: batched window problems vs the prefix loop" if causal
                    else "non-causal: band in the passes vs the folded mask")
            what += ", forward + backward" if args.backward else ", forward"
            print(f"{backend}, {what}{', key padding' if padded else ''}, N = {n}, w = {w}, {device} {dtype}: "
                  f"{native:.3f} s vs {folded:.3f} s ({folded / native:.1f}x), "
                  f"max |diff| {float((a.float() - b.float()).abs().max()):.2e}")


if __name__ == "__main__":
    main()
