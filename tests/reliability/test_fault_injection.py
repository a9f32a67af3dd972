"""Fault injection (reduced count; ``benchmarks/fault_injection.py`` runs the full one): every
damaged copy of a bundle ends in a project error naming the damaged file - never a crash, a
hang, a raw exception or a training run on a bundle whose checksums do not match."""

from __future__ import annotations

import sys

import pytest

from edgeadapt.harness import fault_injection as fi


def _check(cases, results):
    leaks = [(c["model"], c["kind"], c["file"], r) for c, r in zip(cases, results)
             if r["outcome"] not in ("refused", "harmless", "noop", "trained")]
    assert not leaks, leaks
    # With checksums intact, no damaged copy may train; only a rehashed one whose damage no
    # content check can see (a changed value) may.
    trained = [(c["kind"], c["file"]) for c, r in zip(cases, results) if r["outcome"] == "trained"]
    assert all(kind == "rehashed" for kind, _ in trained), trained
    summary = fi.summarize(cases, results)
    for kind in ("corrupt", "truncate", "delete", "inflate"):
        assert set(summary[kind]) == {"refused"}, summary
    assert summary["rehashed"].get("refused", 0) >= summary["rehashed"].get("trained", 0)


def _run(tmp_path, models, n_corrupt):
    bundles = fi.export_reference_bundles(tmp_path, models)
    cases = fi.make_cases(bundles, n_corrupt, seed=0)
    kinds = {c["kind"] for c in cases}
    assert kinds == set(fi.KINDS)
    results = fi.run_cases(bundles, cases, timeout_s=120)
    _check(cases, results)


def test_every_damaged_cnn_bundle_is_refused_naming_the_file(tmp_path):
    _run(tmp_path, ["cnn"], n_corrupt=6)


@pytest.mark.slow
def test_every_damaged_reference_bundle_is_refused_naming_the_file(tmp_path):
    _run(tmp_path, ["cnn", "mobilenet", "transformer"], n_corrupt=20)


def test_the_harness_reports_crashes_and_hangs(tmp_path):
    """A worker that dies from a signal or stops answering is recorded, and the next case runs."""
    code = tmp_path / "worker.py"
    code.write_text(
        "import os, signal, sys, time\n"
        "start = int(sys.argv[sys.argv.index('--start') + 1])\n"
        "for i in range(start, 3):\n"
        "    print(f'START {i}', flush=True)\n"
        "    if i == 0: os.kill(os.getpid(), signal.SIGSEGV)\n"
        "    if i == 1: time.sleep(60)\n"
        "    print(f'RESULT {i} {{\"outcome\": \"refused\"}}', flush=True)\n"
    )
    results = fi.run_cases({"m": tmp_path}, [{"model": "m", "kind": "delete", "file": "x"}] * 3, timeout_s=3,
                           worker=[sys.executable, str(code)])
    assert [r["outcome"] for r in results] == ["crash", "hang", "refused"]
