"""Saves survive SIGKILL at random moments, and concurrent savers cannot break a bundle.

A child process adapts and saves in a loop (into the same bundle, or into a new folder each
time); the parent kills it after a seeded random delay. Afterwards every target either loads
and is consistent or is absent, the bundle's previous state is never lost, and the next save of
that target removes whatever the killed save left behind (stray checkpoints, temp files, its own
``.partial`` folders). Loading never writes or removes anything.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from edgeadapt.atomic import STAGE_MARKER
from edgeadapt.bundle import BundleError, read_manifest
from edgeadapt.runtime import Runner

CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    import numpy as np
    from edgeadapt.runtime import Runner

    mode, src, target = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    runner = Runner.load(src, device="cpu", threads=1)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((8, 4, 16)).astype(np.float32)
    y = rng.integers(0, 3, 8).astype(np.int64)
    runner.adapt(X, y, epochs=1, batch_size=8, progress=False)  # opens the training session
    print("READY", flush=True)
    j = 0
    while True:
        runner.adapt(X, y, epochs=1, batch_size=8, progress=False)
        if mode == "same":
            runner.save(target)
        else:
            runner.save(target.parent / f"{target.name}{j}")
            j += 1
""")


def _kill_during_saves(mode: str, src, target, delay_s: float) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(src), str(target)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.strip() == "READY", child.stderr.read()
        time.sleep(delay_s)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        child.stderr.close()


def _leftovers(directory) -> list[str]:
    """Files of a bundle that its manifest does not list (stray checkpoints, temp files)."""
    manifest = read_manifest(directory, verify=False)
    keep = {"manifest.json", *manifest.files.values(), *manifest.sha256}
    return sorted(f.name for f in directory.iterdir() if f.name not in keep)


def _partials(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".partial"))


@pytest.fixture
def bundle(cnn_bundle, tmp_path):
    dst = tmp_path / "b"
    shutil.copytree(cnn_bundle, dst)
    return dst


def _rounds(request) -> int:
    return 30 if request.node.get_closest_marker("slow") else 5


def _same_bundle(bundle, rounds: int) -> None:
    rng = np.random.default_rng(0)
    step = 0
    for _ in range(rounds):
        _kill_during_saves("same", bundle, bundle, float(rng.uniform(0.0, 0.25)))
        runner = Runner.load(bundle, device="cpu")  # loads: checksums, graphs, checkpoint values
        assert runner.step >= step, "a save lost the previous state"
        step = runner.step
        runner.save(bundle)
        assert _leftovers(bundle) == []  # the next save removed what the killed save left
    assert step > 0, "no save completed in any round; the delays are too short to test anything"


def _new_folders(bundle, tmp_path, rounds: int) -> None:
    rng = np.random.default_rng(1)
    out = tmp_path / "outs"
    out.mkdir()
    completed = 0
    runner = Runner.load(bundle, device="cpu")
    for r in range(rounds):
        target = out / f"r{r}-"
        _kill_during_saves("new", bundle, target, float(rng.uniform(0.0, 0.25)))
        made = sorted(p for p in out.iterdir() if p.name.startswith(target.name) and not p.name.startswith("."))
        for folder in made:
            finished = Runner.load(folder, device="cpu")
            assert finished.step > 0
            if _leftovers(folder) == [STAGE_MARKER]:
                # killed between the rename into place and the marker's removal: the bundle is
                # whole, and the next save of it removes the marker
                finished.save()
            assert _leftovers(folder) == []
        completed += len(made)
        # The next folder the killed child would have written: absent; saving into it sweeps.
        following = out / f"{target.name}{len(made)}"
        with pytest.raises(BundleError, match="no such directory"):
            Runner.load(following)
        runner.save(following)
        assert _partials(out) == []
    assert completed > 0, "no save completed in any round; the delays are too short to test anything"


def test_sigkill_during_saves_into_the_same_bundle(bundle, request):
    _same_bundle(bundle, _rounds(request))


def test_sigkill_during_saves_into_new_folders(bundle, tmp_path, request):
    _new_folders(bundle, tmp_path, _rounds(request))


