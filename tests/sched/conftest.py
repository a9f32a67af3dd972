"""Make the planner tests' helper module importable (tests/sched is not a package: ``sched`` is a stdlib name)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
