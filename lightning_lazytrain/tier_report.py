"""What admission reports: need against have per memory tier (host RAM, GPU, disk), the pieces of each need, and
the error that refuses a run with the table and the single changes that would make it fit."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_lazytrain.units import GIB


class AdmissionError(ValueError):
    """The configuration cannot fit; the message carries the need-vs-have table and what would make it fit."""


@dataclass
class TierUsage:
    """Need vs have for one tier, with the pieces that make up the need."""

    name: str
    have: int
    pieces: dict[str, int] = field(default_factory=dict)

    @property
    def need(self) -> int:
        return int(sum(self.pieces.values()))

    @property
    def short(self) -> int:
        return max(0, self.need - self.have)


@dataclass
class AdmissionReport:
    """Per-tier accounting; ``check()`` raises AdmissionError with the table and suggestions if anything is short."""

    tiers: dict[str, TierUsage]
    suggestions: list[str]
    settings: dict

    @property
    def fits(self) -> bool:
        return all(t.short == 0 for t in self.tiers.values())

    def table(self) -> str:
        lines = [f"{'tier':<9} {'piece':<28} {'GiB':>10}"]
        for t in self.tiers.values():
            for piece, b in t.pieces.items():
                lines.append(f"{t.name:<9} {piece:<28} {b / GIB:>10.2f}")
            verdict = f"SHORT by {t.short / GIB:.2f} GiB" if t.short else "ok"
            lines.append(f"{t.name:<9} {'= need / have':<28} {t.need / GIB:>10.2f} / {t.have / GIB:.2f}  {verdict}")
        return "\n".join(lines)

    def check(self) -> None:
        if self.fits:
            return
        short = ", ".join(f"{t.name} short by {t.short / GIB:.2f} GiB" for t in self.tiers.values() if t.short)
        hints = "\n".join(f"  - {s}" for s in self.suggestions) or "  - no single setting fixes it"
        raise AdmissionError(f"configuration does not fit ({short}):\n{self.table()}\nwhat would make it fit:\n{hints}")