@pytest.mark.slow
def test_sigkill_during_30_saves_each(bundle, tmp_path, request):
    _same_bundle(bundle, 30)
    _new_folders(bundle, tmp_path, 30)


CONCURRENT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import numpy as np
    from edgeadapt.runtime import Runner

    src, target, go, n = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    runner = Runner.load(src, device="cpu", threads=1)
    rng = np.random.default_rng(os.getpid())
    X = rng.standard_normal((8, 4, 16)).astype(np.float32)
    y = rng.integers(0, 3, 8).astype(np.int64)
    while not go.exists():
        time.sleep(0.005)
    for _ in range(n):
        runner.adapt(X, y, epochs=1, batch_size=8, progress=False)
        try:
            runner.save(target)
        except FileExistsError as e:
            print("LOST", e, flush=True)
    print("DONE", flush=True)
""")


@pytest.mark.parametrize("into", ["same bundle", "new folder"])
def test_two_processes_saving_at_once(bundle, tmp_path, into):
    target = bundle if into == "same bundle" else tmp_path / "shared"
    go = tmp_path / "go"
    children = [subprocess.Popen([sys.executable, "-c", CONCURRENT, str(bundle), str(target), str(go), "6"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(0.5)
    go.touch()
    outs = [c.communicate(timeout=240) for c in children]
    for child, (out, err) in zip(children, outs):
        assert child.returncode == 0 and "DONE" in out, err
        # A loser of the race for a new folder fails cleanly; later saves update the winner's.
        assert "Traceback" not in err
    runner = Runner.load(target, device="cpu")
    assert runner.step > 0 and _leftovers(target) == [] and _partials(target.parent) == []
    if into == "same bundle":
        assert not any("LOST" in out for out, _ in outs)  # serialised by the lock: both succeed


def test_interrupted_saves_leave_nothing_after_a_later_save(bundle, tmp_path):
    """Leftovers of every kind a killed save can leave are removed by the next save."""
    runner = Runner.load(bundle, device="cpu")
    (bundle / "checkpoint-000009-abcdef").write_bytes(b"half")
    (bundle / ".checkpoint-000009-abcdef.x1y2.tmp").write_bytes(b"half")
    (bundle / ".manifest.json.k3j4.tmp").write_bytes(b"{")
    (bundle / STAGE_MARKER).touch()  # a save into a new folder killed right after its rename
    stale = tmp_path / ".new.abc123.partial"
    stale.mkdir()
    (stale / STAGE_MARKER).touch()  # what a killed staged_directory leaves
    runner.save(bundle)
    assert _leftovers(bundle) == []
    runner.save(tmp_path / "new")
    assert not stale.exists() and (tmp_path / "new" / "manifest.json").is_file()
    assert os.listdir(tmp_path / "new")


def test_loading_never_removes_or_writes(bundle):
    """A load leaves leftovers of a killed save alone (the next save removes them), so it also
    works on a read-only bundle."""
    leftover = bundle / ".checkpoint-000009-abcdef.x1y2.tmp"
    leftover.write_bytes(b"half")
    stale = bundle.parent / f".{bundle.name}.abc123.partial"
    stale.mkdir()
    (stale / STAGE_MARKER).touch()
    os.chmod(bundle, 0o555)
    try:
        Runner.load(bundle, device="cpu")
    finally:
        os.chmod(bundle, 0o755)
    assert leftover.exists() and stale.exists()


@pytest.mark.parametrize("name", ["*", "b?", "[bd]", "x"])
def test_only_the_runners_own_staging_folders_are_removed(bundle, tmp_path, name):
    """Directories of the user beside a target are never removed, whatever the target's name: a
    glob character in it matches only itself, and a staging folder needs the marker file."""
    d = tmp_path / "d"
    d.mkdir()
    users = [d / ".other.notes.partial", d / f".{name}.abc123.partial"]  # the second: no marker
    for folder in users:
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    with pytest.raises(BundleError, match="no such directory"):
        Runner.load(d / name)
    Runner.load(bundle, device="cpu").save(d / name)
    assert all((folder / "notes.txt").read_text() == "mine" for folder in users)
    assert (d / name / "manifest.json").is_file()
