"""A benchmark run as a JSON-lines log written while it runs, and the result rebuilt from it.

Line 1 is the header (the result without its rows: schema, environment, settings, methods, FLOP
conventions); every further line is one finished row, written and flushed as soon as it completes.
A run killed half-way (device time ran out, OOM killer, Ctrl-C) leaves every finished row on disk;
``load_rowlog`` turns the file into a normal result (``schema.validate`` passes) that ``write_outputs``,
``--compare`` and the docs renderer take like any other. The model benchmark (``--models``) keeps the
same kind of log; its header's schema says which result the log rebuilds. The GPU measurement keeps
its kernel rows (rows.jsonl, no header: speed.json is rewritten after every phase) and its model rows
in the same kind of log, with a mirror in the device call's $OUT.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from .model_bench import finish as model_finish
from .result import finish
from .schema import MODELS_SCHEMA, validate, validate_models


class RowLog:
    """``run(config, on_start=log.start, on_row=log.row)`` writes ``path`` (and ``mirror``, a second
    copy, when given) as the run goes."""

    def __init__(self, path, mirror=None):
        self.paths = [Path(path)] + ([] if mirror is None else [Path(mirror)])
        self.path = self.paths[0]
        self.rows = 0
        self._files = []

    def start(self, header: Optional[dict] = None) -> None:
        """Open the log; ``header`` (the result without its rows) is its first line when given."""
        for path in self.paths:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._files = [open(path, "w") for path in self.paths]
        if header is not None:
            self._write(header)

    def row(self, row: dict) -> None:
        if not self._files:
            raise RuntimeError("RowLog.row called before RowLog.start (pass on_start=log.start to run)")
        self._write(row)
        self.rows += 1

    def _write(self, obj: dict) -> None:
        # one line, flushed: the OS keeps it even if this process dies right after
        line = json.dumps(obj, separators=(",", ":"), default=str) + "\n"
        for file in self._files:
            file.write(line)
            file.flush()

    def close(self) -> None:
        for file in self._files:
            file.close()
        self._files = []

    def __enter__(self) -> "RowLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_rowlog(path, planned: Optional[int] = None) -> dict:
    """The result of the run logged in ``path``. A last line cut off mid-write (the process was killed
    while writing it) is dropped; any other unreadable line is a ValueError naming it. The settings
    record where the rows came from and how many of the planned rows the log holds."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise ValueError(f"row log {str(path)!r} does not exist") from None
    objects = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            objects.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break  # cut off mid-write
            raise ValueError(f"row log {str(path)!r}, line {i + 1}: not valid JSON ({e})") from None
    if not objects or not isinstance(objects[0], dict) or "schema" not in objects[0]:
        raise ValueError(f"row log {str(path)!r} does not start with a benchmark header line")
    head, rows = objects[0], objects[1:]
    models = head["schema"] == MODELS_SCHEMA
    result = model_finish(head, rows) if models else finish(head, rows, refresh_environment=False)
    planned = planned if planned is not None else head["settings"].get("planned_rows")
    result["settings"] = {**result["settings"], "rebuilt_from_rowlog": path.name, "rows_logged": len(rows),
                          "complete": planned is not None and len(rows) >= planned}
    return validate_models(result) if models else validate(result)
