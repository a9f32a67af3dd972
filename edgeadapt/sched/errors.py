"""Errors of the planner; each carries the numbers."""

from __future__ import annotations

from ..units import format_bytes

__all__ = ["BudgetExceeded", "NoFeasiblePlan"]


class BudgetExceeded(ValueError):
    """A plan needs more memory than the budget allows.

    Attributes:
        need_bytes: the plan's peak.
        have_bytes: the budget.
        where: the position of the peak (``"backward:blocks.3.conv"``).
        tier: the memory tier whose budget is exceeded.
    """

    def __init__(self, need_bytes: int, have_bytes: int, where: str, tier: str = "compute", detail: str = ""):
        self.need_bytes, self.have_bytes, self.where, self.tier = int(need_bytes), int(have_bytes), where, tier
        msg = (f"plan needs {self.need_bytes} bytes ({format_bytes(self.need_bytes)}) of {tier} memory at {where}, "
               f"but the budget is {self.have_bytes} bytes ({format_bytes(self.have_bytes)})")
        super().__init__(msg + (f"; {detail}" if detail else ""))

    def __reduce__(self):  # keep the numbers through pickling by multiprocessing / pytest-xdist
        return (type(self), (self.need_bytes, self.have_bytes, self.where, self.tier))


class NoFeasiblePlan(BudgetExceeded):
    """No plan fits the budget; ``need_bytes`` is the smallest budget for which one would."""

    def __init__(self, need_bytes: int, have_bytes: int, where: str, tier: str = "compute", detail: str = ""):
        detail = detail or (f"no plan fits; the smallest budget that fits is {need_bytes} bytes "
                            f"({format_bytes(int(need_bytes))}): raise the budget to at least that")
        super().__init__(need_bytes, have_bytes, where, tier, detail)
