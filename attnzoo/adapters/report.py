"""What a swap did (or, dry run, would do): one entry per attention module found."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SwapEntry:
    name: str                      # qualified module name in the model
    action: str                    # "swap" | "unswap" | "unsupported" | "excluded"
    source: str                    # class before
    target: str = ""               # class after (swap/unswap)
    carried: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    reason: str = ""               # why unsupported / excluded


@dataclass
class SwapReport:
    spec: str
    dry_run: bool
    entries: list[SwapEntry] = field(default_factory=list)

    def names(self, action: str) -> list[str]:
        return [e.name for e in self.entries if e.action == action]

    @property
    def swapped(self) -> list[str]:
        return self.names("unswap" if self.spec == "unswap" else "swap")

    @property
    def unsupported(self) -> list[str]:
        return self.names("unsupported")

    @property
    def excluded(self) -> list[str]:
        return self.names("excluded")

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        verb = "would change" if self.dry_run else "changed"
        lines = [f"attnzoo {self.spec!r}: {len(self.swapped)} module(s) {verb}, "
                 f"{len(self.unsupported)} unsupported, {len(self.excluded)} excluded"]
        for e in self.entries:
            head = f"  [{e.action}] {e.name or '<root>'}: {e.source}"
            if e.target:
                head += f" -> {e.target}"
            lines.append(head)
            if e.reason:
                lines.append(f"      reason: {e.reason}")
            if e.carried:
                lines.append(f"      kept: {', '.join(e.carried)}")
            if e.added:
                lines.append(f"      new: {', '.join(e.added)}")
            if e.dropped:
                lines.append(f"      dropped: {', '.join(e.dropped)}")
        return "\n".join(lines)
