"""Checkpoints: a run killed mid-checkpoint and resumed ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import REPO, run_python
from server_helpers import batches, make_mlp, reference_train

from edgeadapt.server import Trainer

N_STEPS = 6

# Trains N_STEPS steps on the disk tier, checkpointing after each step with the data position;
# with CRASH_AT set, the process dies (os._exit, no cleanup) in the middle of writing the
# checkpoint of that step, after two of its files.
SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from server_helpers import batches, make_mlp
from edgeadapt.server import Trainer

ckpt, state, crash_at, resume = {ckpt!r}, {state!r}, {crash_at!r}, {resume!r}
data = batches("mlp", {n})
kw = dict(optimizer={{"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}}, memory_budget="1MiB", offload="disk",
          offload_dir=state, device="cpu", recompute=True, example_input=data[0][0])
model = make_mlp()
if resume:
    t = Trainer.resume(ckpt, model, **kw)
else:
    torch.manual_seed(123)
    t = Trainer(model, **kw)
start = t.checkpoint_extra.get("data_position", 0)
assert start == t.step_count, (start, t.step_count)
real_save = torch.save
for i in range(start, {n}):
    t.step(*data[i])
    if crash_at is not None and i + 1 == crash_at:
        calls = []
        def dying_save(obj, f, *a, **k):
            calls.append(f)
            if len(calls) == 3:
                os._exit(9)
            return real_save(obj, f, *a, **k)
        torch.save = dying_save
    t.save_checkpoint(ckpt, extra={{"data_position": i + 1}})
torch.save(t.model().state_dict(), os.path.join(ckpt, "final.pt"))
print("done", t.step_count)
"""


def _run(tmp_path, *, crash_at=None, resume=False):
    code = SCRIPT.format(tests=str(REPO / "tests"), ckpt=str(tmp_path / "ckpt"), state=str(tmp_path / "state"),
                         crash_at=crash_at, resume=resume, n=N_STEPS)
    return run_python(code, timeout_s=600)


@pytest.mark.slow
def test_killed_mid_checkpoint_and_resumed_ends_where_an_uninterrupted_run_ends(tmp_path):
    crashed = _run(tmp_path, crash_at=4)
    assert crashed.returncode == 9, crashed.stderr
    pointer = json.loads((tmp_path / "ckpt" / "latest.json").read_text())
    assert pointer["step"] == 3  # the checkpoint of step 4 was never completed
    assert not (tmp_path / "ckpt" / "step-00000004").exists()
    resumed = _run(tmp_path, resume=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "done 6" in resumed.stdout
    got = torch.load(tmp_path / "ckpt" / "final.pt", weights_only=True)
    want = reference_train(make_mlp(), batches("mlp", N_STEPS)).state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_crash_while_writing_a_checkpoint_keeps_the_previous_one_and_resume_matches(tmp_path, monkeypatch, adamw):
    """The in-process version of the test above: the write fails half-way (simulated crash)."""
    data = batches("mlp", N_STEPS)
    kw = dict(optimizer=adamw, memory_budget="1MiB", offload="disk", device="cpu", recompute=True,
              example_input=data[0][0])
    model = make_mlp()
    torch.manual_seed(123)
    t = Trainer(model, offload_dir=tmp_path / "s1", **kw)
    for i in range(3):
        t.step(*data[i])
        t.save_checkpoint(tmp_path / "ckpt", extra={"data_position": i + 1})
    t.step(*data[3])
    real_save, calls = torch.save, []

    def failing_save(obj, f, *a, **k):
        calls.append(f)
        if len(calls) == 3:
            raise OSError("simulated crash")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="simulated"):
        t.save_checkpoint(tmp_path / "ckpt", extra={"data_position": 4})
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest.json", "step-00000002", "step-00000003"]
    t.close()
    torch.manual_seed(999)  # the checkpoint restores the generator
    r = Trainer.resume(tmp_path / "ckpt", make_mlp(seed=3), offload_dir=tmp_path / "s2", **kw)
    for i in range(r.checkpoint_extra["data_position"], N_STEPS):
        r.step(*data[i])
    got = r.model().state_dict()
    want = reference_train(make_mlp(), data).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("offload", [None, "host", "disk"])
