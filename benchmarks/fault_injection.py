"""Fault injection on bundles: the README figures (a thin script over
``edgeadapt.harness.fault_injection``, which documents the case kinds and outcomes).

Run ``python benchmarks/fault_injection.py`` (seed 0, 100 corruptions per bundle and mode);
``tests/reliability/test_fault_injection.py`` runs a reduced count.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from edgeadapt.harness.fault_injection import (GOOD, KINDS, MODELS, export_reference_bundles,  # noqa: E402
                                               make_cases, run_cases, summarize)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corruptions", type=int, default=100, help="corrupt and rehashed cases per bundle, each")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per-case limit before a case counts as a hang")
    parser.add_argument("--out", default=None, help="write cases and results as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="edgeadapt-bundles-") as tmp:
        bundles = export_reference_bundles(Path(tmp), args.models.split(","))
        cases = make_cases(bundles, args.corruptions, args.seed)
        start = time.perf_counter()
        results = run_cases(bundles, cases, timeout_s=args.timeout_s)
        elapsed_s = time.perf_counter() - start
    summary = summarize(cases, results)
    print(f"fault injection, seed {args.seed}: {len(cases)} cases on {args.models} in {elapsed_s:.0f} s")
    outcomes = sorted({o for counts in summary.values() for o in counts})
    print(f"{'kind':<10}" + "".join(f"{o:>10}" for o in outcomes))
    for kind in (*KINDS, "all"):
        if kind in summary:
            print(f"{kind:<10}" + "".join(f"{summary[kind].get(o, 0):>10}" for o in outcomes))
    bad = [(c, r) for c, r in zip(cases, results) if r["outcome"] not in (*GOOD, "noop", "trained")
           or (r["outcome"] == "trained" and c["kind"] != "rehashed")]
    for case, result in bad[:20]:
        print(f"  {result['outcome']}: {case['model']} {case['kind']} {case['file']}: {result.get('error', '')[:200]}")
    if args.out:
        Path(args.out).write_text(json.dumps({"cases": cases, "results": results, "summary": summary}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
