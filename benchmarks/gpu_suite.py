"""Run the GPU-marked tests (`pytest -m gpu`) and record their outcome with the commit and the machine.

Usage, on the device (the package installed, its test extras' wheels on the path):
    LAZYTRAIN_COMMIT=<commit> python benchmarks/gpu_suite.py --out $OUT/gpu_suite_<commit>_<gpu>.json
Writes one row per test (outcome, seconds) and the totals; exits with pytest's status, so a failure shows.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from common import default_out, write_results


def outcomes(junit_xml: Path) -> list[dict]:
    """One row per test case of pytest's JUnit report: ``passed``, ``failed``, ``error`` or ``skipped``."""
    rows = []
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        status = "passed"
        for kind in ("failure", "error", "skipped"):
            if case.find(kind) is not None:
                status = {"failure": "failed"}.get(kind, kind)
        rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "status": status,
                     "seconds": round(float(case.get("time", 0.0)), 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="result file (default: results/gpu_suite_<commit>_<gpu>.json)")
    args, pytest_args = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        paths = [] if any(not a.startswith("-") for a in pytest_args) else ["tests"]  # named files run alone
        code = subprocess.call([sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q",
                                "-rfEs", f"--junitxml={report}", *paths, *pytest_args])
        rows = outcomes(report) if report.is_file() else []
    totals = {s: sum(r["status"] == s for r in rows) for s in ("passed", "failed", "error", "skipped")}
    write_results(args.out or default_out("gpu_suite"), {"pytest_exit": code, "totals": totals, "rows": rows})
    print(f"GPU suite: {totals}, pytest exit {code}")
    sys.exit(code)


if __name__ == "__main__":
    main()
