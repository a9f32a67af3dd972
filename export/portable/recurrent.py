"""ONNX's recurrent ops (``GRU``, ``LSTM``) as torch ops, for the portable interpreter.

The loop over time steps is Python: ``make_fx`` unrolls it, so the traced step graph holds one
copy of the cell per time step (the time axis is fixed by the example input; only the batch axis
is symbolic). The forms torch exports are covered: forward, reverse and bidirectional; biases and
initial states optional; GRU with ``linear_before_reset`` 0 or 1; LSTM with or without
peepholes. Other forms (``sequence_lens``, ``clip``, non-default activations, ``layout`` 1, LSTM
``input_forget``) raise ``ValueError``, which the interpreter reports as an unsupported form.

Gate layouts (ONNX operator docs): GRU's ``W``/``R`` rows are ``z, r, h``; LSTM's are
``i, o, f, c``; ``B`` is ``[Wb; Rb]`` per direction; LSTM's ``P`` is ``i, o, f``.
"""

from __future__ import annotations

import torch

__all__ = ["gru", "lstm", "RECURRENT_OPS"]

#: The recurrent ONNX ops the interpreter unrolls (a step graph holds one cell per time step).
RECURRENT_OPS = frozenset({"GRU", "LSTM"})

_DEFAULT_ACTIVATIONS = {"GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}


def _arg(args: list, i: int):
    return args[i] if len(args) > i else None


def _directions(op: str, args: list, attrs: dict, n_gates: int) -> tuple[list[bool], int]:
    """Check the form; the directions (reverse flag per direction) and the hidden size."""
    if _arg(args, 4) is not None:
        raise ValueError("sequence_lens is not supported (every sequence runs the full length)")
    if attrs.get("layout", 0) != 0:
        raise ValueError("layout 1 (batch first) is not supported")
    if attrs.get("clip") is not None:
        raise ValueError("clip is not supported")
    activations = [a.decode() if isinstance(a, bytes) else a for a in attrs.get("activations", [])]
    directions = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}
    direction = attrs.get("direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    if direction not in directions:
        raise ValueError(f"direction {direction!r}")
    if activations and activations != _DEFAULT_ACTIVATIONS[op] * len(directions[direction]):
        raise ValueError(f"activations {activations} (only the defaults {_DEFAULT_ACTIVATIONS[op]})")
    hidden = int(attrs["hidden_size"])
    if args[1].shape[1] != n_gates * hidden:
        raise ValueError(f"W has {args[1].shape[1]} rows, expected {n_gates} x hidden_size {hidden}")
    return directions[direction], hidden


def _biases(B, d: int, n_gates: int, hidden: int, like: torch.Tensor):
    if B is None:
        zero = like.new_zeros(n_gates * hidden)
        return zero, zero
    return B[d, :n_gates * hidden], B[d, n_gates * hidden:]


def _gates(x: torch.Tensor, n: int, hidden: int) -> list[torch.Tensor]:
    """The ``n`` gate blocks of the last axis, as slices (``split`` traces to SplitToSequence, a
    sequence op the portable graphs do not hold)."""
    return [x[..., k * hidden:(k + 1) * hidden] for k in range(n)]


def _steps(seq_len: int, reverse: bool):
    return range(seq_len - 1, -1, -1) if reverse else range(seq_len)


def gru(node, args, attrs):
    """``Y [seq, directions, batch, hidden]``, ``Y_h [directions, batch, hidden]``."""
    X, W, R, B = args[0], args[1], args[2], _arg(args, 3)
    h0 = _arg(args, 5)
    reverses, hidden = _directions("GRU", args, attrs, 3)
    before_reset = bool(attrs.get("linear_before_reset", 0))
    seq_len, batch = X.shape[0], X.shape[1]
    ys, finals = [], []
    for d, reverse in enumerate(reverses):
        wb, rb = _biases(B, d, 3, hidden, X)
        r_h = R[d, 2 * hidden:]
        xw = torch.matmul(X, W[d].t()) + wb  # every step's input projection at once: [seq, batch, 3h]
        h = h0[d] if h0 is not None else X.new_zeros(batch, hidden)
        out = [None] * seq_len
        for t in _steps(seq_len, reverse):
            xz, xr, xh = _gates(xw[t], 3, hidden)
            hz, hr, hh = _gates(torch.matmul(h, R[d].t()) + rb, 3, hidden)
            z = torch.sigmoid(xz + hz)
            r = torch.sigmoid(xr + hr)
            if before_reset:  # r gates (h R_h^T + Rb_h)
                candidate = torch.tanh(xh + r * hh)
            else:  # r gates h before R_h
                candidate = torch.tanh(xh + torch.matmul(r * h, r_h.t()) + rb[2 * hidden:])
            h = (1 - z) * candidate + z * h
            out[t] = h
        ys.append(torch.stack(out, 0))
        finals.append(h)
    return [torch.stack(ys, 1), torch.stack(finals, 0)]


def lstm(node, args, attrs):
    """``Y [seq, directions, batch, hidden]``, ``Y_h`` and ``Y_c [directions, batch, hidden]``."""
    X, W, R, B = args[0], args[1], args[2], _arg(args, 3)
    h0, c0, P = _arg(args, 5), _arg(args, 6), _arg(args, 7)
    if attrs.get("input_forget", 0):
        raise ValueError("input_forget (coupled input and forget gates) is not supported")
    reverses, hidden = _directions("LSTM", args, attrs, 4)
    seq_len, batch = X.shape[0], X.shape[1]
    ys, finals_h, finals_c = [], [], []
    for d, reverse in enumerate(reverses):
        wb, rb = _biases(B, d, 4, hidden, X)
        xw = torch.matmul(X, W[d].t()) + wb + rb  # [seq, batch, 4h]
        h = h0[d] if h0 is not None else X.new_zeros(batch, hidden)
        c = c0[d] if c0 is not None else X.new_zeros(batch, hidden)
        p_i, p_o, p_f = _gates(P[d], 3, hidden) if P is not None else (None, None, None)
        out = [None] * seq_len
        for t in _steps(seq_len, reverse):
            gi, go, gf, gc = _gates(xw[t] + torch.matmul(h, R[d].t()), 4, hidden)
            if p_i is not None:
                gi, gf = gi + p_i * c, gf + p_f * c
            i, f = torch.sigmoid(gi), torch.sigmoid(gf)
            c = f * c + i * torch.tanh(gc)
            o = torch.sigmoid(go + p_o * c if p_o is not None else go)
            h = o * torch.tanh(c)
            out[t] = h
        ys.append(torch.stack(out, 0))
        finals_h.append(h)
        finals_c.append(c)
    return [torch.stack(ys, 1), torch.stack(finals_h, 0), torch.stack(finals_c, 0)]
