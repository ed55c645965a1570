"""The result files' index and the generated tables are current, every result file a page names exists, and the
naming rule is what the index says it is (benchmarks/results_index.py; JSON only, no GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import results_index  # noqa: E402


def test_the_index_and_the_generated_tables_are_current():
    assert results_index.stale() == [], "run python benchmarks/results_index.py"


def test_every_result_file_a_page_names_exists():
    present = {p.name for p in results_index.RESULTS.glob("*.json")} | {p.name for p in results_index.ARCHIVE.glob("*")}
    missing = {doc: sorted(results_index.cited_names(text) - present) for doc, text in results_index.docs().items()}
    assert {doc: names for doc, names in missing.items() if names} == {}


def test_current_files_follow_the_rule_and_are_cited():
    current = [e for e in results_index.entries() if not e.archived]
    assert len(current) > 10
    assert {e.name: e.problems() for e in current if e.problems()} == {}
    assert [e.name for e in current if not e.cited_in] == []


def test_the_assembled_p1_file_is_archived_and_named_for_it():
    entry = results_index.describe(results_index.ARCHIVE / "suite_p1_ckpt_79fa712_h200.json")
    assert entry.problems() == ["rows from commits 79fa712, d16bc1f under commit 79fa712"]
    assert "suite_p1_ckpt_79fa712_h200.json" in results_index.index_markdown([entry])


@pytest.mark.parametrize(
    ("name", "payload", "problems"),
    [
        ("suite_p2_abcdef1_h200.json", {"commit": "abcdef1", "machine": {"gpu": "NVIDIA H200"}}, []),
        (
            "suite_p2_abcdef1_h100.json",
            {"commit": "abcdef1", "machine": {"gpu": "NVIDIA H200"}},
            ["name says abcdef1 on h100, the file abcdef1 on h200"],
        ),
        (
            "suite_p2_h200.json",
            {"commit": "abcdef1", "machine": {"gpu": "NVIDIA H200"}},
            ["name is not <group>_<commit>_<machine>.json"],
        ),
        (
            "optim_1234567_cpu16.json",
            {"git_commit": "1234567890abcdef1234567890abcdef12345678", "machine": {"nproc": 16}},
            [],
        ),
        (
            "run_1234567_h200.json",
            {"machine": {"gpu": "NVIDIA H200"}, "runs": [{"commit": "1234567"}, {"commit": "89abcde"}]},
            ["no single commit recorded (rows at 1234567, 89abcde)"],
        ),
    ],
)
def test_the_rule_reads_commit_and_machine_from_the_file(tmp_path, name, payload, problems):
    path = tmp_path / name
    path.write_text(json.dumps(payload))
    assert results_index.describe(path).problems() == problems


def test_a_stale_section_is_replaced_between_the_markers():
    start, end = results_index.MARKERS
    text = f"before\n{start}\nold table\n{end}\nafter\n"
    assert results_index.with_section(text, "new table") == f"before\n{start}\nnew table\n{end}\nafter\n"


@pytest.mark.parametrize(
    ("cited_in", "reason"),
    [
        ([], "cited nowhere"),
        (["docs/benchmarks_history.md"], "superseded: cited only by the history"),
        (["docs/benchmarks.md", "docs/benchmarks_history.md"], "superseded: cited as an earlier measurement"),
    ],
)
def test_the_archive_says_why_a_file_that_follows_the_rule_is_there(cited_in, reason):
    entry = results_index.Entry(results_index.ARCHIVE / "run_1234567_h200.json", "1234567", "h200", 1, [], cited_in)
    assert results_index.archive_reason(entry) == reason
