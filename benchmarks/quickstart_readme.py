"""README.md's quickstart table, from a fresh ``edgeadapt quickstart`` run.

    .venv/bin/python benchmarks/quickstart_readme.py            # run README's command fresh, rewrite its table
    .venv/bin/python benchmarks/quickstart_readme.py --check    # run it fresh, exit 1 if README's table differs
    .venv/bin/python benchmarks/quickstart_readme.py --report runs/quickstart/report.json   # from a finished run

The table sits in README.md between ``<!-- quickstart table ... -->`` markers; the first names the
quickstart options it was made with (the run uses exactly those). The block is
``edgeadapt.harness.quickstart.readme_table`` of the run's report, which ``edgeadapt quickstart``
also prints. ``--check`` (and the slow test ``tests/harness/test_quickstart_readme.py``) compare
exactly the methods, accuracy before -> after, trained elements, the held-out subject and the
source model's accuracy on a CPU with the vector kernels the table names (torch and ONNX Runtime
pick their kernels by them); on other kernels only the methods, trained elements, engines and the
held-out subject (training's float32 rounding follows the kernels, and the accuracies move by
points). Memory (MB) and time depend on the machine and its load and are never compared.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from edgeadapt.harness.quickstart import quickstart_command, readme_table

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BLOCK = re.compile(r"(<!-- quickstart table: made by benchmarks/quickstart_readme.py with options: "
                   r"(?P<options>.*?) -->\n)"
                   r"(?P<block>.*?)\n(<!-- end quickstart table -->)", re.DOTALL)


def readme_block(text: str) -> tuple[list[str], str]:
    """The quickstart options and the table block of README.md's ``text``."""
    m = BLOCK.search(text)
    if m is None:
        raise ValueError("README.md has no '<!-- quickstart table: ... -->' block")
    return shlex.split(m.group("options")), m.group("block")


def run_fresh(options: list[str], out_dir: Path) -> dict:
    """``edgeadapt quickstart OPTIONS`` in a fresh process; returns its report."""
    subprocess.run([sys.executable, "-m", "edgeadapt", "quickstart", *options, "--out", str(out_dir), "--no-progress"],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads((out_dir / "report.json").read_text())


def exact_figures(block: str) -> dict:
    """What a rerun on a CPU with the same vector kernels must reproduce: per table row, the method,
    accuracy before -> after, trained elements and the training engine (not the memory columns),
    the held-out subject and the source model's accuracy (not the time), and the kernels."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines()
            if line.startswith("| ") and not line.startswith("| method ")]
    source = re.search(r"source model scores ([0-9.]+) on held-out windows of the (\d+) training subjects", block)
    held_out = re.search(r"subject (\d+) held out", block)
    kernels = re.search(r"kernels: ([^,]*),", block)
    return {"rows": [row[:4] for row in rows], "source": source and source.groups(),
            "held_out": held_out and held_out.group(1), "kernels": kernels and kernels.group(1)}


def kernel_free_figures(figures: dict) -> dict:
    """What a rerun on a CPU with other vector kernels must still reproduce: the methods, trained
    elements, engines, infeasible rows and the held-out subject. The accuracies are left out:
    training runs thousands of float32 reductions whose rounding follows the kernels, and a few
    windows' predictions flipping moves them by points."""
    rows = [[row[0], row[1] if row[1].startswith("infeasible") else None, *row[2:]] for row in figures["rows"]]
    return {"rows": rows, "held_out": figures["held_out"]}


def compare(readme: str, fresh: str) -> str | None:
    """``None`` when the fresh block reproduces README.md's (every figure on the same kernels, the
    kernel-free ones on others); otherwise what differs."""
    a, b = exact_figures(readme), exact_figures(fresh)
    if a["kernels"] == b["kernels"]:
        return None if a == b else "the figures differ (same CPU kernels)"
    if kernel_free_figures(a) != kernel_free_figures(b):
        return "the methods, trained elements, engines or held-out subject differ"
    return None


def replace_block(text: str, block: str) -> str:
    """``text`` with its quickstart table block replaced by ``block``."""
    return BLOCK.sub(lambda m: m.group(1) + block + "\n" + m.group(4), text, count=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with README.md instead of rewriting it")
    parser.add_argument("--report", type=Path,
                        help="a finished run's report.json (default: run README's command fresh)")
    args = parser.parse_args(argv)
    text = README.read_text()
    options, block = readme_block(text)
    if args.report:
        report = json.loads(args.report.read_text())
        made_with = quickstart_command(report["config"])
        if made_with != shlex.join(["edgeadapt", "quickstart", *options]):
            raise SystemExit(f"{args.report} was made by `{made_with}`; README.md's table is of "
                             f"`edgeadapt quickstart {shlex.join(options)}`")
    else:
        with tempfile.TemporaryDirectory(prefix="quickstart-readme-") as tmp:
            report = run_fresh(options, Path(tmp) / "run")
    fresh = readme_table(report)
    if args.check:
        differs = compare(block, fresh)
        if differs:
            print(f"README.md's quickstart table differs from a fresh run ({differs}):\n\nREADME.md:\n{block}\n\n"
                  f"fresh:\n{fresh}")
            return 1
        same = exact_figures(block)["kernels"] == exact_figures(fresh)["kernels"]
        print("README.md's quickstart table matches a fresh run (memory and time not compared"
              + ("" if same else "; accuracies not compared: this CPU has other vector kernels") + ")")
        return 0
    README.write_text(replace_block(README.read_text(), fresh))  # read again: the run takes minutes
    print(f"README.md's quickstart table rewritten from the run:\n\n{fresh}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
