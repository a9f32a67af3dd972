"""README.md's quickstart table is what a fresh run of the command it names prints (slow: ~1-5 min).

Compared exactly: methods, accuracy before -> after, trained elements, the held-out subject and the
source model's accuracy (fixed seeds, 1 thread: identical on one CPU type). Memory and time depend
on the machine and its load and are not compared. The fix when it fails:
``.venv/bin/python benchmarks/quickstart_readme.py`` rewrites the table from a fresh run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from edgeadapt.harness.quickstart import readme_table

REPO = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("quickstart_readme", REPO / "benchmarks" / "quickstart_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_figures_compared_are_parsed_from_the_table():
    script = _script()
    options, block = script.readme_block((REPO / "README.md").read_text())
    figures = script.exact_figures(block)
    assert options and figures["rows"] and figures["source"] and figures["held_out"]
    assert all(len(row) == 3 for row in figures["rows"])
    # a table differing in one accuracy digit differs; one differing only in memory does not
    first = block.splitlines()[4]
    cells = first.split("|")
    assert script.exact_figures(block.replace(first, "|".join([*cells[:2], cells[2].replace("→", "→ 9"), *cells[3:]]))) != figures
    assert script.exact_figures(block.replace(first, "|".join([*cells[:4], " 99.9 (9.9) ", *cells[5:]]))) == figures


@pytest.mark.slow
def test_readme_quickstart_table_matches_a_fresh_run(tmp_path):
    script = _script()
    options, block = script.readme_block((REPO / "README.md").read_text())
    report = script.run_fresh(options, tmp_path / "run")
    fresh = readme_table(report)
    assert script.exact_figures(fresh) == script.exact_figures(block), (
        f"README.md:\n{block}\n\nfresh run:\n{fresh}\n\n(.venv/bin/python benchmarks/quickstart_readme.py rewrites it)")
