"""On a device install (no torch), the server commands end in one line naming the extra, exit 2."""

from __future__ import annotations

import pytest
from helpers import run_python


@pytest.mark.parametrize("argv", [
    ["export", "mypkg.nets:make_net", "--input-shape", "8,256", "--out", "OUT/bundle"],
    ["train", "--model", "cnn", "--steps", "1", "--checkpoint-dir", "OUT/run"],
    ["quickstart", "--small", "--out", "OUT/qs"],
], ids=["export", "train", "quickstart"])
def test_a_server_command_without_torch_names_the_extra_in_one_line(tmp_path, argv):
    argv = [a.replace("OUT", str(tmp_path)) for a in argv]
    proc = run_python(f"import sys\nfrom edgeadapt.cli import main\nsys.exit(main({argv!r}))", block_torch=True,
                      cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith(f"error: edgeadapt {argv[0]} needs torch")
    assert 'pip install ".[server]" in an edgeadapt checkout' in lines[0]
    assert list(tmp_path.iterdir()) == []  # failed before any work


def test_a_missing_user_module_is_not_blamed_on_an_extra(tmp_path):
    """Only the extra's own packages are named: another missing module keeps its error."""
    proc = run_python("import sys\nfrom edgeadapt.cli import main\n"
                      f"sys.exit(main(['export', 'no_such_pkg_xyz:f', '--input-shape', '4,8', '--out', "
                      f"{str(tmp_path / 'b')!r}]))", cwd=tmp_path)
    assert ".[server]" not in proc.stderr
    assert "no_such_pkg_xyz" in proc.stderr
