"""Export a torch model to an on-device training bundle (needs torch, onnx, onnxruntime-training).

Example::

    from edgeadapt.export import export_bundle, UpdatePolicy, Rule
    export_bundle(model, torch.randn(32, 8, 256), "bundle/",
                  policy=UpdatePolicy(rules=(Rule("head", "full"),
                                             Rule("blocks.3.conv", "channels", ratio=0.25))),
                  loss="cross_entropy", optimizer="adamw")
"""

from .exporter import export_bundle, plan_cost
from .unsupported import UnsupportedOpError
from .objectives import LOSSES, OPTIMIZERS, OptimizerConfig
from ..sched.policy import Mode, Rule, UpdatePolicy
from .prepare import FrozenBatchNorm

__all__ = [
    "export_bundle",
    "plan_cost",
    "UpdatePolicy",
    "Rule",
    "Mode",
    "OptimizerConfig",
    "UnsupportedOpError",
    "FrozenBatchNorm",
    "LOSSES",
    "OPTIMIZERS",
]
