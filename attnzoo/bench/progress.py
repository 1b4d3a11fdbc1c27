"""The progress bar every benchmark of the harness shows on a terminal (rich), or a stand-in that
does nothing (disabled, or rich not installed)."""
from __future__ import annotations

from contextlib import nullcontext


class _Silent:
    def add_task(self, *a, **k):
        return 0

    def update(self, *a, **k):
        pass

    def advance(self, *a, **k):
        pass


def progress_bar(enabled: bool, label: str = "bench"):
    """A context manager giving an object with rich.progress.Progress's add_task / update / advance."""
    if enabled:
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            enabled = False
    if not enabled:
        return nullcontext(_Silent())
    columns = (TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    return Progress(*columns, transient=True)
