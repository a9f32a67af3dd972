"""Shared by the portable parity tests: a bundle's portable graphs driven directly with numpy on
plain ``onnxruntime.InferenceSession``s (no edgeadapt runtime), and a torch eager reference that
holds the same trained tensors (a channel-split weight is ``cat([trained, frozen])[index]`` of
a trained leaf and a frozen constant, as the bundle holds it).

Criteria (derived from the computation, as in test_parity_reference.py):

* gradients at the same parameters, against torch in float64: ``||g - g64|| <= rtol * ||g64|| +
  ZERO * G + 3 * s`` with ``rtol = max(2e-5, N * eps32 / 4)`` for ``N`` the terms summed into a
  weight gradient (batch x output positions: float32 running sums), ``G`` the largest gradient
  norm, ``ZERO = 1e-7`` the level of a numerically zero gradient and ``s`` the distance of
  torch's own float32 gradient from float64 (what float32 cannot resolve in that tensor);
* losses at the same parameters: relative 1e-6 of float64 torch;
* each optimizer step: ``torch.optim`` fed the same parameters and gradients (its moments built
  from the same gradients) -> ``export.selfcheck.compare_step`` (1e-4 of the step + 4 ulps);
* running statistics (batch-statistics BatchNorm): relative 1e-5 of torch's (a mean and a
  variance of ``N`` float32 terms per channel);
* frozen tensors and channels: bit-identical.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import onnxruntime as ort
import torch
from torch.func import functional_call

from edgeadapt.bundle import read_manifest
from edgeadapt.export.objectives import torch_loss
from edgeadapt.export.selfcheck import compare_step

EPS32 = float(np.finfo(np.float32).eps)
GRAD_RTOL, ZERO, LOSS_RTOL, STAT_RTOL = 2e-5, 1e-7, 1e-6, 1e-5


def norm(a) -> float:
    return math.sqrt(float(np.square(np.asarray(a, np.float64)).sum()))


class PortableGraphs:
    """A bundle's portable graphs, each run by role on an InferenceSession."""

    def __init__(self, bundle):
        self.manifest = m = read_manifest(bundle)
        self.spec = m.portable["graphs"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.sessions = {role: ort.InferenceSession(str(bundle / m.files[role]), options,
                                                    providers=["CPUExecutionProvider"])
                         for role in self.spec}
        self.prefix = (ort.InferenceSession(str(bundle / m.files["prefix_model"]), options,
                                            providers=["CPUExecutionProvider"]) if m.has_prefix else None)
        with np.load(bundle / m.files["portable_state"], allow_pickle=False) as z:
            self.state = {k: z[k] for k in z.files}
        self.params = {r[6:]: self.state[r[6:]] for r, _ in self.spec["portable_train"]["inputs"]
                       if r.startswith("param:")}
        self.trained = [r[5:] for r, _ in self.spec["portable_train"]["outputs"] if r.startswith("grad:")]

    def run(self, role: str, feeds: dict) -> dict:
        inputs = {name: feeds[r] for r, name in self.spec[role]["inputs"]}
        outs = self.sessions[role].run([n for _, n in self.spec[role]["outputs"]], inputs)
        return dict(zip([r for r, _ in self.spec[role]["outputs"]], outs))

    def data(self, x: np.ndarray) -> np.ndarray:
        return x if self.prefix is None else self.prefix.run(None, {"input": x})[0]

    def train(self, params: dict, x: np.ndarray, y) -> dict:
        feeds = {f"param:{n}": v for n, v in params.items()}
        feeds.update(data=self.data(x), weights=np.full(len(x), 1.0 / len(x), np.float32))
        if y is not None:
            feeds["labels"] = y
        return self.run("portable_train", feeds)

    def optimizer(self, params: dict, grads: dict, moments: dict, t: int, lr: float) -> dict:
        """One update; ``moments``: ``{"exp_avg": {...}, "exp_avg_sq": {...}}`` (AdamW) or empty."""
        opt = self.manifest.optimizer
        feeds = {}
        for n in self.trained:
            feeds[f"param:{n}"], feeds[f"grad:{n}"] = params[n], grads[n]
            for kind, held in moments.items():
                feeds[f"{kind}:{n}"] = held[n]
        if opt["name"] == "adamw":  # host scalars in float64, as the runtime computes them
            b1, b2 = opt["betas"]
            scalars = {"decay": 1 - lr * opt["weight_decay"], "step_size": lr / (1 - b1 ** t),
                       "bias_correction2_sqrt": math.sqrt(1 - b2 ** t)}
        else:
            scalars = {"lr": lr}
        feeds.update({k: np.array(v, np.float32) for k, v in scalars.items()})
        return self.run("portable_optimizer", feeds)


class TorchReference:
    """The source model in torch eager with the bundle's trained tensors as leaves."""

    def __init__(self, model: torch.nn.Module, graphs: PortableGraphs, batch_statistics: bool):
        self.model = copy.deepcopy(model)
        self.graphs = graphs
        self.batch_statistics = batch_statistics
        self.entries = [e for e in graphs.manifest.parameters if e.onnx_names]
        self.buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        self.fixed = {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def tensors(self, params: dict, dtype=torch.float32, requires_grad: bool = True):
        """(leaves by graph name, the model's parameters and buffers for functional_call)."""
        leaves = {n: torch.tensor(params[n], dtype=dtype, requires_grad=requires_grad) for n in self.graphs.trained}
        full = {}
        for e in self.entries:
            names = e.onnx_names
            if e.is_split:
                frozen = torch.tensor(params[names["frozen"]], dtype=dtype)
                full[e.name] = torch.cat([leaves[names["trained"]], frozen])[torch.from_numpy(params[names["index"]])]
            else:
                full[e.name] = leaves.get(names["value"], torch.tensor(params[names["value"]], dtype=dtype))
        values = {n: v.to(dtype) for n, v in self.fixed.items()}
        values.update(full)
        values.update({n: torch.tensor(params[n], dtype=dtype) if n in params
                       else b.to(dtype) if b.is_floating_point() else b
                       for n, b in self.buffers.items()})
        return leaves, values

    def loss_grads(self, params: dict, x: np.ndarray, y, dtype) -> tuple[float, dict, dict]:
        """Loss, gradients by graph name, new running statistics (batch statistics) at ``params``."""
        leaves, values = self.tensors(params, dtype)
        model = self.model.to(dtype).train(self.batch_statistics)
        out = functional_call(model, values, (torch.from_numpy(x).to(dtype),))
        labels = None if y is None else torch.from_numpy(y)
        if labels is not None and labels.is_floating_point():
            labels = labels.to(dtype)
        loss = torch_loss(self.graphs.manifest.loss, out, labels)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        stats = {n: v.detach().numpy() for n, v in values.items() if n.endswith(("running_mean", "running_var"))}
        return loss.item(), {n: g.numpy() for n, g in zip(leaves, grads)}, stats


def grad_deviations(got: dict, g64: dict, g32: dict, n_terms: int) -> dict[str, float]:
    """Per trained tensor: the gradient error as a fraction of its allowance (<= 1 passes)."""
    rtol = max(GRAD_RTOL, n_terms * EPS32 / 4)
    scale = max(norm(g) for g in g64.values())
    out = {}
    for n, g in g64.items():
        allowed = rtol * norm(g) + ZERO * scale + 3 * norm(np.asarray(g32[n], np.float64) - g)
        out[n] = norm(np.asarray(got[n], np.float64) - g) / allowed
    return out


def torch_optimizer(leaves: list[torch.Tensor], opt: dict, lr: float) -> torch.optim.Optimizer:
    if opt["name"] == "adamw":
        return torch.optim.AdamW(leaves, lr=lr, betas=tuple(opt["betas"]), eps=opt["eps"],
                                 weight_decay=opt["weight_decay"])
    return torch.optim.SGD(leaves, lr=lr)


def synced_steps(bundle, model, data: tuple[np.ndarray, np.ndarray], batch: int, lr: float, n_terms: int
                 ) -> tuple[dict, dict]:
    """Steps over ``data`` in batches of ``batch`` where both sides start each step from the graphs'
    parameters; returns the worst fraction of each allowance (<= 1 passes) and the final graph
    parameters. ``n_terms``: the longest sum of a weight gradient (batch x output positions)."""
    graphs = PortableGraphs(bundle)
    ref = TorchReference(model, graphs, graphs.manifest.batch_statistics)
    params = dict(graphs.params)
    opt = graphs.manifest.optimizer
    moments = {k: {n: np.zeros_like(params[n]) for n in graphs.trained} for k in ("exp_avg", "exp_avg_sq")
               } if opt["name"] == "adamw" else {}
    leaves = {n: torch.tensor(params[n], requires_grad=True) for n in graphs.trained}
    torch_opt = torch_optimizer(list(leaves.values()), opt, lr)
    worst = {"grad": 0.0, "loss": 0.0, "step": 0.0, "stat": 0.0}
    X, Y = data
    for s in range(len(X) // batch):
        x, y = X[s * batch:(s + 1) * batch], Y[s * batch:(s + 1) * batch]
        got = graphs.train(params, x, y)
        loss64, g64, stats64 = ref.loss_grads(params, x, y, torch.float64)
        _, g32, _ = ref.loss_grads(params, x, y, torch.float32)
        grads = {n: got[f"grad:{n}"] for n in graphs.trained}
        worst["grad"] = max(worst["grad"], *grad_deviations(grads, g64, g32, n_terms=n_terms).values())
        worst["loss"] = max(worst["loss"], abs(float(got["loss"]) - loss64) / (LOSS_RTOL * abs(loss64)))
        for r, v in got.items():
            if r.startswith("stat:"):
                want = stats64[r[5:]]
                worst["stat"] = max(worst["stat"], norm(v - want) / (STAT_RTOL * norm(want)))
        new = graphs.optimizer(params, grads, moments, s + 1, lr)
        with torch.no_grad():
            for n, leaf in leaves.items():
                leaf.copy_(torch.from_numpy(params[n]))
                leaf.grad = torch.from_numpy(grads[n].copy())
        torch_opt.step()
        want = {n: leaf.detach().numpy().copy() for n, leaf in leaves.items()}
        got_step = {n: new[f"param:{n}"] for n in graphs.trained}
        worst["step"] = max(worst["step"], *(d.ratio for d in compare_step(params, got_step, want)))
        params = {**params, **got_step, **{r[5:]: v for r, v in got.items() if r.startswith("stat:")}}
        for kind in moments:
            moments[kind] = {n: new[f"{kind}:{n}"] for n in graphs.trained}
    return worst, params
