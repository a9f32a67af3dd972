"""The package as a whole: exports, no torch (it runs on the device), relative imports only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import edgeadapt.datasets as datasets_package


def test_every_exported_name_exists():
    assert len(set(datasets_package.__all__)) == len(datasets_package.__all__)
    missing = [name for name in datasets_package.__all__ if not hasattr(datasets_package, name)]
    assert missing == []


def test_importing_and_using_the_package_pulls_in_no_torch():
    code = (
        "import sys, edgeadapt.datasets as d; "
        "d.make_synthetic(d.SyntheticConfig(n_subjects=2, windows_per_subject=6, n_time_steps=16)); "
        "loaded = [m for m in ('torch', 'seglearn') if m in sys.modules]; assert not loaded, loaded"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_modules_import_each_other_relatively():
    # The folder is reached as edgeadapt.datasets through a symlink; an absolute `datasets` import
    # would pick up an unrelated top-level package of that name.
    package_dir = Path(datasets_package.__file__).parent
    for module in package_dir.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [node.module.split(".")[0]]
            else:
                continue
            assert not {"datasets", "edgeadapt", "torch"} & set(roots), f"{module.name}: {ast.unparse(node)}"
