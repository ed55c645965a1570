"""The index of ``benchmarks/results/`` and the tables of current figures, generated from the result files.

    python benchmarks/results_index.py           # rewrites results/README.md, the tables of docs/benchmarks.md, README
    python benchmarks/results_index.py --check   # exits 1, naming them, where any of those is not what it generates

A result file is named ``<group>_<commit>_<machine>.json``: the commit its rows ran at (7 hex digits) and the
machine class (``h100``, ``h200``, ``cpuN`` for N cores, ``cpu`` where the count is not recorded). Files that cannot
be so named (rows from several commits, no commit recorded) or that were superseded or cited nowhere live in
``results/archive/`` under the names they had. Reads JSON only: no torch, no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from results_tables import headline_table, suite_tables

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ARCHIVE = RESULTS / "archive"
RULE = re.compile(r"^(?P<group>[a-z0-9][a-z0-9_.-]*)_(?P<commit>[0-9a-f]{7})_(?P<machine>h100|h200|cpu\d*)\.json$")
HEX = re.compile(r"^[0-9a-f]{7,40}")
# what the files do not say themselves: why a file that follows the rule was archived
ARCHIVE_NOTES = {
    "suite_p1_ckpt_79fa712_h200.json": "assembled: a copy of suite_p1_d16bc1f_h200.json (two rows at d16bc1f) to "
    "which the suite added one row at 79fa712; its targets compare rows of two commits",
}
MARKERS = ("<!-- results:start -->", "<!-- results:end -->")
HISTORY = "docs/benchmarks_history.md"


@dataclass
class Entry:
    path: Path
    commit: str | None  # as recorded (may carry a suffix such as "+fused-kernels")
    machine: str
    rows: int
    row_commits: list[str] = field(default_factory=list)
    cited_in: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def archived(self) -> bool:
        return self.path.parent == ARCHIVE

    def problems(self) -> list[str]:
        """Why this file breaks the naming rule or the one-commit rule (empty: it follows both)."""
        out = []
        if self.commit is None:
            out.append(
                "no single commit recorded"
                + (f" (rows at {', '.join(self.row_commits)})" if len(self.row_commits) > 1 else "")
            )
        elif any(not c.startswith(self.commit[:7]) for c in self.row_commits):
            out.append(f"rows from commits {', '.join(self.row_commits)} under commit {self.commit}")
        match = RULE.match(self.name)
        if match is None:
            out.append("name is not <group>_<commit>_<machine>.json")
        elif self.commit is not None and (match["commit"] != self.commit[:7] or match["machine"] != self.machine):
            out.append(f"name says {match['commit']} on {match['machine']}, the file {self.commit} on {self.machine}")
        return out


def machine_class(machine: dict | None, device: str | None = None) -> str:
    """``h100`` / ``h200`` from the GPU's name, else ``cpuN`` from the recorded core count (``cpu`` without one)."""
    machine = machine or {}
    gpu = machine.get("gpu")
    if gpu:
        found = re.search(r"\b([A-Z]\d{2,4})\b", gpu)
        return found.group(1).lower() if found else re.sub(r"[^a-z0-9]+", "-", gpu.lower())
    if device not in (None, "cpu"):
        return str(device)
    cores = machine.get("cpus") or machine.get("nproc") or machine.get("cores_in_machine")
    return f"cpu{cores}" if cores else "cpu"


def result_path(group: str, machine: str, commit: str | None = None) -> str:
    """Where a script writes ``group``'s results by default: ``benchmarks/results/<group>_<commit>_<machine>.json``,
    the commit being ``LAZYTRAIN_COMMIT`` or this checkout's HEAD (common.commit says why the device needs the
    first)."""
    if commit is None:
        commit = (
            os.environ.get("LAZYTRAIN_COMMIT")
            or subprocess.run(
                ["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, cwd=ROOT
            ).stdout.strip()
            or "unknown"
        )
    return str(RESULTS.relative_to(ROOT) / f"{group}_{commit[:7]}_{machine}.json")


def _row_lists(data: dict) -> list[list]:
    return [v for v in data.values() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)]


