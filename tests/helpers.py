"""Test helpers: tiny seeded models for parity tests, data, and a torch-free subprocess."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

TORCH_BLOCKER = "from edgeadapt.harness.isolation import forbid_torch\nforbid_torch()\n"


def as_if_pretrained(model, generator=None):
    """Norm layers with the distinct statistics and affine values of a trained model (in place).

    The one helper for tests and benchmarks: :func:`edgeadapt.harness.pretrained_like.as_if_pretrained`.
    """
    from edgeadapt.harness.pretrained_like import as_if_pretrained as draw

    return draw(model, generator)


def load_benchmark(name: str, *, register: bool = False):
    """The script ``benchmarks/<name>.py`` as a module (``register``: also in ``sys.modules``, for
    code that looks its module up by name, such as dataclasses sent to worker processes)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_python(code: str, *, block_torch: bool = False, cwd: Path | None = None, timeout_s: int = 300):
    """Run ``code`` in a fresh interpreter; returns the CompletedProcess (text mode)."""
    src = (TORCH_BLOCKER if block_torch else "") + textwrap.dedent(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout_s, env=env)


def make_cnn(seed: int = 0, n_channels: int = 4, n_classes: int = 3):
    """Conv-BN-ReLU x2 + head, BN statistics randomised as a trained model would have them."""
    import torch
    from torch import nn

    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv1d(n_channels, 8, 5, padding=2)
            self.bn1 = nn.BatchNorm1d(8)
            self.conv2 = nn.Conv1d(8, 12, 3, padding=1, stride=2)
            self.bn2 = nn.BatchNorm1d(12)
            self.dw = nn.Conv1d(12, 12, 3, padding=1, groups=12)
            self.pool = nn.MaxPool1d(2)
            self.head = nn.Linear(12, n_classes)

        def forward(self, x):
            x = torch.relu(self.bn1(self.conv1(x)))
            x = torch.nn.functional.relu6(self.bn2(self.conv2(x)))
            x = self.pool(x + self.dw(x))
            return self.head(x.mean(-1))

    torch.manual_seed(seed)
    return as_if_pretrained(CNN()).eval()


def make_two_input_model(n_channels: int = 4, n_classes: int = 3):
    """A model whose forward takes two tensors (signal and a per-channel offset): no bundle can
    take it (export refuses it)."""
    from torch import nn

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(n_channels, n_classes)

        def forward(self, x, offset):
            return self.head((x + offset).mean(-1))

    return TwoInputs()


def make_transformer(seed: int = 0, n_channels: int = 4, n_classes: int = 3, dim: int = 16, heads: int = 2):
    """One pre-norm encoder layer: patch embedding, softmax attention, GELU MLP, dropout."""
    import torch
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Conv1d(n_channels, dim, 4, stride=4)
            self.norm1 = nn.LayerNorm(dim)
            # No bias: a key bias has an exactly-zero gradient (softmax is shift-invariant), and AdamW
            # turns the float noise of that zero into full-size steps that no two kernels agree on.
            self.qkv = nn.Linear(dim, 3 * dim, bias=False)
            self.proj = nn.Linear(dim, dim)
            self.drop = nn.Dropout(0.1)
            self.norm2 = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            self.head = nn.Linear(dim, n_classes)

        def forward(self, x):
            t = self.embed(x).transpose(1, 2)  # (b, tokens, dim)
            q, k, v = self.qkv(self.norm1(t)).chunk(3, dim=-1)
            b, n, _ = q.shape
            q, k, v = (z.reshape(b, n, heads, dim // heads).transpose(1, 2) for z in (q, k, v))
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dim // heads), dim=-1)
            t = t + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, n, dim)))
            t = t + self.drop(self.mlp(self.norm2(t)))
            return self.head(t.mean(1))

    torch.manual_seed(seed)
    return as_if_pretrained(Encoder()).eval()


