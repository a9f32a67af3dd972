"""Small seeded models, data and a plain torch training loop for the server trainer's tests."""

from __future__ import annotations

import torch
from torch import nn


class MLPBlock(nn.Module):
    """Linear + GELU + dropout with a residual connection (random numbers in forward)."""

    def __init__(self, width: int, p: float = 0.1):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(nn.functional.gelu(self.fc(x)))


class MLPStack(nn.Module):
    """An input projection, ``depth`` residual blocks in a ModuleList (``block(width)`` each;
    default :class:`MLPBlock`), a layer norm and a head."""

    def __init__(self, d_in: int = 12, width: int = 32, depth: int = 4, n_classes: int = 5, block=None):
        super().__init__()
        block = block or MLPBlock
        self.proj = nn.Linear(d_in, width)
        self.layers = nn.ModuleList(block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, n_classes)

    def forward(self, x):
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def make_mlp(seed: int = 0, **kw) -> MLPStack:
    torch.manual_seed(seed)
    return MLPStack(**kw)


def make_cnn(seed: int = 0):
    from edgeadapt.models import CNN1d

    torch.manual_seed(seed)
    return CNN1d(4, 3, widths=(8, 16, 16))


def batches(kind: str, n: int, seed: int = 1, batch: int = 8):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if kind == "cnn":
            out.append((torch.randn(batch, 4, 32, generator=g), torch.randint(0, 3, (batch,), generator=g)))
        else:
            out.append((torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g)))
    return out


def reference_train(model: nn.Module, data, *, lr=1e-2, weight_decay=0.1, seed=123,
                    update_on_cpu: bool = False) -> nn.Module:
    """Plain in-memory torch training: AdamW(foreach=True) on cross-entropy, on the model's device.

    ``update_on_cpu``: forward and backward on the model's device, AdamW on CPU master copies (what
    the streaming trainer does on a GPU), so that the two differ only where their GPU kernels do.
    """
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)  # deferred until CUDA is initialised; nothing without it
    model.train()
    params = list(model.parameters())
    masters = [p.detach().cpu().clone().requires_grad_() for p in params] if update_on_cpu else params
    opt = torch.optim.AdamW(masters, lr=lr, weight_decay=weight_decay, foreach=True)
    for x, y in data:
        opt.zero_grad()
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        if update_on_cpu:
            for m, p in zip(masters, params):
                m.grad = None if p.grad is None else p.grad.cpu()
        opt.step()
        if update_on_cpu:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
    return model


def assert_same_gpt_parameters(a: dict, b: dict) -> None:
    """Parameters of a data-parallel run against one process on the same global batch.

    Two ranks sum the gradient in two halves, one process in one reduction: float32 rounding
    differs at ~1e-7 relative. AdamW normalises each step to about lr (1e-2), so a small
    gradient's rounding moves its parameter by up to ~1e-4 * lr: tolerance atol 1e-3 * lr. The
    attention's key bias is left out: its exact gradient is zero (softmax ignores a per-query
    constant), so its float32 gradient is rounding noise that AdamW scales up to steps of lr.
    """
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if name.endswith("attn.qkv.bias"):
            d = x.numel() // 3
            x, y = torch.cat([x[:d], x[2 * d:]]), torch.cat([y[:d], y[2 * d:]])
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


class RootLayer(nn.Module):
    """A block that takes a root parameter as a second positional input."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x, gate):
        return x + torch.tanh(self.fc(x)) * gate


class RootLayers(nn.ModuleList):
    """A top-level container that owns a parameter directly (outside its items)."""

    def __init__(self, width: int, depth: int):
        super().__init__(RootLayer(width) for _ in range(depth))
        self.bias = nn.Parameter(torch.zeros(width))


class RootModel(nn.Module):
    """Parameters on the root (a positional term, a scalar gate), on a container, and in blocks;
    dropout in the root's own code."""

    def __init__(self, d_in: int = 12, width: int = 16, depth: int = 3, n_classes: int = 5):
        super().__init__()
        self.proj = nn.Linear(d_in, width)
        self.pos = nn.Parameter(0.1 * torch.randn(width))
        self.gate = nn.Parameter(torch.ones(()))
        self.drop = nn.Dropout(0.1)
        self.layers = RootLayers(width, depth)
        self.head = nn.Linear(width, n_classes)

    def forward(self, x):
        x = self.drop(self.proj(x) + self.pos)
        for layer in self.layers:
            x = layer(x, self.gate)      # the root parameter passed into a block
        return self.head(x + self.layers.bias) * self.gate


def make_root(seed: int = 0, **kw) -> RootModel:
    torch.manual_seed(seed)
    return RootModel(**kw)


class Scaled(nn.Module):
    """Each layer is called on a tensor the model's own code makes from the previous output, and
    with a mask (a keyword argument) built in the forward."""

    def __init__(self, width: int = 64, depth: int = 3, own_code: bool = True):
        super().__init__()
        self.own_code = own_code
        self.proj = nn.Linear(12, width)
        self.layers = nn.ModuleList(Gated(width) for _ in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        h = self.proj(x)
        gate = (x[:, :1] > 0).float() if self.own_code else None  # (batch, 1), made here
        for layer in self.layers:
            h = layer(h * 2.0 if self.own_code else h, gate=gate)
        return self.head(h)


class Gated(nn.Linear):
    def __init__(self, width: int):
        super().__init__(width, width)

    def forward(self, x, gate=None):
        y = super().forward(x)
        return y if gate is None else y * (1.0 + gate)


def saved_by_forward(block: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the storages a real forward of ``block`` on ``x``'s device keeps for backward, its
    parameters and its input excluded (what the trainer's ledger charges to a kept block)."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    excluded = {p.untyped_storage().data_ptr() for p in block.parameters()} | {x.untyped_storage().data_ptr()}
    del out
    return sum(n for ptr, n in storages.items() if ptr not in excluded)


class Recurrent(nn.Module):
    """A projection, one recurrent layer (LSTM, GRU or RNN) in a block that returns its output
    sequence, and a head on the last step."""

    def __init__(self, kind: str = "lstm", width: int = 16, n_classes: int = 5):
        super().__init__()
        self.proj = nn.Linear(4, width)
        self.layers = nn.ModuleList([_Sequence(kind, width)])
        self.head = nn.Linear(width, n_classes)

    def forward(self, x):  # (batch, steps, 4)
        return self.head(self.layers[0](self.proj(x))[:, -1])


class _Sequence(nn.Module):
    def __init__(self, kind: str, width: int):
        super().__init__()
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind](width, width, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]
