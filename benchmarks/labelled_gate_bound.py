"""What a gate that knew the labels could have decided: a bound on label-free safety.

For each label-free fold of finished ``benchmarks/loso.py`` studies (results JSON with
cross-fitted gate evidence), this rebuilds the fold's split from the study's own config (the same
seeded functions), takes the labels of the windows the subject adapted on, and scores the
gate's recorded out-of-fold predictions against them: the cross-fitted predictions of the source
model and of the adaptation, window by window, in the permutation's order the gate recorded.

It prints, per fold, the accuracy change the labels show on the windows adapted on (with its
paired standard error: ``sqrt(sum d_i^2) / n`` for ``d_i`` = adapted correct - source correct),
the label-free gate's decision, and the change measured on the subject's evaluation windows.
Then, over the folds the label-free gate kept (where the adaptation's effect on the evaluation
windows was measured), what a gate that also had those labels would have done: keep an
adaptation only when the labelled change on the windows adapted on is not negative
(``labelled >= 0``), not below one standard error, or above one. A harm that such a gate cannot
see is one no label-free criterion computed from the same windows can see either.

    .venv/bin/python benchmarks/labelled_gate_bound.py benchmarks/results/*_crossfit.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # loso.py, whose studies this reads

from loso import study_dataset  # noqa: E402

from edgeadapt.atomic import atomic_write_json  # noqa: E402
from edgeadapt.datasets.shifts import shift_subject  # noqa: E402
from edgeadapt.harness.study import make_split  # noqa: E402

HURT_POINTS = 1.0


def fold_rows(path: Path) -> list[dict]:
    """One dict per label-free fold of the study at ``path`` whose gate evidence is cross-fitted."""
    study = json.loads(path.read_text())
    cfg = study["config"]
    ds = study_dataset(cfg["dataset"], cfg["seed"])
    out = []
    for row in study["rows"]:
        if row["method"] != "label-free" or not row["label_free"].get("cross_fitted"):
            continue
        target = int(row["subject"])
        fold_ds = ds if cfg["target_shift"] is None else shift_subject(ds, target, cfg["target_shift"], cfg["seed"])
        split = make_split(fold_ds, target, cfg["k_per_class"], cfg["seed"], adapt_classes=cfg["adapt_classes"],
                           unlabeled_fraction=cfg["unlabeled_fraction"])
        settings, gate = row["label_free"]["settings"], row["label_free"]["gate"]
        y = np.asarray(split.target_adapt.y)
        source = np.asarray(gate["source"]["classes"])
        adapted = np.asarray(gate["adapted"]["classes"])
        if len(source) != len(y):
            raise SystemExit(f"{path.name}, subject {target}: the gate saw {len(source)} windows, the split has "
                             f"{len(y)}: this is not the study's split (another dataset version or config?)")
        # the cross-fitted evidence lists the windows in the gate's seeded permutation's order
        truth = y[np.random.default_rng(settings["seed"]).permutation(len(y))]
        source_right = source == truth
        d = (adapted == truth).astype(float) - source_right.astype(float)
        out.append({
            "study": path.stem, "subject": target, "n_windows": len(y),
            "labelled_points": 100 * float(d.mean()),
            "labelled_se_points": 100 * math.sqrt(float((d ** 2).sum())) / len(d),
            "source_accuracy_adapt_windows": float(source_right.mean()),
            "eval_points": 100 * (row["accuracy"] - row["accuracy_source_only"]),
            "label_free_kept": bool(gate["kept"]),
            "changed_fraction": float(gate["changed_fraction"]),
        })
    return out


def _tally(rows: list[dict], keep) -> dict:
    """Points on the evaluation windows over the folds whose adaptation the label-free gate kept
    (only there is the adaptation's effect on them known), keeping those ``keep`` accepts."""
    gains = [r["eval_points"] if keep(r) else 0.0 for r in rows]
    return {"folds": len(rows), "mean_points": float(np.mean(gains)),
            "hurt": sum(g < -HURT_POINTS for g in gains), "improved": sum(g > HURT_POINTS for g in gains),
            "helpful_refused": sum(not keep(r) and r["eval_points"] > HURT_POINTS for r in rows)}


RULES = {
    "label-free gate (as run)": lambda r: True,
    "and labels: labelled >= 0": lambda r: r["labelled_points"] >= 0,
    "and labels: labelled >= -SE": lambda r: r["labelled_points"] >= -r["labelled_se_points"],
    "and labels: labelled > SE": lambda r: r["labelled_points"] > r["labelled_se_points"],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("studies", type=Path, nargs="+", help="loso.py results JSON with cross-fitted label-free rows")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "labelled_gate_bound.json")
    args = p.parse_args(argv)
    rows = [r for path in args.studies for r in fold_rows(path)]
    if not rows:
        p.error("no cross-fitted label-free folds in these files")
    print(f"{'study':58s} {'subj':>4s} {'n':>4s} {'labelled (SE)':>15s} {'eval':>6s} gate")
    for r in rows:
        print(f"{r['study']:58s} {r['subject']:4d} {r['n_windows']:4d} "
              f"{r['labelled_points']:+6.1f} ({r['labelled_se_points']:4.1f}) {r['eval_points']:+6.1f} "
              f"{'kept' if r['label_free_kept'] else 'refused'}")
    se = np.array([r["labelled_se_points"] for r in rows])
    kept_changed = [r for r in rows if r["changed_fraction"] > 0]
    print(f"\n{len(rows)} folds; standard error of the labelled change on the windows adapted on, where any "
          f"prediction changed ({len(kept_changed)} folds): median "
          f"{np.median([r['labelled_se_points'] for r in kept_changed]):.1f} points "
          f"(k-shot folds: {np.median([r['labelled_se_points'] for r in kept_changed if r['n_windows'] < 100]):.1f}); "
          f"below {HURT_POINTS:g} point in {int((se[[r['changed_fraction'] > 0 for r in rows]] < HURT_POINTS).sum())}")
    kept = [r for r in rows if r["label_free_kept"]]
    tallies = {name: _tally(kept, keep) for name, keep in RULES.items()}
    print(f"\nover the {len(kept)} folds the label-free gate kept (what the adaptation did to the others' evaluation "
          "windows is not measured), keeping only those the rule accepts:")
    print(f"{'rule':46s} {'mean':>6s} {'improved':>8s} {'hurt':>5s} {'helpful refused':>16s}")
    for name, t in tallies.items():
        print(f"{name:46s} {t['mean_points']:+6.2f} {t['improved']:8d} {t['hurt']:5d} {t['helpful_refused']:16d}")
    hurt = [r for r in kept if r["labelled_points"] >= 0 and r["eval_points"] < -HURT_POINTS]
    print("\nhurt although the labels of the windows adapted on showed no loss: "
          + (", ".join(f"{r['study']} s{r['subject']} ({r['labelled_points']:+.1f} on them, "
                       f"{r['eval_points']:+.1f} on evaluation)" for r in hurt) or "none"))
    refused = [r for r in rows if not r["label_free_kept"]]
    gain = sum(r["labelled_points"] > r["labelled_se_points"] for r in refused)
    loss = sum(r["labelled_points"] < -r["labelled_se_points"] for r in refused)
    print(f"\nof the {len(refused)} folds the label-free gate refused, the labels of the windows adapted on show a "
          f"gain above one standard error in {gain} and a loss below minus one in {loss}")
    atomic_write_json(args.out, {"command": " ".join([".venv/bin/python", "benchmarks/labelled_gate_bound.py",
                                                      *map(str, argv if argv is not None else sys.argv[1:])]),
                                 "folds": rows, "rules": tallies, "hurt_points": HURT_POINTS})
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
