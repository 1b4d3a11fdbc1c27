"""``attnzoo bench --compare OLD.json``: speed-ups and regressions between two runs.

Rows are matched on (variant, backend, N, batch, heads, head dim, dtype, mode, causal). speed-up =
old median / new median (> 1: the new run is faster); a change beyond ``threshold`` (default 10%)
either way is flagged. Comparing runs from different devices is allowed but said loudly.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import OK
from .report import fmt_bytes, fmt_time


def row_key(row: dict) -> tuple:
    return (row["variant"], row["backend"], row["seq_len"], row["batch"], row["heads"], row["head_dim"],
            row["dtype"], row["mode"], row["causal"])


@dataclass
class Change:
    key: tuple
    old: dict
    new: dict

    @property
    def speedup(self):
        if self.old["status"] != OK or self.new["status"] != OK:
            return None
        return self.old["time_s"]["median"] / self.new["time_s"]["median"]

    @property
    def memory_ratio(self):
        a, b = self.old.get("peak_memory_bytes"), self.new.get("peak_memory_bytes")
        if self.old["status"] != OK or self.new["status"] != OK or not a or b is None:
            return None
        return b / a

    def verdict(self, threshold: float) -> str:
        if self.old["status"] != self.new["status"]:
            return f"{self.old['status']} -> {self.new['status']}"
        s = self.speedup
        if s is None:
            return "same status"
        if s >= 1 + threshold:
            return "faster"
        if s <= 1 / (1 + threshold):
            return "REGRESSION"
        return "unchanged"


def compare(old: dict, new: dict) -> tuple[list[Change], list[tuple], list[tuple]]:
    """(matched changes, keys only in old, keys only in new)."""
    old_rows = {row_key(r): r for r in old["results"]}
    new_rows = {row_key(r): r for r in new["results"]}
    matched = [Change(k, old_rows[k], new_rows[k]) for k in new_rows if k in old_rows]
    return matched, [k for k in old_rows if k not in new_rows], [k for k in new_rows if k not in old_rows]


def summary_counts(changes: list[Change], threshold: float) -> dict:
    counts: dict[str, int] = {}
    for c in changes:
        v = c.verdict(threshold)
        counts[v] = counts.get(v, 0) + 1
    return counts


def _many_shapes(changes: list[Change]) -> bool:
    """More than one (heads, head dim) among the pairs: a column tells their rows apart."""
    return len({(c.key[4], c.key[5]) for c in changes}) > 1


def _cells(c: Change, threshold: float, shape: bool = False) -> list[str]:
    variant, backend, n, batch, heads, head_dim, dtype, mode, causal = c.key
    old_t = fmt_time(c.old["time_s"]["median"]) if c.old["status"] == OK else c.old["status"]
    new_t = fmt_time(c.new["time_s"]["median"]) if c.new["status"] == OK else c.new["status"]
    s, m = c.speedup, c.memory_ratio
    return [variant + (" (causal)" if causal and variant != "masked" else ""), backend, str(n)] + (
        [f"{heads}x{head_dim}"] if shape else []) + [
        mode, dtype, old_t, new_t, "" if s is None else f"{s:.3g}x", "" if m is None else f"{m:.3g}x",
        fmt_bytes(c.new.get("peak_memory_bytes")), c.verdict(threshold)]


COLUMNS = ("variant", "backend", "N", "mode", "dtype", "old time", "new time", "speed-up", "memory new/old",
           "new memory", "verdict")


def _columns(shape: bool) -> tuple:
    return COLUMNS[:3] + ("H x D",) + COLUMNS[3:] if shape else COLUMNS


def device_warning(old: dict, new: dict) -> str | None:
    a, b = old["environment"].get("device_name"), new["environment"].get("device_name")
    return None if a == b else f"the runs are from different devices ({a!r} vs {b!r}): ratios compare machines"


def rich_compare(old: dict, new: dict, threshold: float = 0.1):
    from rich.table import Table
    changes, only_old, only_new = compare(old, new)
    table = Table(title=f"compare: old {old['created']} -> new {new['created']} (threshold {threshold:.0%})")
    shape = _many_shapes(changes)
    for col in _columns(shape):
        table.add_column(col, justify="right" if col in ("N", "speed-up", "memory new/old") else "left")
    for c in changes:
        verdict = c.verdict(threshold)
        style = "red" if verdict == "REGRESSION" else "green" if verdict == "faster" else None
        table.add_row(*_cells(c, threshold, shape), style=style)
    counts = summary_counts(changes, threshold)
    caption = ", ".join(f"{v}: {n}" for v, n in sorted(counts.items()))
    caption += f"; only in old: {len(only_old)}, only in new: {len(only_new)}"
    warning = device_warning(old, new)
    table.caption = caption + (f"\nWARNING: {warning}" if warning else "")
    return table


def markdown_compare(old: dict, new: dict, threshold: float = 0.1) -> str:
    changes, only_old, only_new = compare(old, new)
    lines = [f"Compare: old {old['created']} ({old['environment'].get('device_name')}) -> new {new['created']} "
             f"({new['environment'].get('device_name')}); speed-up = old / new median time; threshold "
             f"{threshold:.0%}", ""]
    warning = device_warning(old, new)
    if warning:
        lines += [f"**Warning:** {warning}", ""]
    shape = _many_shapes(changes)
    columns = _columns(shape)
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cells(c, threshold, shape)) + " |" for c in changes]
    counts = summary_counts(changes, threshold)
    lines += ["", "Summary: " + ", ".join(f"{v}: {n}" for v, n in sorted(counts.items()))
              + f"; only in old: {len(only_old)}, only in new: {len(only_new)}", ""]
    return "\n".join(lines)
