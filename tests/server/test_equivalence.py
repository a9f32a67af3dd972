"""K offloaded steps == K steps of plain in-memory torch training (AdamW with weight decay).

The streaming executor runs the same kernels on the same values (block by block, the update
with torch's own foreach AdamW), so the tolerance is exact equality (bit-identical), for the
host and disk tiers, with and without recompute, with dropout drawing random numbers.
"""

from __future__ import annotations

import pytest
import torch
from server_helpers import batches, make_cnn, make_mlp, reference_train

from edgeadapt.server import Trainer
from edgeadapt.server.updater import BlockUpdater

MODELS = {"cnn": make_cnn, "mlp": make_mlp}


@pytest.mark.parametrize("kind", ["cnn", "mlp"])
@pytest.mark.parametrize("offload,recompute", [("host", False), ("host", True), ("disk", False), ("disk", True),
                                               (None, False), ("host", "auto")])
def test_offloaded_training_is_bit_identical_to_plain_torch(kind, offload, recompute, adamw, tmp_path):
    data = batches(kind, 4)
    ref = reference_train(MODELS[kind](), data)
    model = MODELS[kind]()
    torch.manual_seed(123)  # as reference_train: the dropout masks come from the same generator state
    t = Trainer(model, optimizer=adamw, memory_budget="4MiB", offload=offload,
                offload_dir=tmp_path / "state", device="cpu", recompute=recompute, example_input=data[0][0])
    losses = [t.step(x, y) for x, y in data]
    got = t.model().state_dict()
    want = ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs by {(got[k].float() - want[k].float()).abs().max()}"
    assert all(torch.isfinite(torch.tensor(losses)))
    assert t.step_count == len(data)
    t.close()


@pytest.mark.parametrize("offload", ["host", "disk"])
def test_tracked_peak_stays_under_the_budget_and_blocks_are_released(offload, adamw, tmp_path):
    model = make_mlp(width=64, depth=6)
    total_state = 4 * sum(p.numel() for p in model.parameters()) * 4  # weights, grads, 2 AdamW moments
    budget = total_state // 3
    data = batches("mlp", 3, batch=4)
    t = Trainer(model, optimizer=adamw, memory_budget=budget, offload=offload, offload_dir=tmp_path / "s",
                device="cpu", example_input=data[0][0])
    for x, y in data:
        t.step(x, y)
    assert 0 < t.tracked_peak_bytes <= budget
    r = t.residency()
    assert set(r["blocks"].values()) == {"offloaded"}
    assert r["tiers"][offload] >= 3 * 4 * sum(t.param_shapes[n][0]
                                              * (t.param_shapes[n][1] if len(t.param_shapes[n]) > 1 else 1)
                                              for n in t.param_shapes)
    # between steps only buffers are held in the compute tier
    assert r["tiers"]["compute"] == t.buffer_bytes
    t.close()


@pytest.mark.parametrize("chunks", ["staged", "pipelined"])
def test_disk_updates_in_small_chunks_change_no_bit(chunks, adamw, tmp_path, monkeypatch):
    """A CPU run updates one staged chunk at a time; a GPU run pipelines its chunks on the I/O
    threads (run here on the CPU): both give torch's bits."""
    if chunks == "pipelined":
        monkeypatch.setattr(BlockUpdater, "_staged_chunks", BlockUpdater._pipelined_chunks)
    data = batches("mlp", 3)
    ref = reference_train(make_mlp(), data)
    model = make_mlp()
    torch.manual_seed(123)
    t = Trainer(model, optimizer=adamw, offload="disk", offload_dir=tmp_path, device="cpu", update_chunk_numel=100,
                example_input=data[0][0])
    for x, y in data:
        t.step(x, y)
    got, want = t.model().state_dict(), ref.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    t.close()


class _Mix(torch.nn.Module):
    """A block with two positional tensor inputs and a tuple output."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x, mask):
        return torch.tanh(self.fc(x)) * mask, x


class _TokenModel(torch.nn.Module):
    """Integer tokens -> embedding block -> two-input block -> head (mean over positions)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 16)
        self.mix = _Mix()
        self.head = torch.nn.Linear(16, 3)

    def forward(self, tokens):
        h = self.emb(tokens)
        mask = (tokens > 3).float().unsqueeze(-1)
        a, skip = self.mix(h, mask)
        return self.head(a + skip).mean(dim=1)


@pytest.mark.parametrize("recompute", [False, True])
def test_integer_inputs_several_block_inputs_and_tuple_outputs(recompute, adamw):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 20, (4, 7), generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]

    def make():
        torch.manual_seed(0)
        return _TokenModel()

    ref = reference_train(make(), data)
    t = Trainer(make(), optimizer=adamw, offload="host", device="cpu", recompute=recompute)
    for x, y in data:
        t.step(x, y)
    got, want = t.model().state_dict(), ref.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("offload", ["host", "disk", None])
def test_predict_streams_the_current_weights_in_eval_mode(offload, adamw, tmp_path):
    data = batches("cnn", 2)
    t = Trainer(make_cnn(), optimizer=adamw, memory_budget="1MiB", offload=offload, offload_dir=tmp_path,
                device="cpu", example_input=data[0][0])
    t.step(*data[0])
    want = t.model().eval()(data[1][0])
    got = t.predict(data[1][0])
    assert torch.equal(got, want)
    assert t.tracked_peak_bytes <= 2**20
    t.step(*data[1])  # training continues after a prediction
    assert t.step_count == 2
