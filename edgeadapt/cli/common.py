"""Helpers the subcommands share: loading a model factory and a data file checked against a
bundle, printing text from elsewhere safely, and the argument groups of the device commands."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import zipfile
from pathlib import Path

import numpy as np

__all__ = ["load_factory", "load_data", "printable", "add_data", "add_backend", "add_device"]

log = logging.getLogger(__name__)


def load_factory(spec: str):
    if ":" not in spec:
        raise ValueError(f"model {spec!r} must be given as module:factory, e.g. mypkg.models:make_net")
    mod_name, attr = spec.split(":", 1)
    sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(mod_name)
    finally:
        sys.path.pop(0)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {mod_name!r} has no attribute {attr!r}") from None


def window_length(args: argparse.Namespace, manifest) -> int:
    """Samples per window for continuous data: the bundle's time steps, or ``--window-s`` times
    ``--sample-rate-hz`` (which must then agree with the bundle)."""
    steps = manifest.input.shape[-1]
    if args.window_s is None:
        if steps is None:
            raise ValueError("the bundle's input has a dynamic time axis; pass --window-s and --sample-rate-hz")
        return int(steps)
    if not args.sample_rate_hz:
        raise ValueError("--window-s needs --sample-rate-hz")
    n = round(args.window_s * args.sample_rate_hz)
    if steps is not None and n != steps:
        raise ValueError(f"--window-s {args.window_s} at --sample-rate-hz {args.sample_rate_hz} gives {n} samples per "
                         f"window, the bundle takes {steps}; omit --window-s to use the bundle's")
    return n


def load_data(args: argparse.Namespace, manifest, labels: bool = True, accuracy: bool = False):
    """(X, y) from an ``.npz``/``.csv`` in the edgeadapt.datasets formats, checked against the
    bundle before any session is opened. Continuous data (CSV, ``signal`` npz) are windowed to
    the bundle's window length. ``labels=False``: the file may hold none, and ``y`` is ``None``;
    ``accuracy``: a label-free bundle gets the file's class ids too (for the accuracy)."""
    from ..datasets import load_dataset
    from ..datasets.window_dataset import FORMAT_KEY
    from ..runtime.validate import check_class_ids, check_inputs, check_labels

    if args.sample_rate_hz is not None and not (args.sample_rate_hz > 0 and args.sample_rate_hz < float("inf")):
        raise ValueError(f"--sample-rate-hz must be a positive number, got {args.sample_rate_hz}")
    path = Path(args.data)
    kwargs = {"sample_rate_hz": args.sample_rate_hz} if args.sample_rate_hz else {}
    members, continuous = data_layout(path)
    if continuous:
        kwargs["window_length_samples"] = window_length(args, manifest)
    ds = load_dataset(path, require_labels=labels, **kwargs)
    if "X.npy" in members and f"{FORMAT_KEY}.npy" not in members:  # stored time-first, transposed on loading
        check_stored_windows(manifest, ds.X, path)
    X = check_inputs(manifest, ds.X, what=f"{path} (X)")
    if not labels:  # label-free: the file's labels, if any, are not read
        order = ds.recording_order()  # neighbours form the statistics' noise groups
        if np.all(order == np.arange(len(order))):
            return X, None  # already in recording order: no copy of the data
        log.info("%s: windows put in recording order (by recording, then start) for label-free adaptation", path)
        return X[order], None
    if accuracy and manifest.label is None:
        return X, check_class_ids(ds.y, len(X), manifest.output.shape[-1], what=f"{path} (y)")
    y = ds.y if labels and manifest.label is not None else None
    return X, check_labels(manifest, y, len(X), what=f"{path} (y)")


def data_layout(path: Path) -> tuple[list[str], bool]:
    """(the arrays an ``.npz`` holds, empty for other files; whether the file holds continuous
    recordings to cut into windows: a CSV or a ``signal`` npz)."""
    members = (zipfile.ZipFile(path).namelist() if path.suffix.lower() == ".npz" and path.is_file()
               and zipfile.is_zipfile(path) else [])
    return members, path.suffix.lower() == ".csv" or "signal.npy" in members


def check_stored_windows(manifest, X, path: Path) -> None:
    """Refuse windows of the wrong shape in the terms of the ``.npz`` file they came from: ``X``
    as loaded (windows, channels, time steps) was stored (windows, time steps, channels). The
    message names the bundle's shape, the stored one, and the transpose when that is the fix."""
    from ..runtime.errors import InputError
    from ..runtime.validate import describe_axes, fits_shape

    want = manifest.input.shape
    if len(want) != 3 or X.ndim != 3 or fits_shape(want[1:], X.shape[1:]):
        return  # fits (or not a 1-D signal bundle: check_inputs tells)
    channels, steps = want[1:]
    stored = [X.shape[0], X.shape[2], X.shape[1]]
    needed = [X.shape[0], "time steps" if steps is None else steps, "channels" if channels is None else channels]
    swapped = fits_shape(want[1:], stored[1:])
    fix = ("it looks channels-first: save it transposed, np.savez(..., X=X.transpose(0, 2, 1))" if swapped
           else "window and transpose the data to match")
    raise InputError(f"{path}: X has shape {stored}, but a .npz file stores windows as (windows, time steps, "
                     f"channels) and this bundle takes {describe_axes(want)}, so X must be stored as {needed}; {fix}")


def printable(text: str, keep: str = "") -> str:
    """``text`` with control and format characters (a terminal's escape sequences, say, from a
    bundle's manifest) written as Python escapes, except those in ``keep``."""
    return "".join(c if c.isprintable() or c in keep else c.encode("unicode_escape").decode("ascii") for c in text)


def add_data(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True,
                   help=".npz (X: windows x time x channels, y; optional subject) or .csv (continuous "
                        "samples, windowed to the bundle's window length); y / the label column may be "
                        "left out with --unlabeled; see edgeadapt.datasets")
    p.add_argument("--sample-rate-hz", type=float, default=None,
                   help="sampling rate, for files that do not store it (needed only with --window-s)")
    p.add_argument("--window-s", type=float, default=None,
                   help="window length in seconds for continuous data (default: the bundle's window length)")


def add_backend(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("auto", "portable", "ort-training"), default="auto",
                   help="training engine: auto (portable step graphs when the bundle holds them, else "
                        "onnxruntime-training; default), portable or ort-training")


def add_device(p: argparse.ArgumentParser) -> None:
    add_backend(p)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA if it can run the session, else CPU with a warning (default)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: ONNX Runtime's choice)")
