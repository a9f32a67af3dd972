"""What a device does with a bundle, as one torch-free script: load, adapt, save, reload,
export-inference. Run by the install tests in a fresh device install (stock onnxruntime from the
registry) and under emulated aarch64 / Python 3.13, and on this checkout for the reference.

    python device_roundtrip.py BUNDLE DATA.npz OUT_DIR EPOCHS BATCH

DATA.npz holds ``X`` (float32) and ``y``. Writes OUT_DIR/adapted (the saved bundle),
OUT_DIR/model.onnx (export-inference) and OUT_DIR/parameters.npz (every parameter after adapt,
by torch name); prints one JSON line: the platform, the versions, the losses, and whether torch or
onnxruntime.training was imported. Any disagreement inside the run (reload, exported model) exits
non-zero with an assertion message.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import numpy as np


def main(bundle: str, data: str, out: str, epochs: str, batch: str) -> None:
    from edgeadapt.runtime import Runner
    from edgeadapt.runtime.ort_import import import_onnxruntime

    ort = import_onnxruntime()  # the runtime's torch-free way (torch may be installed on the reference host)

    out_dir = Path(out)
    with np.load(data, allow_pickle=False) as d:
        X, y = d["X"], d["y"]
    runner = Runner.load(bundle, device="cpu", threads=1, backend="portable")
    before = runner.parameters()
    result = runner.adapt(X, y, epochs=int(epochs), batch_size=int(batch), seed=0, progress=False)
    after = runner.parameters()
    assert any(not np.array_equal(before[k], after[k]) for k in after), "adapt changed no parameter"

    adapted = runner.save(out_dir / "adapted")
    reloaded = Runner.load(adapted, device="cpu", threads=1, backend="auto")
    again = reloaded.parameters()
    for k, v in after.items():
        assert np.array_equal(again[k], v), f"{k} differs after save and reload"
    assert reloaded.step == runner.step, (reloaded.step, runner.step)

    model = reloaded.export_inference(out_dir / "model.onnx")
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    exported = session.run(None, {session.get_inputs()[0].name: X})[0]
    predicted = reloaded.predict(X)
    # The same graphs' arithmetic on the same kernels; rtol/atol allow only reassociation inside
    # one fused kernel (a few float32 ulp of the logits' magnitude).
    np.testing.assert_allclose(exported, predicted, rtol=1e-5, atol=1e-6 * float(np.abs(predicted).max()))

    # Label-free adaptation of the source model on the same windows (labels unused): the
    # prototype head and the cross-fitted gate (the bundle keeps frozen statistics).
    label_free = Runner.load(bundle, device="cpu", threads=1, backend="portable").adapt_unlabeled(X)

    np.savez(out_dir / "parameters.npz", **after)
    print(json.dumps({
        "label_free": {"kept": label_free.kept, "stages": list(label_free.stages),
                       "gate_windows": label_free.n_gate_windows, "adapt_windows": label_free.n_adapt_windows,
                       "gate": None if label_free.gate is None else label_free.gate.kept},
        "machine": platform.machine(), "python": platform.python_version(), "onnxruntime": ort.__version__,
        "backend": "portable", "steps": int(runner.step), "epoch_losses": [float(v) for v in result.epoch_losses],
        "accuracy": float(reloaded.evaluate(X, y).accuracy),
        "torch_imported": "torch" in sys.modules, "ort_training_imported": "onnxruntime.training" in sys.modules,
    }))


if __name__ == "__main__":
    main(*sys.argv[1:])
