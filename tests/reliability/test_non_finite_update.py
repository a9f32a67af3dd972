"""No non-finite or unloadable value reaches a saved bundle: extreme inputs are refused before any
step (naming window and channel), an update that overflows is rolled back like a non-finite loss
(exit 3 on the command line, the last good state saved), and a state holding such values is never
saved."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from helpers import make_data

from edgeadapt.bundle import sha256_file
from edgeadapt.cli import main
from edgeadapt.runtime import InputError, NonFiniteStateError, NonFiniteUpdateError, Runner
from edgeadapt.runtime.finite import SQUARE_SAFE_LIMIT

CLI = ["--no-progress", "--device", "cpu", "--threads", "1"]


@pytest.fixture
def bundle(cnn_bundle, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(cnn_bundle, dst)
    return dst


def _files(bundle) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(bundle.iterdir()) if p.is_file()}


def _windows_npz(path, X_channels_first, y) -> None:
    np.savez(path, X=X_channels_first.transpose(0, 2, 1), y=y, subject=np.ones(len(y), np.int64))


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ---- extreme inputs: refused before any step, naming window and channel ----------------------------
@pytest.mark.parametrize("value", [3e38, -2e19, np.float32(SQUARE_SAFE_LIMIT) * 1.01])
def test_a_glitch_window_is_refused_before_training_naming_window_and_channel(bundle, tmp_path, capsys, value):
    X, y = make_data(np.random.default_rng(0), n=24)
    X[17, 2, 5] = value
    _windows_npz(tmp_path / "glitch.npz", X, y)
    before = _files(bundle)
    code = main(["adapt", str(bundle), "--data", str(tmp_path / "glitch.npz"), "--out", str(bundle),
                 "--epochs", "1", *CLI])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "window 17, channel 2" in err and "above 1.84e+19" in err, err
    assert _files(bundle) == before  # nothing written
    runner = Runner.load(bundle, device="cpu")
    with pytest.raises(InputError, match="window 17, channel 2"):
        runner.adapt(X, y, progress=False)
    with pytest.raises(InputError, match="window 17, channel 2"):
        runner.evaluate(X, y)
    assert runner.step == 0


def test_the_largest_accepted_input_is_the_square_safe_limit(bundle):
    X, y = make_data(np.random.default_rng(0), n=8)
    X[3, 1, 0] = np.float32(SQUARE_SAFE_LIMIT)  # rounds down to the float32 below sqrt(max)
    assert np.isfinite(np.float32(X[3, 1, 0]) ** 2)
    Runner.load(bundle, device="cpu").evaluate(X, y)  # accepted (the model may saturate on it)


# ---- an update that overflows: rolled back, saved state is the last good one --------------------
def test_an_overflowing_update_on_the_cli_rolls_back_saves_the_good_state_and_exits_3(bundle, tmp_path, capsys):
    X, y = make_data(np.random.default_rng(0), n=24)
    _windows_npz(tmp_path / "data.npz", X, y)
    data = ["--data", str(tmp_path / "data.npz")]
    assert main(["adapt", str(bundle), *data, "--out", str(bundle), "--epochs", "1", "--batch-size", "8", *CLI]) == 0
    good = Runner.load(bundle, device="cpu").parameters()
    capsys.readouterr()
    # the loss of every step is finite; the first update makes parameters ~1e30 (loading accepts <= 1e12)
    code = main(["adapt", str(bundle), *data, "--out", str(bundle), "--epochs", "2", "--batch-size", "8",
                 "--lr", "1e30", *CLI])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "the update of step 3" in err and "rolled back to step 3" in err
    runner = Runner.load(bundle, device="cpu")  # loads: no damaged checkpoint was written
    assert runner.step == 3 and _same(runner.parameters(), good)
    assert main(["evaluate", str(bundle), *data, "--device", "cpu"]) == 0


def _amplifier_bundle(out):
    """A frozen linear layer with large weights in front of the trained head: an input of 1e19
    (accepted) gives head gradients of ~7e19, whose squares overflow AdamW's second moment while
    every loss, parameter and first moment stays finite."""
    import torch
    from torch import nn

    from edgeadapt.export import Rule, UpdatePolicy, export_bundle

    class Amplifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.amp = nn.Linear(4 * 16, 8)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.amp(x.flatten(1)))

    torch.manual_seed(0)
    model = Amplifier().eval()
    with torch.no_grad():
        model.amp.weight.mul_(1e2)
    export_bundle(model, torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0)), out,
                  policy=UpdatePolicy(rules=(Rule("head", "full"),)))
    return out


def test_a_gradient_that_would_overflow_the_optimizer_state_is_not_applied(tmp_path):
    bundle = _amplifier_bundle(tmp_path / "amp")
    X, y = make_data(np.random.default_rng(0), n=16)
    glitch = X.copy()
    glitch[9] = 1e19
    runner = Runner.load(bundle, device="cpu", threads=1)
    before = runner.parameters()
    with pytest.raises(NonFiniteUpdateError, match=r"the gradient of head\.\w+ reached .*rolled back to step 0") as e:
        runner.adapt(glitch, y, epochs=1, batch_size=16, progress=False)
    assert np.isfinite(e.value.loss) and not e.value.applied
    assert runner.step == 0 and _same(runner.parameters(), before)
    # the optimizer state is untouched too: training goes on exactly as on a fresh runner
    twin = Runner.load(bundle, device="cpu", threads=1)
    runner.adapt(X, y, epochs=2, batch_size=8, progress=False)
    twin.adapt(X, y, epochs=2, batch_size=8, progress=False)
    assert _same(runner.parameters(), twin.parameters())
    runner.save(tmp_path / "saved")  # and it saves


# ---- a state holding such values is never saved ----------------------------------------------------
def test_a_state_left_non_finite_by_train_step_is_never_saved(bundle, tmp_path):
    X, y = make_data(np.random.default_rng(0), n=8)
    runner = Runner.load(bundle, device="cpu")
    with pytest.raises(NonFiniteUpdateError, match="the update was applied"):
        runner.train_step(X, y, lr=1e30)
    before = _files(bundle)
    with pytest.raises(NonFiniteStateError, match="refusing to save"):
        runner.save(tmp_path / "new")
    with pytest.raises(NonFiniteStateError, match="refusing to save"):
        runner.save()
    assert not (tmp_path / "new").exists() and _files(bundle) == before
    assert Runner.load(bundle, device="cpu").step == 0