def describe(path: Path) -> Entry:
    data = json.loads(path.read_text())
    lists = _row_lists(data)
    row_commits = sorted({str(r["commit"]) for rows in lists for r in rows if r.get("commit")})
    recorded = data.get("commit") or data.get("git_commit")
    commit = str(recorded) if recorded and HEX.match(str(recorded)) else None
    if commit is None and len(row_commits) == 1 and HEX.match(row_commits[0]):
        commit = row_commits[0]
    if commit is not None and HEX.match(commit) and len(HEX.match(commit).group(0)) == 40:
        commit = commit[:7]
    rows = sum(len(rows) for rows in lists) if lists else 1
    machine = data.get("machine") or data.get("cpu")  # optim8_paths.py records the CPU under "cpu"
    return Entry(path, commit, machine_class(machine, data.get("device")), rows, row_commits)


def cited_names(text: str) -> set[str]:
    """Names of result files a text cites: every ``<name>.json`` whose name follows the rule."""
    return {m.group(0) for m in re.finditer(r"[a-z0-9][a-z0-9_.-]*_[0-9a-f]{7}_(?:h100|h200|cpu\d*)\.json", text)}


def docs() -> dict[str, str]:
    """README.md and docs/*.md, by their path from the repository root."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths}


def entries() -> list[Entry]:
    texts = docs()
    found = [describe(p) for p in sorted(RESULTS.glob("*.json")) + sorted(ARCHIVE.glob("*.json"))]
    for e in found:
        pattern = re.compile(rf"(?<![\w.-]){re.escape(e.name)}")
        e.cited_in = [doc for doc, text in texts.items() if pattern.search(text)]
    return found


def archive_reason(entry: Entry) -> str:
    """Why a file that follows the rule is in the archive, from where it is cited."""
    if not entry.cited_in:
        return "cited nowhere"
    if entry.cited_in == [HISTORY]:
        return "superseded: cited only by the history"
    return "superseded: cited as an earlier measurement"


def index_markdown(found: list[Entry]) -> str:
    def table(rows: list[Entry], last: str) -> list[str]:
        lines = ["| file | commit | machine | rows | cited in | " + last + " |", "|---|---|---|---|---|---|"]
        for e in rows:
            why = "; ".join(([ARCHIVE_NOTES[e.name]] if e.name in ARCHIVE_NOTES else []) + e.problems())
            note = (why or archive_reason(e)) if e.archived else "; ".join(e.problems())
            lines.append(
                f"| `{e.name}` | {e.commit or '-'} | {e.machine} | {e.rows} | "
                f"{', '.join(e.cited_in) or 'nowhere'} | {note} |"
            )
        return lines

    current = [e for e in found if not e.archived]
    archived = [e for e in found if e.archived]
    return "\n".join(
        [
            "# Benchmark results",
            "",
            "Generated by `python benchmarks/results_index.py` from the files themselves; do not edit. Each file is",
            "written by the script its `command` names. Names: `<group>_<commit>_<machine>.json`, the commit its rows",
            "ran at and the machine class (`h100`, `h200`, `cpuN`: N cores). `rows`: entries of its row lists.",
            "",
            "## Current",
            "",
            *table(current, "problems"),
            "",
            "## Archive (`archive/`)",
            "",
            "Superseded, cited nowhere but the history (docs/benchmarks_history.md), or not nameable by the rule.",
            "",
            *table(archived, "why archived"),
            "",
        ]
    )


def with_section(text: str, section: str) -> str:
    """``text`` with what lies between the markers replaced by ``section``."""
    start, end = text.index(MARKERS[0]) + len(MARKERS[0]), text.index(MARKERS[1])
    return text[:start] + "\n" + section + "\n" + text[end:]


def generated() -> dict[Path, str]:
    """Each generated file's path and the content it should have."""
    found = entries()
    suites = {e.name: json.loads(e.path.read_text()) for e in found if not e.archived and e.name.startswith("suite_")}
    readme, bench = ROOT / "README.md", ROOT / "docs" / "benchmarks.md"
    return {
        RESULTS / "README.md": index_markdown(found),
        readme: with_section(readme.read_text(), headline_table(suites)),
        bench: with_section(bench.read_text(), suite_tables(suites)),
    }


def stale() -> list[str]:
    return [str(p.relative_to(ROOT)) for p, text in generated().items() if p.read_text() != text]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file is stale")
    args = parser.parse_args()
    if args.check:
        old = stale()
        if old:
            sys.exit(f"stale: {', '.join(old)}; run python benchmarks/results_index.py")
        return
    for path, text in generated().items():
        path.write_text(text)


if __name__ == "__main__":
    main()
