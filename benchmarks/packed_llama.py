"""Padded vs packed (padding-free) fine-tuning of a small Llama swapped to an attnzoo variant, and the
packed attention's peak memory.

speed:  one fine-tuning step (forward, backward, AdamW) on a batch of mixed lengths in which half the
        padded tokens are padding: the padded (B, max) batch with its padding mask against the same
        sequences packed into one row (restarting position_ids plus cu_seq_lens_q/k, what
        DataCollatorWithFlattening(return_flash_attn_kwargs=True) sends). Reports real tokens/s.
memory: peak resident memory (fresh process each) of one packed attention call, forward and backward,
        at T = 8192 tokens made of N sequences (16 by default, and 8, 4 to show the growth with the sum of
        n_i^2), against the same T tokens with the block-diagonal (T, T) mask a padding-free HF model
        builds without packed kernels.

    PYTHONPATH=$PWD python benchmarks/packed_llama.py speed --variants softmax sigmoid
    PYTHONPATH=$PWD python benchmarks/packed_llama.py memory
    PYTHONPATH=$PWD python benchmarks/packed_llama.py routes

growth: the same memory measurement as T grows with the number of sequences at a fixed length (T = 4096 of
        8 and 8192 of 16): packed against the dense block-diagonal mask, backends "cpu" (the packed
        blockwise call) and "reference" (the stacked per-length batch).

    PYTHONPATH=$PWD python benchmarks/packed_llama.py growth --out benchmarks/results/cpu/packed_memory_growth.json

routes: one causal softmax attention call (forward + backward, backend "cpu", one thread, fresh process
        each) at T = 8192 of 16 sequences, mixed lengths and equal ones: the packed blockwise call, one
        call per distinct length, and the dense block-diagonal mask. Seconds and peak resident memory.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from attnzoo.bench import packed_batch

# half the padded tokens are padding: 8 x 512 slots, 2048 real tokens (the model benchmark's llama_packed
# row at its full size: attnzoo bench --models llama_padded llama_packed)
LENGTHS = packed_batch.mixed_lengths(8, 512)


def llama(variant: str, hidden: int, layers: int):
    import attnzoo
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = {**packed_batch.SMALL_LLAMA, "hidden_size": hidden, "intermediate_size": 2 * hidden,
              "num_hidden_layers": layers}
    return attnzoo.swap(LlamaForCausalLM(LlamaConfig(**config)), variant).train()


def batches(lengths):
    seqs = packed_batch.sequences(lengths, packed_batch.SMALL_LLAMA["vocab_size"], torch.Generator().manual_seed(0))
    return packed_batch.padded(seqs), packed_batch.packed(seqs)


def step_times(runs: dict, steps: int) -> dict:
    """Median seconds of one step per run, the runs interleaved step by step so that a machine shared
    with other work slows them alike; the first step of each warms up (allocations, plans)."""
    optimisers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, (model, _) in runs.items()}
    times: dict = {name: [] for name in runs}
    for i in range(steps + 1):
        for name, (model, batch) in runs.items():
            start = time.perf_counter()
            optimisers[name].zero_grad(set_to_none=True)
            model(**batch).loss.backward()
            optimisers[name].step()
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def speed(args) -> dict:
    torch.set_num_threads(args.threads)
    padded, packed = batches(LENGTHS)
    real = sum(LENGTHS)
    rows = {}
    for variant in args.variants:
        t = step_times({"padded": (llama(variant, args.hidden, args.layers), padded),
                        "packed": (llama(variant, args.hidden, args.layers), packed)}, args.steps)
        t_pad, t_pack = t["padded"], t["packed"]
        rows[variant] = {"padded_tokens_per_s": real / t_pad, "packed_tokens_per_s": real / t_pack,
                         "speedup": t_pad / t_pack, "padded_step_s": t_pad, "packed_step_s": t_pack}
        print(f"{variant:10s} padded {real / t_pad:8.0f} tok/s   packed {real / t_pack:8.0f} tok/s   "
              f"x{t_pad / t_pack:.2f}", flush=True)
    return {"lengths": LENGTHS, "padding_fraction": 1 - real / (len(LENGTHS) * max(LENGTHS)),
            "hidden": args.hidden, "layers": args.layers, "threads": args.threads, "rows": rows}


def mixed_lengths(total: int, n_seq: int) -> list[int]:
    """n_seq distinct lengths around total / n_seq (from 0.5x to 1.5x of it), summing to total: the
    per-length route makes one call per sequence here, its worst case."""
    mean = total // n_seq
    lengths = [mean // 2 + (mean * i) // max(n_seq - 1, 1) for i in range(n_seq)]
    lengths[-1] += total - sum(lengths)
    return lengths


def one_attention_call(how: str, total: int, n_seq: int, heads: int, head_dim: int, backend: str,
                       mixed: bool = False) -> float:
    """Runs in its own process: one forward + backward of causal softmax attention on T = total tokens
    made of n_seq sequences (equal lengths, or ``mixed_lengths``); returns its seconds, the caller reads
    the peak RSS. how: "packed" (attnzoo.functional.varlen: on CPU with backend "cpu", the packed
    blockwise call), "per_length" (one call per distinct length, the route before it) or "mask" (the
    T x T block-diagonal mask a padding-free HF model builds without packed kernels)."""
    import attnzoo.functional as AF
    from attnzoo.ops import varlen
    lengths = mixed_lengths(total, n_seq) if mixed else [total // n_seq] * n_seq
    q, k, v = (torch.randn(total, heads, head_dim, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    start = time.perf_counter()
    if how == "packed":
        out = AF.varlen("softmax", q, k, v, cu, cu, max(lengths), max(lengths), is_causal=True, backend=backend)
    elif how == "per_length":
        offsets = cu.tolist()
        out = varlen.per_sequence(AF.softmax, q, k, v, offsets, offsets, dict(is_causal=True, backend=backend))
    else:
        seq = torch.searchsorted(cu[1:].long(), torch.arange(total), right=True)
        block = ((seq[:, None] == seq[None, :]) & torch.ones(total, total, dtype=torch.bool).tril())
        out = AF.softmax(*(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=block, backend=backend)
    out.sum().backward()
    return time.perf_counter() - start


def peak_rss_mb(*call_args) -> float:
    return measured_call(*call_args)[1]


def measured_call(*call_args) -> tuple[float, float]:
    """(seconds, peak resident MiB added) of one_attention_call(*call_args) in a fresh process."""
    code = (f"import sys; sys.path.insert(0, {sys.path[0]!r}); import resource, torch; import attnzoo; "
            f"torch.set_num_threads(1); base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
            f"from packed_llama import one_attention_call; s = one_attention_call(*{call_args!r}); "
            f"print(s, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, mib = out.stdout.strip().splitlines()[-1].split()
    return float(seconds), float(mib)


def routes(args) -> dict:
    """Packed blockwise vs per length vs dense block mask, backend "cpu", T tokens of N sequences."""
    rows = []
    for mixed in (True, False):
        for how in ("packed", "per_length", "mask"):
            seconds, mib = measured_call(how, args.total, args.n_seq, args.heads, args.head_dim, "cpu", mixed)
            row = {"route": how, "lengths": "mixed" if mixed else "equal", "seconds": seconds, "peak_added_mib": mib}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"total": args.total, "n_seq": args.n_seq, "heads": args.heads, "head_dim": args.head_dim,
            "threads": 1, "fwd_bwd": True, "causal": True, "rows": rows}


def memory(args) -> dict:
    rows = []
    for backend in args.backends:
        for n_seq in (16, 8, 4):
            n = args.total // n_seq
            packed = peak_rss_mb("packed", args.total, n_seq, args.heads, args.head_dim, backend)
            row = {"backend": backend, "n_seq": n_seq, "sum_n_sq": n_seq * n * n, "packed_peak_mb": packed}
            if n_seq == 16:
                row["block_mask_peak_mb"] = peak_rss_mb("mask", args.total, n_seq, args.heads, args.head_dim, backend)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"total": args.total, "heads": args.heads, "head_dim": args.head_dim, "rows": rows}


def growth(args) -> dict:
    """Peak memory of one causal packed attention call (forward + backward) as T grows with the number of
    sequences, n_i fixed (T = 4096 of 8 and T = 8192 of 16 by default: sum n_i^2 doubles, T^2 quadruples),
    against the dense (T, T) block-diagonal mask on the same tokens; each call in a fresh process, its
    peak resident memory above the process's after the imports (ru_maxrss delta, one thread)."""
    rows = []
    for backend in args.backends:
        for total, n_seq in zip(args.totals, args.n_seqs):
            n = total // n_seq
            for how in ("packed", "mask"):
                seconds, mib = measured_call(how, total, n_seq, args.heads, args.head_dim, backend)
                row = {"backend": backend, "route": how, "total": total, "n_seq": n_seq, "n": n,
                       "sum_n_sq": n_seq * n * n, "t_sq": total * total, "seconds": seconds, "peak_added_mib": mib}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return {"heads": args.heads, "head_dim": args.head_dim, "dtype": "float32", "threads": 1, "fwd_bwd": True,
            "causal": True, "measure": "ru_maxrss delta after imports, fresh process per row", "rows": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--variants", nargs="+", default=["softmax"])
    s.add_argument("--hidden", type=int, default=256)
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--steps", type=int, default=3)
    s.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    m = sub.add_parser("memory")
    m.add_argument("--total", type=int, default=8192)
    m.add_argument("--heads", type=int, default=1)
    m.add_argument("--head-dim", type=int, default=64)
    m.add_argument("--backends", nargs="+", default=["reference", "auto"])
    r = sub.add_parser("routes")
    r.add_argument("--total", type=int, default=8192)
    r.add_argument("--n-seq", type=int, default=16)
    r.add_argument("--heads", type=int, default=4)
    r.add_argument("--head-dim", type=int, default=64)
    g = sub.add_parser("growth")
    g.add_argument("--totals", type=int, nargs="+", default=[4096, 8192])
    g.add_argument("--n-seqs", type=int, nargs="+", default=[8, 16])
    g.add_argument("--heads", type=int, default=1)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--backends", nargs="+", default=["cpu", "reference"])
    for p in (s, m, r, g):
        p.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    result = {"speed": speed, "memory": memory, "routes": routes, "growth": growth}[args.part](args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
