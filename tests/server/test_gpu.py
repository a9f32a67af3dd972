"""The streaming trainer on a CUDA device: same result as plain CUDA training, GPU peak under the budget."""

from __future__ import annotations

import pytest
import torch
from server_helpers import batches, make_mlp, reference_train, saved_by_forward

from edgeadapt.models import build_gpt
from edgeadapt.server import Trainer, find_blocks
from edgeadapt.server import trace as trace_mod
from edgeadapt.server.progress import memory_fields

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of torch and a GPU")]


@pytest.mark.parametrize("offload,recompute", [("host", False), ("host", True), ("disk", "auto")])
def test_cuda_offload_matches_plain_cuda_training(offload, recompute, tmp_path):
    data = [(x.cuda(), y.cuda()) for x, y in batches("mlp", 4, batch=64)]
    ref = reference_train(make_mlp(width=256, depth=6).cuda(), data, update_on_cpu=True)
    model = make_mlp(width=256, depth=6)
    state = 16 * sum(p.numel() for p in model.parameters())
    budget = state // 2  # room for the whole batch: dropout draws the same masks as the reference's
    torch.manual_seed(123)
    torch.cuda.manual_seed_all(123)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t = Trainer(model, optimizer={"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}, memory_budget=budget,
                offload=offload, offload_dir=tmp_path, device="cuda", recompute=recompute,
                example_input=data[0][0])
    assert t.plan.micro_batch_windows == 64  # micro-batches would draw their own dropout masks
    for x, y in data:
        t.step(x, y)
    torch.cuda.synchronize()
    gpu_peak = torch.cuda.max_memory_allocated() - base
    assert t.tracked_peak_bytes <= budget
    # the inputs (held by the test) and CUDA's transient workspaces are not the trainer's: 25% slack
    assert gpu_peak <= 1.25 * budget + sum(x.numel() * 4 for x, _ in data)
    # the trainer's own figure: over what it held once loaded (the inputs were on the GPU before)
    assert t.gpu_peak_bytes is not None and 0 < t.gpu_peak_bytes <= gpu_peak
    assert memory_fields(t)["gpu allocated"].startswith("+")
    got, want = t.model().state_dict(), {k: v.cpu() for k, v in ref.state_dict().items()}
    for k in want:  # same GPU kernels and the same CPU AdamW: only float32 rounding of the kernels may differ
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)
    t.close()


def test_a_cuda_fake_trace_against_the_cuda_kernels():
    """Whether CUDA may join FAKE_TRACE_DEVICES: a fake trace on CUDA must count what the CUDA
    kernels save (the fused attention's output and log-sum-exp), never less; the meta trace (what
    CUDA plans use today) must count at least as much."""
    torch.manual_seed(0)
    model = build_gpt("gpt-nano", vocab_size=64, context_len=64, d_model=64, n_layers=2, n_heads=2).cuda()
    ids = torch.randint(0, 64, (3, 64), device="cuda")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    blocks = find_blocks(model)
    fake = trace_mod._trace_runs(model, blocks, (ids,), shapes, 3, "cuda")[0]
    meta = trace_mod._trace_runs(model, blocks, (ids,), shapes, 3, "meta")[0]
    i = next(k for k, b in enumerate(blocks) if b.name == "blocks.0")
    real = saved_by_forward(model.blocks[0], torch.randn(3, 64, 64, device="cuda", requires_grad=True))
    assert fake.saved_bytes[i] == real
    assert meta.saved_bytes[i] >= real
