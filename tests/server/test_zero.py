"""ZeRO-1: each rank keeps the optimizer state of its own blocks (``shard_optimizer_state=True``).

Ranks are separate processes on gloo (``RANK``/``WORLD_SIZE``/``MASTER_PORT`` set directly, as
torchrun would), so a test can kill one rank and stop the other.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from server_helpers import assert_same_gpt_parameters, batches, make_mlp, reference_train

from edgeadapt.server import CheckpointMismatch, Trainer
from edgeadapt.server.store import DiskStore, HostStore
from edgeadapt.server.zero import assign_blocks

REPO = Path(__file__).resolve().parents[2]

# One data-parallel run per trainer configuration in args["shard"]: every rank trains the same
# seeded tiny GPT on its shard of each global batch; each rank saves its final weights and what
# it holds. With args["ckpt"] it checkpoints after every step (and rank 1 can die while writing).
WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from edgeadapt.models import build_gpt, token_cross_entropy
    from edgeadapt.optimizer_config import OptimizerConfig
    from edgeadapt.server import Trainer
    from edgeadapt.server.data import TokenStream
    from edgeadapt.server.distributed import init_from_env, shutdown

    a = json.loads(sys.argv[1])
    ctx = init_from_env("cpu")
    group = dist.group.WORLD if ctx.is_distributed else None
    data = TokenStream(61, 12, global_batch_size=8, seed=5, rank=ctx.rank, world_size=ctx.world_size)

    def make():
        torch.manual_seed(0)
        return build_gpt("gpt-nano", vocab_size=61, context_len=12, d_model=32, n_layers=2, n_heads=2,
                         dropout_p=a.get("dropout", 0.0))

    for shard in a["shard"]:
        tag = f"{a['out']}.{'zero' if shard else 'plain'}.rank{ctx.rank}"
        kw = dict(loss=token_cross_entropy, optimizer=OptimizerConfig("adamw", lr=1e-2, weight_decay=0.01),
                  memory_budget="2MiB", offload=a["offload"], offload_dir=tag + ".state", recompute="auto",
                  device="cpu", process_group=group, example_input=data.batch(0)[0], shard_optimizer_state=shard)
        ckpt = a.get("ckpt")
        if a.get("resume"):
            t = Trainer.resume(ckpt, make(), **kw)
        else:
            torch.manual_seed(100 + ctx.rank)       # each rank's own random stream (dropout)
            t = Trainer(make(), **kw)
        for step in range(t.step_count, a["steps"]):
            t.step(*data.batch(step))
            if ckpt:
                if a.get("crash_at") == step + 1 and ctx.rank == 1:
                    import torch.distributed.checkpoint as dcp
                    real, calls = dcp.save, []
                    def dying_save(*args, **kwargs):  # dies after writing its first two blocks
                        calls.append(1)
                        if len(calls) == 3:
                            os._exit(9)
                        return real(*args, **kwargs)
                    dcp.save = dying_save
                t.save_checkpoint(ckpt, extra={"data_position": step + 1})
        info = {"optimizer_state_bytes": t.optimizer_state_bytes, "tracked_peak_bytes": t.tracked_peak_bytes,
                "budget_bytes": t.budget_bytes, "tier_bytes": t.residency()["tiers"][a["offload"]],
                "owned": sorted(t.sharding.owned) if t.sharding else None,
                "owners": t.sharding.owners if t.sharding else None,
                "state_files": sorted(os.listdir(tag + ".state")) if a["offload"] == "disk" else None,
                "step": t.step_count}
        torch.save(t.model().state_dict(), tag + ".pt")
        with open(tag + ".json", "w") as f:
            json.dump(info, f)
        t.close()
    shutdown(ctx)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, n_proc: int, args: dict, timeout_s: float = 300) -> list[int]:
    """Start ``n_proc`` ranks of WORKER; when one fails, stop the others. Returns exit codes."""
    script = tmp_path / "zero_worker.py"
    script.write_text(WORKER)
    port = _free_port()
    procs = []
    for rank in range(n_proc):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        if n_proc > 1:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n_proc), RANK=str(rank),
                       LOCAL_RANK=str(rank))
        else:
            env.pop("WORLD_SIZE", None)
        procs.append(subprocess.Popen([sys.executable, str(script), json.dumps(args)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in procs:            # a rank died: the others wait in a collective forever
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.1)
    codes = [p.wait() for p in procs]
    logs = [p.stdout.read() for p in procs]
    _launch.logs = logs
    return codes


def _ok(codes: list[int]) -> None:
    assert codes == [0] * len(codes), "\n".join(log[-3000:] for log in _launch.logs)


def _result(tmp_path: Path, name: str, kind: str, rank: int) -> tuple[dict, dict]:
    tag = tmp_path / f"{name}.{kind}.rank{rank}"
    return (torch.load(f"{tag}.pt", weights_only=True), json.loads(Path(f"{tag}.json").read_text()))


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ---- one process ------------------------------------------------------------------------
def test_blocks_are_assigned_largest_first_to_the_least_loaded_rank():
    assert assign_blocks([10, 40, 30, 20], 2) == [0, 0, 1, 1]          # 40+10 | 30+20
    assert assign_blocks([5, 5, 5, 5], 2) == [0, 1, 0, 1]              # ties: lower index, lower rank
    assert assign_blocks([7, 1, 1], 1) == [0, 0, 0]
    assert assign_blocks([1, 2, 3], 5) == [2, 1, 0]                     # more ranks than blocks: some own none
    sizes = [17, 3, 99, 42, 42, 8, 60, 1]
    owners = assign_blocks(sizes, 3)
    assert owners == assign_blocks(sizes, 3)                            # deterministic
    load = [sum(s for s, r in zip(sizes, owners) if r == k) for k in range(3)]
    assert max(load) - min(load) <= max(sizes)
    with pytest.raises(ValueError, match="world_size"):
        assign_blocks(sizes, 0)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_store_holds_optimizer_state_only_for_its_blocks(tmp_path, tier):
    kinds = ("param", "exp_avg", "exp_avg_sq")
    store = (HostStore([10, 20, 30], kinds, state_blocks={1}) if tier == "host"
             else DiskStore([10, 20, 30], kinds, tmp_path, state_blocks={1}))
    for b in range(3):
        for k in kinds:
            if store.holds(b, k):
                store.write(b, k, torch.zeros(store.numels[b]))
    assert store.optimizer_state_bytes == 2 * 4 * 20
    assert store.total_bytes == 4 * 60 + 2 * 4 * 20
    assert not store.holds(0, "exp_avg") and store.holds(0, "param") and store.holds(1, "exp_avg_sq")
    if tier == "disk":
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "00000.param.f32", "00001.exp_avg.f32", "00001.exp_avg_sq.f32", "00001.param.f32", "00002.param.f32"]
    store.close()


def test_sharding_needs_the_streaming_trainer():
    with pytest.raises(ValueError, match="offload='host' or 'disk'"):
        Trainer(make_mlp(), offload=None, device="cpu", shard_optimizer_state=True)


@pytest.mark.parametrize("offload", ["host", "disk"])
def test_one_process_with_sharding_trains_and_checkpoints_like_plain_torch(tmp_path, monkeypatch, adamw, offload):
    """World size 1: the rank owns every block; a checkpoint (DCP) whose write fails half-way
    leaves the previous one, and resuming it ends bit-identical to plain AdamW(foreach=True)."""
    import torch.distributed.checkpoint as dcp

    n = 5
    data = batches("mlp", n)
    kw = dict(optimizer=adamw, memory_budget="1MiB", offload=offload, device="cpu", recompute=True,
              example_input=data[0][0], shard_optimizer_state=True)
    model = make_mlp()
    full = sum(4 * p.numel() for p in model.parameters()) * 2       # exp_avg and exp_avg_sq
    torch.manual_seed(123)
    t = Trainer(model, offload_dir=tmp_path / "s1", **kw)
    assert t.shards_optimizer_state and t.sharding.owned == frozenset(range(len(t.blocks)))
    assert t.optimizer_state_bytes == full == t.residency()["optimizer_state_bytes"]
    for i in range(3):
        t.step(*data[i])
        t.save_checkpoint(tmp_path / "ckpt", extra={"data_position": i + 1})
    t.step(*data[3])
    real, calls = dcp.save, []

    def failing_save(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("simulated crash")
        return real(*a, **k)

    monkeypatch.setattr(dcp, "save", failing_save)
    with pytest.raises(OSError, match="simulated"):
        t.save_checkpoint(tmp_path / "ckpt", extra={"data_position": 4})
    monkeypatch.setattr(dcp, "save", real)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest.json", "step-00000002", "step-00000003"]
    layout = tmp_path / "ckpt" / "step-00000003"
    assert json.loads((layout / "meta.json").read_text())["zero1"] == {"world_size": 1, "owners": [0] * len(t.blocks)}
    assert (layout / "blocks" / "00000" / ".metadata").is_file() and (layout / "ranks" / ".metadata").is_file()
    with pytest.raises(ValueError, match="save_checkpoint"):
        t.state_dict()
    t.close()
    torch.manual_seed(999)  # the checkpoint restores the generator
    r = Trainer.resume(tmp_path / "ckpt", make_mlp(seed=3), offload_dir=tmp_path / "s2", **kw)
    for i in range(r.checkpoint_extra["data_position"], n):
        r.step(*data[i])
    _assert_equal(r.model().state_dict(), reference_train(make_mlp(), data).state_dict())
    assert r.tracked_peak_bytes <= r.budget_bytes
    # a sharded checkpoint does not resume into a trainer that keeps all state, and says how
    with pytest.raises(CheckpointMismatch, match="shard_optimizer_state=True"):
        Trainer.resume(tmp_path / "ckpt", make_mlp(), offload_dir=tmp_path / "s3",
                       **{**kw, "shard_optimizer_state": False})
    r.close()


def test_an_unsharded_checkpoint_resumes_into_a_sharded_trainer(tmp_path, adamw):
    data = batches("mlp", 4)
    kw = dict(optimizer=adamw, offload="host", device="cpu", example_input=data[0][0])
    model = make_mlp()
    torch.manual_seed(123)
    t = Trainer(model, **kw)
    for i in range(2):
        t.step(*data[i])
    t.save_checkpoint(tmp_path, extra={"data_position": 2})
    r = Trainer.resume(tmp_path, make_mlp(), shard_optimizer_state=True, **kw)
    for i in range(2, 4):
        r.step(*data[i])
    _assert_equal(r.model().state_dict(), reference_train(make_mlp(), data).state_dict())


# ---- two ranks --------------------------------------------------------------------------
def test_two_ranks_sharded_equal_two_ranks_unsharded_bit_for_bit_and_hold_half_the_state(tmp_path):
    """Host tier, 2 gloo ranks, both modes in the same processes: the reduce onto the owner sums
    the same two halves as the all_reduce, so the weights are bit-identical; every rank ends with
    the same weights (the owners' broadcasts) and holds about half of the AdamW state."""
    _ok(_launch(tmp_path, 2, {"out": str(tmp_path / "r"), "offload": "host", "steps": 3, "shard": [False, True]}))
    plain0, plain_info = _result(tmp_path, "r", "plain", 0)
    zero = [_result(tmp_path, "r", "zero", r) for r in range(2)]
    _assert_equal(zero[0][0], plain0)
    _assert_equal(zero[1][0], plain0)
    full = plain_info["optimizer_state_bytes"]
    held = [info["optimizer_state_bytes"] for _, info in zero]
    print(f"optimizer state bytes: unsharded {full} per rank; sharded {held}")
    assert sum(held) == full
    assert max(held) <= full / 2 + max(4 * p.numel() for p in zero[0][0].values())   # within one block of half
    assert max(held) < 0.6 * full
    assert sorted(zero[0][1]["owned"] + zero[1][1]["owned"]) == list(range(len(zero[0][1]["owners"])))
    for _, info in zero:
        assert info["tier_bytes"] == plain_info["tier_bytes"] - full + info["optimizer_state_bytes"]
        assert info["tracked_peak_bytes"] <= info["budget_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["disk", "host"])
def test_two_sharded_ranks_equal_one_process_on_the_global_batch(tmp_path, offload):
    _ok(_launch(tmp_path, 2, {"out": str(tmp_path / "two"), "offload": offload, "steps": 3, "shard": [True]}))
    _ok(_launch(tmp_path, 1, {"out": str(tmp_path / "one"), "offload": offload, "steps": 3, "shard": [False]}))
    one, one_info = _result(tmp_path, "one", "plain", 0)
    two = [_result(tmp_path, "two", "zero", r) for r in range(2)]
    assert_same_gpt_parameters(two[0][0], one)
    _assert_equal(two[1][0], two[0][0])
    held = [info["optimizer_state_bytes"] for _, info in two]
    assert sum(held) == one_info["optimizer_state_bytes"] and max(held) < 0.6 * one_info["optimizer_state_bytes"]
    for _, info in two:
        assert info["tracked_peak_bytes"] <= info["budget_bytes"]
        if offload == "disk":      # the disk tier holds moment files of the owned blocks only
            moments = {int(f.split(".")[0]) for f in info["state_files"] if "exp_avg" in f}
            assert moments == set(info["owned"])


@pytest.mark.slow
def test_a_sharded_run_killed_mid_checkpoint_resumes_to_the_uninterrupted_end(tmp_path):
    """Dropout on, disk tier: rank 1 dies while writing the checkpoint of step 4 (after two
    blocks), rank 0 is stopped; the resumed run (step 3's checkpoint, each rank's own random
    stream and optimizer share) ends bit-identical to an uninterrupted sharded run."""
    base = {"offload": "disk", "steps": 6, "shard": [True], "dropout": 0.1}
    _ok(_launch(tmp_path, 2, {**base, "out": str(tmp_path / "straight")}))
    ckpt = tmp_path / "ckpt"
    codes = _launch(tmp_path, 2, {**base, "out": str(tmp_path / "crashed"), "ckpt": str(ckpt), "crash_at": 4})
    assert codes[1] == 9, _launch.logs[1][-3000:]
    assert json.loads((ckpt / "latest.json").read_text())["step"] == 3
    assert not (ckpt / "step-00000004").exists()
    step3 = ckpt / "step-00000003"
    assert {p.name for p in (step3 / "blocks" / "00001").iterdir()} >= {".metadata"}
    written = {p.name for b in (step3 / "blocks").iterdir() for p in b.iterdir() if p.suffix == ".distcp"}
    assert written == {"__0_0.distcp", "__1_0.distcp"}      # both ranks wrote their own blocks
    _ok(_launch(tmp_path, 2, {**base, "out": str(tmp_path / "resumed"), "ckpt": str(ckpt), "resume": True}))
    for r in range(2):
        want, _ = _result(tmp_path, "straight", "zero", r)
        got, info = _result(tmp_path, "resumed", "zero", r)
        assert info["step"] == 6
        _assert_equal(got, want)
    # another world size is refused, naming both
    from edgeadapt.models import build_gpt, token_cross_entropy
    from edgeadapt.server.data import TokenStream

    data = TokenStream(61, 12, 8, seed=5)
    with pytest.raises(CheckpointMismatch, match=r"written by 2 ranks .* this run has 1 rank"):
        Trainer.resume(ckpt, build_gpt("gpt-nano", vocab_size=61, context_len=12, d_model=32, n_layers=2,
                                       n_heads=2, dropout_p=0.1),
                       loss=token_cross_entropy, optimizer={"name": "adamw", "lr": 1e-2, "weight_decay": 0.01},
                       offload="host", device="cpu", example_input=data.batch(0)[0], shard_optimizer_state=True)


# ---- edgeadapt train --shard-optimizer-state ----------------------------------------------
TINY_GPT = ["--model", "gpt-nano", "--vocab-size", "64", "--context-len", "16", "--d-model", "32",
            "--n-layers", "2", "--batch-size", "4", "--lr", "1e-2", "--no-progress", "--memory-budget", "1MiB"]


def test_train_cli_with_sharded_state_in_one_process_reports_the_state_and_resumes(tmp_path, capsys):
    from edgeadapt.cli import main

    args = ["train", *TINY_GPT, "--offload", "host", "--shard-optimizer-state"]
    assert main([*args, "--steps", "2", "--checkpoint-dir", str(tmp_path / "run")]) == 0
    assert main([*args, "--steps", "3", "--resume", "--checkpoint-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-1" in out and "optimizer state" in out and "on rank 0 of 1" in out
    assert main(["train", *TINY_GPT, "--offload", "host", "--steps", "3",
                 "--checkpoint-dir", str(tmp_path / "plain")]) == 0
    a = torch.load(tmp_path / "run" / "weights.pt", weights_only=True)
    b = torch.load(tmp_path / "plain" / "weights.pt", weights_only=True)
    _assert_equal(a, b)
    assert main(["train", *TINY_GPT, "--offload", "none", "--shard-optimizer-state", "--steps", "1",
                 "--checkpoint-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err  # refused before anything is built or written
    assert "--shard-optimizer-state (ZeRO-1)" in err and "give --offload host or disk" in err
    assert not (tmp_path / "none").exists()


@pytest.mark.slow
def test_torchrun_sharded_run_resumed_equals_the_unsharded_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}

    def torchrun(run: str, *extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
               f"--master-port={_free_port()}", "-m", "edgeadapt", "train", *TINY_GPT, "--offload", "disk",
               "--checkpoint-dir", str(tmp_path / run), *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done

    first = torchrun("zero", "--steps", "2", "--shard-optimizer-state")
    assert "ZeRO-1" in first.stdout and "on rank 0 of 2" in first.stdout
    torchrun("zero", "--steps", "3", "--shard-optimizer-state", "--resume")
    torchrun("plain", "--steps", "3")
    _assert_equal(torch.load(tmp_path / "zero" / "weights.pt", weights_only=True),
                  torch.load(tmp_path / "plain" / "weights.pt", weights_only=True))
