"""A benchmark result assembled: the header (environment, settings, methods, FLOP conventions), the
rows, and each row's ratios to SDPA softmax on the same problem. Shared by ``run`` and by the row
log's rebuild (``rowlog.load_rowlog``), so a rebuilt result is the same object a finished run returns."""
from __future__ import annotations

import datetime
import math
from dataclasses import asdict
from typing import Optional

import torch

from . import environment, errors
from .flops import backward_rule, formulas
from .memory import memory_method

SCHEMA = "attnzoo.bench/1"


def anchor_key(row: dict) -> tuple:
    return (row["seq_len"], row["batch"], row["heads"], row["head_dim"], row["dtype"], row["mode"], row["causal"])


def is_anchor(row: dict) -> bool:
    return row["backend"] == "sdpa" and row["variant"] in ("softmax", "masked") and row["status"] == errors.OK


def set_ratio(row: dict, anchor_row: Optional[dict]) -> None:
    """time and memory of ``row`` / those of ``anchor_row`` (SDPA softmax on the same problem)."""
    if anchor_row is None or row["status"] != errors.OK:
        return
    row["ratio_time_vs_sdpa"] = row["time_s"]["median"] / anchor_row["time_s"]["median"]
    if row["peak_memory_bytes"] is not None and anchor_row["peak_memory_bytes"]:
        row["ratio_memory_vs_sdpa"] = row["peak_memory_bytes"] / anchor_row["peak_memory_bytes"]


def add_ratios(rows: list[dict]) -> None:
    """time and memory of each row / those of SDPA softmax (default dispatch, same problem and causality)."""
    anchors = {anchor_key(r): r for r in rows if is_anchor(r)}
    for r in rows:
        set_ratio(r, anchors.get(anchor_key(r)))


def _methods(device: torch.device) -> dict:
    return {
        "timing": ("first call = warm-up (compile, autotune; kept as first_call_s); second call = steady cost: "
                   "skipped above max_call_seconds, the only sample above once_above_seconds, "
                   + ("CUDA-event repeats above slow_call_seconds, else triton.testing.do_bench (CUDA events, "
                      "L2 flushed)" if device.type == "cuda" else
                      "else time.perf_counter per call, repeats fill target_seconds")),
        "memory": memory_method(device),
        "fwd": "forward under torch.no_grad (inference)",
        "fwd+bwd": "forward + torch.autograd.grad of a fixed random cotangent w.r.t. q, k, v (and parameters)",
        "auto": "'auto' runs the backend the dispatcher picks (resolved_backend); when that backend was "
                "already measured on the same problem the measurement is shared (shared_with)",
        "ratios": "ratio_*_vs_sdpa = this row / torch SDPA softmax with default dispatch, same problem "
                  "and causality, measured in the same run",
    }


def header(config, memory_limit: float = math.inf, planned_rows: Optional[int] = None) -> dict:
    """Everything of a result but its rows (what a row log starts with); ``config`` is a BenchConfig."""
    device = torch.device(config.device)
    settings = {**asdict(config), "memory_limit_bytes": None if math.isinf(memory_limit) else int(memory_limit)}
    if planned_rows is not None:
        settings["planned_rows"] = planned_rows
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": {**environment.collect(device), "load_average_at_start": environment.load_average()},
        "settings": settings,
        "methods": _methods(device),
        "flop_conventions": {"forward": formulas(), "backward": backward_rule()},
    }


def finish(head: dict, rows: list[dict], wall_seconds: Optional[float] = None, refresh_environment: bool = True
           ) -> dict:
    """The result from its header and rows: ratios recomputed over every row; with ``refresh_environment``
    (same process as the header) the environment's end-of-run fields (load average, clocks) are read again."""
    add_ratios(rows)
    env = head["environment"]
    if refresh_environment:
        device = torch.device(head["settings"].get("device", "cpu"))
        env = {**environment.collect(device), "load_average_at_start": env.get("load_average_at_start")}
    settings = dict(head["settings"])
    if wall_seconds is not None:
        settings["run_seconds"] = round(wall_seconds, 1)
    return {**head, "environment": env, "settings": settings, "results": rows}
