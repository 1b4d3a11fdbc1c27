"""Streaming Sinkhorn: the CPU path vs the eager reference (memory, time), and on a GPU the Triton
kernels vs SDPA softmax against the cost model.

    .venv/bin/python benchmarks/fused_sinkhorn.py            # B=1 H=4 D=64 N=4096 n_iters=3, fp32, 1 thread
    .venv/bin/python benchmarks/fused_sinkhorn.py --sweep 128 512 1024 2048   # one-shot, fresh processes
    .venv/bin/python benchmarks/fused_sinkhorn.py --steady 64 256 512 1024 2048  # warm, best of 3, time only
    python benchmarks/fused_sinkhorn.py --gpu [--gpu-dims 64 128] [--gpu-lens 1024 4096 16384]

--gpu (CUDA): bf16, batch * N = 16384 tokens, hidden 2048 (FlashAttention's benchmark shapes), per
(D, N): SDPA softmax and ``AF.sinkhorn(q, k, v, n_iters=k, backend="triton")`` forward and forward +
backward (median ms, attnzoo.bench.timing: triton.testing.do_bench), their ratio against the target k + 1, the extra peak
memory of each (vs SDPA's: target <= 1.5x), and one launch of each Sinkhorn pass (logsumexp pass and
final attend, each with a running maximum as the first pass runs and shifted by its known bound as
the others run; dv / last adjoint, adjoint weighted sum, the adjoint's factors with dq / dk) in ms and
as a fraction of SDPA's forward (docs/kernels_sinkhorn.md has the cost model). Writes
benchmarks/results/gpu/fused_sinkhorn_gpu.{json,md}.

A one-shot run in a fresh process pays the page faults of every new allocation; in a training loop
(--steady) the allocator reuses memory below glibc's mmap threshold (32 MB at most), so the eager
reference is faster there for small N x N matrices: --steady is what auto's threshold is based on.

Each measurement runs in a fresh subprocess (so one method's allocator cache cannot hide the
other's peak): peak memory = the process's high-water RSS (VmHWM) minus its RSS once the inputs
exist; time = one forward + backward after a small warm-up. Both run in one invocation, side by
side, on a machine other jobs share: treat times as +-20%. Writes JSON + PNG to
benchmarks/results/cpu/.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent / "results" / "cpu"
METHODS = ("reference", "cpu")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_one(method: str, B: int, H: int, N: int, D: int, n_iters: int) -> dict:
    """Runs inside the subprocess."""
    import torch

    import attnzoo.functional as AF

    torch.set_num_threads(1)
    warm = [torch.randn(1, 1, 32, D, requires_grad=True) for _ in range(3)]
    AF.sinkhorn(*warm, n_iters=n_iters, backend=method).sum().backward()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=gen).requires_grad_() for _ in range(3))
    base_kb = _status_kb("VmRSS")
    t0 = time.perf_counter()
    out = AF.sinkhorn(q, k, v, n_iters=n_iters, backend=method)
    out.square().sum().backward()
    seconds = time.perf_counter() - t0
    peak_kb = _status_kb("VmHWM")
    return dict(method=method, seconds=seconds, peak_extra_mb=(peak_kb - base_kb) / 1024,
                out_checksum=float(out.detach().double().abs().sum()))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    names = [r["method"] for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, key, label in ((axes[0], "peak_extra_mb", "peak memory above inputs (MB)"),
                           (axes[1], "seconds", "forward + backward (s)")):
        vals = [r[key] for r in runs]
        ax.bar(names, vals, color=["#999999", "#3b7dd8"])
        ax.set_title(label)
        for i, val in enumerate(vals):
            ax.text(i, val, f"{val:.1f}", ha="center", va="bottom")
    c = result["config"]
    fig.suptitle(f"Sinkhorn CPU fp32, B={c['B']} H={c['H']} N={c['N']} D={c['D']} n_iters={c['n_iters']}, 1 thread")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_pair(cfg: dict) -> dict:
    runs = []
    for method in METHODS:
        cmd = [sys.executable, __file__, "--one", method] + [f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        line = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.strip().splitlines()[-1]
        runs.append(json.loads(line))
        print(runs[-1], flush=True)
    ref, fused = runs
    return dict(config=dict(cfg, dtype="float32", threads=1), runs=runs,
                memory_ratio=fused["peak_extra_mb"] / ref["peak_extra_mb"],
                time_ratio=fused["seconds"] / ref["seconds"],
                command="python benchmarks/fused_sinkhorn.py " + " ".join(sys.argv[1:]),
                note="shared 2-core machine; one run each; peak = VmHWM - RSS after inputs")


def steady_times(sizes, B, H, D, n_iters, repeats=3) -> list:
    """In this process, warm, alternating the two methods; best of `repeats` per method."""
    import torch

    import attnzoo.functional as AF

    torch.set_num_threads(1)
    rows = []
    for n in sizes:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, n, D, generator=gen).requires_grad_() for _ in range(3))
        best = {m: float("inf") for m in METHODS}
        for _ in range(repeats):
            for m in METHODS:
                t0 = time.perf_counter()
                AF.sinkhorn(q, k, v, n_iters=n_iters, backend=m).square().sum().backward()
                best[m] = min(best[m], time.perf_counter() - t0)
        rows.append(dict(N=n, seconds=best, time_ratio=best["cpu"] / best["reference"]))
        print(rows[-1], flush=True)
    return rows


def plot_sweep(results: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["config"]["N"] for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, key, label in ((axes[0], "peak_extra_mb", "peak memory above inputs (MB)"),
                           (axes[1], "seconds", "forward + backward (s)")):
        for i, method in enumerate(METHODS):
            ax.plot(ns, [r["runs"][i][key] for r in results], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N")
        ax.set_title(label)
        ax.legend()
    fig.suptitle("Sinkhorn CPU fp32, B=1 H=4 D=64 n_iters=3, 1 thread")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def gpu_rows(head_dims, seq_lens, n_iters: int, tokens: int = 16384, hidden: int = 2048, device="cuda") -> list:
    """The --gpu measurement (see the module doc); one dict per (D, N)."""
    import torch
    import torch.nn.functional as F

    import attnzoo.functional as AF
    from attnzoo.bench.memory import peak_memory_bytes
    from attnzoo.bench.timing import TimingRule, time_call
    from attnzoo.ops.sinkhorn import triton as sk

    dev = torch.device(device)
    # the harness's rule: do_bench medians (25 ms warm-up, 100 ms of samples) for calls under a second
    rule = TimingRule(slow_call_seconds=1.0, once_above_seconds=1.0, do_bench_warmup_ms=25, do_bench_rep_ms=100)

    def bench(fn, leaves=()):
        return time_call(fn, dev, rule, grad_to_none=list(leaves) or None).stats.median * 1e3

    def peak_mb(fn):
        return peak_memory_bytes(fn, dev) / 2 ** 20

    rows = []
    for d in head_dims:
        for n in seq_lens:
            B, H = max(1, tokens // n), hidden // d
            gen = torch.Generator(device=dev).manual_seed(0)
            q, k, v = (torch.randn(B, H, n, d, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
                       for _ in range(3))
            grad = torch.randn_like(q)
            calls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
                     "sinkhorn": lambda: AF.sinkhorn(q, k, v, n_iters=n_iters, backend="triton")}
            row = dict(D=d, N=n, B=B, H=H, n_iters=n_iters)
            for name, call in calls.items():
                call().backward(grad)  # compile and autotune outside the samples
                with torch.no_grad():
                    row[f"{name}_fwd_ms"] = bench(call)
                    row[f"{name}_fwd_mb"] = peak_mb(call)
                row[f"{name}_fwd_bwd_ms"] = bench(lambda: call().backward(grad), (q, k, v))
                row[f"{name}_fwd_bwd_mb"] = peak_mb(lambda: call().backward(grad))
            row["fwd_ratio"] = row["sinkhorn_fwd_ms"] / row["sdpa_fwd_ms"]
            row["fwd_bwd_ratio"] = row["sinkhorn_fwd_bwd_ms"] / row["sdpa_fwd_bwd_ms"]
            row["mem_ratio"] = row["sinkhorn_fwd_bwd_mb"] / row["sdpa_fwd_bwd_mb"]
            # one launch of each pass, on the potentials of a real forward; the logsumexp passes with
            # their known bound (what a call runs after the first pass) and with a running maximum
            eng = sk.ENGINE
            with torch.no_grad():
                p = sk._problem(q.detach(), k.detach(), v.detach(), None, d ** -0.5, 1.0, True, True)
                out, lse, F, G, _ = eng.forward(p, n_iters)
                T, c = n_iters, p.col_target
                dout = grad.contiguous()
                delta = eng.row_dot(dout, out)
                dv, dg = eng.grad_v_and_bias(p, G[T], lse, dout, delta)
                terms = (F, G, dg.expand(T, *dg.shape).contiguous(), delta.expand(T, *delta.shape).contiguous())
                passes = {"lse pass, running max": lambda: eng._lse(p, F[T - 1], False, out_shift=c),
                          "lse pass, shifted": lambda: eng._lse(p, F[T - 1], False, out_shift=c, ref=G[T - 1]),
                          "attend, running max": lambda: eng.attend(p, G[T]),
                          "attend, shifted": lambda: eng.attend(p, G[T], ref=F[T - 1], ref_shift=c),
                          "dv + last adjoint": lambda: eng.grad_v_and_bias(p, G[T], lse, dout, delta),
                          "adjoint wsum": lambda: eng._wsum(p, F[T - 1], G[T], dg, True, shift=-c, out_scale=-1.0),
                          "factors + dq + dk": lambda: eng.grad_qk(p, G[T], lse, dout, delta, terms)}
                row["passes_ms"] = {name: bench(fn) for name, fn in passes.items()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def gpu_markdown(rows, device_name: str, command: str) -> str:
    k = rows[0]["n_iters"] if rows else 3
    lines = [f"# Sinkhorn (n_iters={k}) Triton kernels vs SDPA softmax, {device_name}, bf16", "",
             f"`{command}`. Targets: fwd and fwd+bwd <= {k + 1}x SDPA, extra memory <= 1.5x SDPA's.", "",
             "| D | N | B x H | SDPA fwd ms | Sinkhorn fwd ms | ratio | SDPA fwd+bwd ms | Sinkhorn fwd+bwd ms "
             "| ratio | extra MB fwd+bwd (SDPA) | passes, ms (x SDPA fwd) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        passes = ", ".join(f"{name} {ms:.3g} ({ms / r['sdpa_fwd_ms']:.2f})" for name, ms in r["passes_ms"].items())
        cells = [f"{r['D']}", f"{r['N']}", f"{r['B']} x {r['H']}", f"{r['sdpa_fwd_ms']:.3g}", f"{r['sinkhorn_fwd_ms']:.3g}",
                 f"{r['fwd_ratio']:.2f}", f"{r['sdpa_fwd_bwd_ms']:.3g}", f"{r['sinkhorn_fwd_bwd_ms']:.3g}",
                 f"{r['fwd_bwd_ratio']:.2f}", f"{r['sinkhorn_fwd_bwd_mb']:.0f} ({r['sdpa_fwd_bwd_mb']:.0f})", passes]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--n-iters", type=int, default=3)
    ap.add_argument("--sweep", type=int, nargs="+", help="several N: a sweep JSON + plot instead")
    ap.add_argument("--steady", type=int, nargs="+", help="several N: warm in-process times, best of 3")
    ap.add_argument("--gpu", action="store_true", help="Triton kernels vs SDPA on CUDA (see the module doc)")
    ap.add_argument("--gpu-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--gpu-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)  # subprocess mode
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    args = ap.parse_args()
    cfg = dict(B=args.B, H=args.H, N=args.N, D=args.D, n_iters=args.n_iters)
    if args.one:
        print(json.dumps(measure_one(args.one, **cfg)))
        return
    if args.gpu:
        import torch
        out = Path(__file__).resolve().parent / "results" / "gpu"
        out.mkdir(parents=True, exist_ok=True)
        rows = gpu_rows(args.gpu_dims, args.gpu_lens, args.n_iters)
        command = "python benchmarks/fused_sinkhorn.py " + " ".join(sys.argv[1:])
        (out / "fused_sinkhorn_gpu.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows,
                                                                     command=command), indent=2) + "\n")
        (out / "fused_sinkhorn_gpu.md").write_text(gpu_markdown(rows, torch.cuda.get_device_name(), command))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.steady:
        rows = steady_times(args.steady, args.B, args.H, args.D, args.n_iters)
        result = dict(config=dict(cfg, N=args.steady, dtype="float32", threads=1), rows=rows,
                      command="python benchmarks/fused_sinkhorn.py " + " ".join(sys.argv[1:]),
                      note="shared 2-core machine; warm, alternating, best of 3 forward + backward")
        (args.out / "fused_sinkhorn_steady.json").write_text(json.dumps(result, indent=2) + "\n")
        return
    if args.sweep:
        results = [run_pair(dict(cfg, N=n)) for n in args.sweep]
        (args.out / "fused_sinkhorn_sweep.json").write_text(json.dumps(results, indent=2) + "\n")
        plot_sweep(results, args.out / "fused_sinkhorn_sweep.png")
        for r in results:
            print(f"N={r['config']['N']}: memory ratio {r['memory_ratio']:.3f}, time ratio {r['time_ratio']:.3f}")
        return
    result = run_pair(cfg)
    stem = f"fused_sinkhorn_N{args.N}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / f"{stem}.png")
    print(f"memory ratio {result['memory_ratio']:.3f}, time ratio {result['time_ratio']:.3f}")


if __name__ == "__main__":
    main()
