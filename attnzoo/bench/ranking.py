"""The measured ranking table ``auto`` reads (attnzoo/ops/measured_tables/<device>.json, copied from
the GPU measurement's measured_table.json): per measured case (variant, flavour, dtype, causal, head
dim, N, direction) the backends fastest first, from the kernel speed rows (``report``'s layout)."""
from __future__ import annotations

from collections import defaultdict

from .report import DIRECTIONS


def measured_table(rows, device: dict) -> dict:
    entries = []
    groups = defaultdict(list)
    for r in rows:
        if r.get("table_variant"):
            for d in DIRECTIONS:
                if d in r:
                    groups[(r["table_variant"], r["flavour"], r["dtype"], r["causal"], r["head_dim"], r["n"], d)].append(
                        (r[d], r["backend"]))
    for (variant, flavour, dtype, causal, hd, n, d), timed in sorted(groups.items(), key=str):
        timed.sort()
        entries.append({"variant": variant, "flavour": flavour, "dtype": dtype, "causal": causal, "head_dim": hd,
                        "n": n, "direction": d, "ranking": [b for _, b in timed],
                        "ms": {b: round(ms, 4) for ms, b in timed}})
    return {"device": device["name"], "capability": device["capability"], "torch": device["torch"],
            "triton": device.get("triton"), "source": "benchmarks/gpu_speed.py", "entries": entries}