def test_state_dict_round_trip_continues_bit_identically(offload, tmp_path, adamw):
    data = batches("cnn" if offload else "mlp", 4)
    from server_helpers import make_cnn

    make = make_cnn if offload else make_mlp
    torch.manual_seed(5)
    a = Trainer(make(), optimizer=adamw, offload=offload, offload_dir=tmp_path / "a", device="cpu")
    for x, y in data[:2]:
        a.step(x, y)
    sd = a.state_dict()
    b = Trainer(make(seed=7), optimizer=adamw, offload=offload, offload_dir=tmp_path / "b", device="cpu")
    b.load_state_dict(sd)
    assert b.step_count == 2
    for x, y in data[2:]:
        a.step(x, y)
    torch.set_rng_state(sd["rng"]["cpu"])
    for x, y in data[2:]:
        b.step(x, y)
    wa, wb = a.model().state_dict(), b.model().state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_checkpoints_keep_the_newest_and_load_with_weights_only(tmp_path, adamw):
    x, y = batches("mlp", 1)[0]
    t = Trainer(make_mlp(), optimizer=adamw, offload="host", device="cpu")
    for _ in range(3):
        t.step(x, y)
        t.save_checkpoint(tmp_path, extra={"data_position": t.step_count})
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000003"]
    for f in (tmp_path / "step-00000003").glob("*.pt"):
        torch.load(f, weights_only=True)
    r = Trainer.resume(tmp_path, make_mlp(), optimizer=adamw, offload=None, device="cpu")
    assert r.step_count == 3 and r.checkpoint_extra == {"data_position": 3}
    wa, wb = t.model().state_dict(), r.model().state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # a host-tier checkpoint resumes in memory too


def _saved_run(tmp_path, adamw):
    x, y = batches("mlp", 1)[0]
    t = Trainer(make_mlp(), optimizer=adamw, offload="host", device="cpu")
    t.step(x, y)
    t.save_checkpoint(tmp_path / "ckpt", extra={})
    t.step(x, y)
    return t


@pytest.mark.parametrize("failure", [
    RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0: "
                 "file write failed"),  # what torch.save says on a full disk
    OSError(28, "No space left on device"),
])
def test_a_full_disk_at_checkpoint_is_one_clear_error_and_keeps_the_previous(tmp_path, monkeypatch, adamw, failure):
    from edgeadapt.server.checkpoint import CheckpointWriteError

    t = _saved_run(tmp_path, adamw)

    def full(*a, **k):
        raise failure

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointWriteError, match=r"could not write the checkpoint of step 2 in .*ckpt \(.*\); the "
                                                   r"disk may be full"):
        t.save_checkpoint(tmp_path / "ckpt", extra={})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest.json", "step-00000001"]
    assert json.loads((tmp_path / "ckpt" / "latest.json").read_text())["step"] == 1


@pytest.mark.parametrize("damage", ["meta not utf-8", "meta not json", "latest not utf-8", "block truncated"])
def test_a_damaged_checkpoint_names_the_file(tmp_path, adamw, damage):
    from edgeadapt.server.checkpoint import CheckpointDamaged

    _saved_run(tmp_path, adamw)
    folder = tmp_path / "ckpt" / "step-00000001"
    target = {"meta not utf-8": folder / "meta.json", "meta not json": folder / "meta.json",
              "latest not utf-8": tmp_path / "ckpt" / "latest.json",
              "block truncated": folder / "block-00000.pt"}[damage]
    data = target.read_bytes()
    target.write_bytes({"meta not utf-8": b"\xff\xfe" + data, "meta not json": data[: len(data) // 2],
                        "latest not utf-8": b"\xff" + data, "block truncated": data[: len(data) // 2]}[damage])
    with pytest.raises(CheckpointDamaged, match=rf"{target.name} is damaged \(.*\); resume from another checkpoint"):
        Trainer.resume(tmp_path / "ckpt", make_mlp(), optimizer=adamw, offload=None, device="cpu")