def make_fusible(seed: int = 0, n_channels: int = 4, n_classes: int = 3, dim: int = 16):
    """Patterns ONNX Runtime's artifact generator fuses or rewrites: a LayerNorm written with
    ``Pow`` (-> ``LayerNormalization``), an erf GELU (-> ``Gelu``) after a 2-D Linear (``Gemm``),
    a tanh GELU (kept as elementary ops), ``q @ k^T`` with softmax, residual adds."""
    import torch
    from torch import nn

    class PowLayerNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(0.5 + torch.rand(dim))  # trained-like values, not ones and zeros
            self.bias = nn.Parameter(0.4 * torch.rand(dim) - 0.2)

        def forward(self, x):
            mu = x.mean(-1, keepdim=True)
            var = (x - mu).pow(2).mean(-1, keepdim=True)
            return (x - mu) / torch.sqrt(var + 1e-5) * self.weight + self.bias

    class Fusible(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Conv1d(n_channels, dim, 4, stride=4)
            self.norm = PowLayerNorm()
            self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.fc1 = nn.Linear(dim, 2 * dim)
            self.act = nn.GELU(approximate="tanh")
            self.fc2 = nn.Linear(2 * dim, dim)
            self.pool_fc = nn.Linear(dim, dim)
            self.pool_act = nn.GELU()
            self.head = nn.Linear(dim, n_classes)

        def forward(self, x):
            t = self.norm(self.embed(x).transpose(1, 2))
            att = torch.softmax(self.q(t) @ self.k(t).transpose(-1, -2) / math.sqrt(dim), dim=-1)
            t = t + att @ self.v(t)
            t = t + self.fc2(self.act(self.fc1(t)))
            return self.head(self.pool_act(self.pool_fc(t.mean(1))))

    torch.manual_seed(seed)
    return as_if_pretrained(Fusible()).eval()


def make_data(rng: np.random.Generator, n: int = 24, n_channels: int = 4, length: int = 16, n_classes: int = 3):
    X = rng.standard_normal((n, n_channels, length)).astype(np.float32)
    y = rng.integers(0, n_classes, n).astype(np.int64)
    return X, y


def make_cnn2d(seed: int = 0, n_classes: int = 3):
    """Conv2d-BN2d-ReLU, a depthwise Conv2d with a residual, average pooling, head."""
    import torch
    from torch import nn

    class CNN2d(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 6, 3, padding=1)
            self.bn = nn.BatchNorm2d(6)
            self.dw = nn.Conv2d(6, 6, 3, padding=1, groups=6)
            self.pool = nn.AvgPool2d(2)
            self.head = nn.Linear(6 * 4 * 4, n_classes)

        def forward(self, x):
            x = torch.relu(self.bn(self.conv(x)))
            x = self.pool(x + self.dw(x))
            return self.head(x.flatten(1))

    torch.manual_seed(seed)
    return as_if_pretrained(CNN2d()).eval()


def make_groupnorm(seed: int = 0, n_classes: int = 3):
    """Conv1d-GroupNorm-ReLU, Conv1d-InstanceNorm1d(affine)-ReLU, mean over time, head: the norms
    torch exports as InstanceNormalization, which the exporter rewrites into differentiable ops."""
    import torch
    from torch import nn

    class GroupNormNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv1d(4, 8, 3, padding=1)
            self.gn = nn.GroupNorm(2, 8)
            # no bias: a per-channel bias before an instance norm cancels out (its gradient is float
            # noise, which Adam would turn into full-size steps)
            self.conv2 = nn.Conv1d(8, 8, 3, padding=1, bias=False)
            self.inorm = nn.InstanceNorm1d(8, affine=True)
            self.head = nn.Linear(8, n_classes)

        def forward(self, x):
            x = torch.relu(self.gn(self.conv1(x)))
            x = torch.relu(self.inorm(self.conv2(x)))
            return self.head(x.mean(-1))

    torch.manual_seed(seed)
    model = GroupNormNet()
    with torch.no_grad():  # non-trivial affines, as after pretraining
        for norm in (model.gn, model.inorm):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.3, 0.3)
    return model.eval()


def strip_plan(src: Path, dst: Path) -> None:
    """Copy bundle ``src`` to ``dst`` as a bundle written before memory plans existed: no ``plan``
    or ``graph`` in the manifest, no settings stamps in the graphs (checksums recomputed)."""
    import json
    import shutil

    import onnx

    from edgeadapt.bundle import sha256_file

    shutil.copytree(src, dst)
    raw = json.loads((dst / "manifest.json").read_text())
    raw.pop("plan", None), raw.pop("graph", None), raw.pop("manifest_sha256", None)
    for role in ("training_model", "eval_model", "optimizer_model"):
        path = dst / raw["files"][role]
        model = onnx.load(path)
        keep = [p for p in model.metadata_props if not p.key.startswith("edgeadapt")]
        del model.metadata_props[:]
        model.metadata_props.extend(keep)
        onnx.save(model, path)
        raw["sha256"][raw["files"][role]] = sha256_file(path)
    (dst / "manifest.json").write_text(json.dumps(raw))


def sigint_at_train_step(monkeypatch, runner, n: int) -> None:
    """Make ``runner``'s ``n``-th backend ``train_step`` raise SIGINT in this process first (as a
    Ctrl-C arriving during that step), then run the step."""
    import signal

    real, calls = runner._backend.train_step, []

    def train_step(x, y):
        calls.append(1)
        if len(calls) == n:
            signal.raise_signal(signal.SIGINT)
        return real(x, y)

    monkeypatch.setattr(runner._backend, "train_step", train_step)
