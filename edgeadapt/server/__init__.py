"""Server-side full training: every parameter, streamed between compute, host memory and disk.

See ``docs/server.md``. The planner is :func:`edgeadapt.sched.offload.plan_offload`; this
package carries its plans out with torch.
"""

from ..optimizer_config import OptimizerConfig
from ..sched.errors import BudgetExceeded
from ..sched.offload import BlockTooLarge
from .checkpoint import CheckpointMismatch
from .executor import StreamingExecutor
from .progress import TrainProgress
from .residency import MemoryLedger, Residency
from .store import DiskStore, HostStore, OffloadDirError
from .trace import Block, BlockError, TraceError, find_blocks, trace_graph
from .trainer import LOSSES, Trainer, resolve_device

__all__ = [
    "Trainer", "OptimizerConfig", "LOSSES", "resolve_device", "TrainProgress",
    "BudgetExceeded", "BlockTooLarge", "CheckpointMismatch", "OffloadDirError", "BlockError", "TraceError",
    "StreamingExecutor", "MemoryLedger", "Residency", "HostStore", "DiskStore",
    "Block", "find_blocks", "trace_graph",
]
