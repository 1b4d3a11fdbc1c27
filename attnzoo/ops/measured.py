"""Measured backend rankings per device: what ``auto`` tries first on a GPU.

``benchmarks/gpu_speed.py`` times every backend of every variant side by side on one GPU and writes
``attnzoo/ops/measured_tables/<device>.json``: for each measured case (variant, flavour, dtype,
causal, head dim, N, direction) the backends that ran, fastest first. ``auto`` looks up the nearest
measured case (same variant, flavour, causality and direction; the same dtype when measured, else
the other half precision; then nearest head dim, then N, on a log scale) and tries its ranking before
the priority order. The device's own table is searched first; a case it did not measure (or a device
with no table of its own) is looked up in the tables of devices of the same compute capability (an
H100 uses the H200's table for what its own run left out), otherwise only priorities decide.

The lookup runs while torch.compile traces a call, so it is one function of plain values that dynamo
treats as a constant (``assume_constant_result``): the ranking is fixed into the compiled graph.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch

TABLE_DIR = Path(__file__).resolve().parent / "measured_tables"
DIRECTIONS = ("fwd", "fwd+bwd")


def slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    out = "".join(c.lower() if c.isalnum() else "-" for c in name)
    return "-".join(p for p in out.split("-") if p) or "device"


# variant -> (backend keyword arguments -> the variant's own flavour parts), registered by the variant's
# folder (ops/<variant>/__init__.py) beside its backends
_FLAVOURS: dict = {}


def register_flavour(variant: str, parts) -> None:
    """``parts(kwargs) -> list[str]``: the variant's arguments that change which kernel can win (a
    preference, templates, a feature map), named as ``benchmarks/gpu_speed.py`` names its cases."""
    _FLAVOURS[variant] = parts


def flavour(variant: str, kwargs: dict) -> str:
    """The part of a call that changes which kernel can win: a mask, the variant's own parts, dropout."""
    parts = ["mask"] if kwargs.get("attn_mask") is not None else []
    if variant in _FLAVOURS:
        parts += _FLAVOURS[variant](kwargs)
    if kwargs.get("dropout_p", 0.0):
        parts.append("dropout")
    return "+".join(parts) or "plain"


@functools.lru_cache(maxsize=None)
def _tables() -> tuple:
    """Every shipped table as (slug, capability tuple or None, entries)."""
    out = []
    for path in sorted(TABLE_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        cap = tuple(data["capability"]) if data.get("capability") else None
        out.append((path.stem, cap, tuple(data["entries"])))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _entries_for_device(index: int) -> tuple:
    """The tables that rank this device's calls, most specific first: its own, then those of devices
    of the same compute capability (a partial run on one device still leaves its other cases to a
    sibling's full measurement)."""
    return tables_for(slug(torch.cuda.get_device_name(index)), tuple(torch.cuda.get_device_capability(index)))


def tables_for(name: str, cap: tuple) -> tuple:
    """(entries, ...) of the shipped tables for device ``name`` of capability ``cap``, own table first."""
    tables = _tables()
    own = [entries for table_slug, _, entries in tables if table_slug == name]
    siblings = [entries for table_slug, table_cap, entries in tables if table_slug != name and table_cap == cap]
    return tuple(own + siblings)


_HALF = ("bfloat16", "float16")


def _dtype_distance(a: str, b: str) -> int:
    """0 for the same dtype, 1 between the two half precisions (same kernels), 2 otherwise."""
    return 0 if a == b else 1 if (a in _HALF and b in _HALF) else 2


def nearest_ranking(entries, variant: str, flavour_name: str, dtype: str, causal: bool, head_dim: int, n: int,
                    direction: str) -> tuple:
    """The ranking of the measured entry nearest to this call, or () when none matches."""
    best, best_key = (), None
    for e in entries:
        if (e["variant"], e["flavour"], bool(e["causal"]), e["direction"]) != (variant, flavour_name, causal, direction):
            continue
        key = (_dtype_distance(e["dtype"], dtype), abs(math.log2(e["head_dim"] / head_dim)), abs(math.log2(e["n"] / n)))
        if best_key is None or key < best_key:
            best, best_key = tuple(e["ranking"]), key
    return best


# device types whose calls are ranked from a measured table (a module constant so tests can trace the
# lookup on CPU tensors)
RANKED_DEVICES = ("cuda",)


@torch.compiler.assume_constant_result
def _lookup(index: int, variant: str, flavour_name: str, dtype: str, causal: bool, head_dim: int, n: int,
            direction: str) -> tuple:
    """Everything that reads the device or the table files, behind one constant result: dynamo cannot
    trace file-system calls (os.stat) or the device queries, and the answer is fixed per shape."""
    if index < 0:
        index = torch.cuda.current_device()
    for entries in _entries_for_device(index):
        found = nearest_ranking(entries, variant, flavour_name, dtype, causal, head_dim, n, direction)
        if found:
            return found
    return ()


def ranking(variant: str, q, k, v, kwargs: dict) -> tuple:
    """Backend names ranked fastest first for a CUDA call like this one, () without a table."""
    if q.device.type not in RANKED_DEVICES:
        return ()
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    direction = "fwd+bwd" if wants_grad else "fwd"
    index = q.device.index if q.device.index is not None else (-1 if q.device.type == "cuda" else 0)
    return _lookup(int(index), variant, flavour(variant, kwargs), str(q.dtype).replace("torch.", ""),
                   bool(kwargs.get("is_causal", False)), int(q.shape[-1]), int(max(q.shape[-2], k.shape[-2])),
                   direction)
