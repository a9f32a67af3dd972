"""Bad input to the server trainer fails early and clearly, naming the problem and the numbers."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest
import torch
from server_helpers import batches, make_mlp
from torch import nn

from edgeadapt.sched import BudgetExceeded
from edgeadapt.server import BlockError, CheckpointMismatch, OffloadDirError, Trainer


def test_budget_smaller_than_the_largest_block_names_block_bytes_and_budget():
    model = make_mlp(width=64, depth=2)
    head_bytes = 4 * (64 * 64 + 64)  # layers.i.fc: the largest block
    x = batches("mlp", 1)[0][0]
    with pytest.raises(BudgetExceeded) as e:
        Trainer(model, memory_budget=head_bytes, offload="host", device="cpu", example_input=x)
    msg = str(e.value)
    assert "'layers.0'" in msg and "needs" in msg and "budget" in msg
    assert e.value.block == "layers.0"
    # its gradients (host tier: it computes on the master weights in place) and the activations
    assert e.value.need_bytes > head_bytes and e.value.have_bytes == head_bytes
    t = Trainer(make_mlp(width=64, depth=2), memory_budget=e.value.need_bytes, offload="host", device="cpu",
                example_input=x)
    t.step(*batches("mlp", 1)[0])
    assert 0 < t.tracked_peak_bytes <= e.value.need_bytes
    t.close()


def test_batch_too_large_for_the_budget_is_refused_before_any_update(adamw):
    model = make_mlp(width=32, depth=2)
    small = batches("mlp", 1, batch=2)[0]
    t = Trainer(model, optimizer=adamw, memory_budget="64KiB", offload="host", device="cpu", example_input=small[0])
    t.step(*small)
    before = t.model().state_dict()
    big = batches("mlp", 1, batch=4096)[0]
    with pytest.raises(BudgetExceeded, match="budget"):
        t.step(*big)
    after = t.model().state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert t.step_count == 1


def test_disk_tier_on_a_path_that_cannot_be_a_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OffloadDirError, match="cannot be created"):
        Trainer(make_mlp(), offload="disk", offload_dir=blocker / "state", device="cpu")


def test_disk_tier_on_a_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if _writable(ro):
            pytest.skip("this user (root) can write into a read-only folder")
        with pytest.raises(OffloadDirError, match="not writable"):
            Trainer(make_mlp(), offload="disk", offload_dir=ro, device="cpu")
    finally:
        ro.chmod(0o700)


def _writable(path) -> bool:
    try:
        (path / "probe").write_bytes(b"")
        (path / "probe").unlink()
        return True
    except OSError:
        return False


def test_disk_tier_on_a_full_folder_fails_before_writing_and_names_the_sizes(tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1024, 1024))
    model = make_mlp()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OffloadDirError, match="only 1.00 KiB is free"):
        Trainer(model, offload="disk", offload_dir=tmp_path / "state", device="cpu")
    assert list((tmp_path / "state").glob("*.f32")) == []
    assert all(torch.equal(want[k], v) for k, v in model.state_dict().items())  # nothing lost


def test_checkpoint_of_another_model_or_config_is_refused_naming_the_difference(tmp_path, adamw):
    x, y = batches("mlp", 1)[0]
    t = Trainer(make_mlp(), optimizer=adamw, offload="host", device="cpu", example_input=x)
    t.step(x, y)
    t.save_checkpoint(tmp_path)
    with pytest.raises(CheckpointMismatch,
                       match=r"layers\.0\.fc\.weight: checkpoint \[32, 32\], this trainer \[48, 48\]"):
        Trainer.resume(tmp_path, make_mlp(width=48), optimizer=adamw, offload="host", device="cpu")
    with pytest.raises(CheckpointMismatch, match=r"optimizer\.lr: checkpoint 0\.01, this trainer 0\.5"):
        Trainer.resume(tmp_path, make_mlp(), optimizer={**adamw, "lr": 0.5}, offload="host", device="cpu")
    with pytest.raises(CheckpointMismatch, match="layers.4"):
        Trainer.resume(tmp_path, make_mlp(depth=5), optimizer=adamw, offload="host", device="cpu")


def test_no_checkpoint_to_resume(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Trainer.resume(tmp_path, make_mlp(), offload="host", device="cpu")


def test_cuda_without_cuda_raises_the_runners_error(monkeypatch):
    from edgeadapt.runtime.errors import DeviceUnavailableError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailableError, match="device='cpu'"):
        Trainer(make_mlp(), offload="host", device="cuda")


def test_models_the_streamer_cannot_cut_are_refused_with_the_fix():
    class RootTied(nn.Module):  # a root parameter that is also a block's weight
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.w = self.fc.weight

    with pytest.raises(BlockError, match="tied"):
        Trainer(RootTied(), offload="host", device="cpu")

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    with pytest.raises(BlockError, match="tied"):
        Trainer(Tied(), offload="host", device="cpu")

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(self.fc(x))

    with pytest.raises(BlockError, match="twice"):
        Trainer(Twice(), offload="host", device="cpu", example_input=torch.randn(2, 3))


def test_non_finite_loss_applies_no_update(adamw):
    x, y = batches("mlp", 1)[0]
    t = Trainer(make_mlp(), optimizer=adamw, offload="host", device="cpu", example_input=x)
    before = t.model().state_dict()
    with pytest.raises(FloatingPointError, match="no update"):
        t.step(torch.full_like(x, float("nan")), y)
    after = t.model().state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert set(t.residency()["blocks"].values()) == {"offloaded"}


def test_a_gradient_hidden_in_a_keyword_argument_is_refused():
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x, *, scale):
            return self.fc(x) * scale

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.gate = Gate()

        def forward(self, x):
            h = self.a(x)
            return self.gate(h, scale=h)

    x, y = torch.randn(4, 3), torch.randint(0, 3, (4,))
    t = Trainer(Model(), offload="host", device="cpu", example_input=x)
    with pytest.raises(TypeError, match="positionally"):
        t.step(x, y)
