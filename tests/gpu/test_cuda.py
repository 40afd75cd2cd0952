"""What a peer does on CUDA, checked on a real GPU (skipped without one; CI has none).

The prepared device check (``benchmarks/gpu_check.sh``, docs/performance.md "GPU") runs these on a
lent GPU machine. Each test compares the CUDA path with the CPU's, which the rest of the suite
checks against hand-computed values: the pinned host buffers of the outer step, the copy of θ
back into the model, bf16 autocast, the swap of θ_global in for an evaluation, streaming
fragments, and a checkpoint written on the GPU and resumed from.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from optim.averager import LocalAverager
from optim.diloco import DiLoCo, DiLoCoConfig
from optim.eager import SGD, AdamW
from optim.inner import inner_step
from optim.state import inner_state_tensors
from optim.streaming import StreamingConfig, StreamingDiLoCo
from workbench.run import checkpoint
from workbench.run.model import autocast_context, build_model, pick_device, preset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_float32():
    """fp32 matrix products in full precision (no TF32), so CUDA and CPU agree to rounding."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def tiny_model(device: torch.device, seed: int = 0) -> torch.nn.Module:
    return build_model(preset("tiny"), seed=seed).to(device)


def token_batches(
    count: int, batch_size: int = 8, seed: int = 0, *, counting: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (x, y) byte batches from their own generator, y being x shifted by one: random
    bytes, or (``counting``) runs of consecutive bytes from random starts, which a model learns."""
    block = preset("tiny").block_size
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        if counting:
            starts = torch.randint(0, 256, (batch_size, 1), generator=g)
            seq = (starts + torch.arange(block + 1)) % 256
        else:
            seq = torch.randint(0, 256, (batch_size, block + 1), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def train_rounds(outer, model, inner, data, device, *, autocast: bool = False) -> list[float]:
    """Inner steps through ``outer.step`` (a round after every H-th); the losses."""
    losses = []
    for x, y in data:
        context = (lambda: autocast_context(device)) if autocast else contextlib.nullcontext
        loss = inner_step(model, inner, x, y, device=device, autocast=context)
        losses.append(float(loss.detach()))
        outer.step(samples=x.shape[0])
    return losses


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(
        float((x.detach().float().cpu() - y.detach().float().cpu()).abs().max())
        for x, y in zip(a, b, strict=True)
    )


def test_pick_device_finds_the_gpu_and_names_the_last_one() -> None:
    assert pick_device("cuda") == CUDA and pick_device("auto").type == "cuda"
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"use cuda:0 .. cuda:{count - 1}"):
        pick_device(f"cuda:{count}")


def test_the_pseudo_gradient_read_through_pinned_buffers_is_the_model_s_exactly() -> None:
    model = tiny_model(CUDA)
    outer = DiLoCo(model, SGD(model.parameters(), lr=0.1), LocalAverager(), DiLoCoConfig(inner_steps=10**9))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    deltas = outer.compute_pseudo_gradients()
    expected = [g - p.detach().cpu() for g, p in zip(outer.global_params, model.parameters())]
    assert all(torch.equal(d, e) for d, e in zip(deltas, expected))
    assert all(buffer.is_pinned() for buffer in outer._pinned)
    # Read again after more training: the buffers are reused, and hold the new values.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    again = outer.compute_pseudo_gradients()
    expected = [g - p.detach().cpu() for g, p in zip(outer.global_params, model.parameters())]
    assert all(torch.equal(d, e) for d, e in zip(again, expected))


def test_diloco_rounds_on_cuda_match_the_same_rounds_on_the_cpu() -> None:
    """Three rounds of H=4 SGD steps: θ_global on CUDA equals the CPU's to fp32 rounding, and
    after every round the CUDA model holds θ_global bit for bit (the pinned copy back)."""
    data = token_batches(12)
    results = []
    for device in (torch.device("cpu"), CUDA):
        model = tiny_model(device)
        inner = SGD(model.parameters(), lr=0.5)
        outer = DiLoCo(
            model, inner, LocalAverager(), DiLoCoConfig(inner_steps=4, outer_lr=0.7, outer_momentum=0.9)
        )
        for r in range(3):
            train_rounds(outer, model, inner, data[4 * r : 4 * r + 4], device)
            assert outer.outer_step_count == r + 1
            assert all(
                torch.equal(p.detach().cpu(), g) for p, g in zip(model.parameters(), outer.global_params)
            )
        results.append(outer.global_params)
    moved = max_difference(results[0], [g for g in tiny_model(torch.device("cpu")).parameters()])
    assert moved > 1e-2, "the rounds moved θ"
    assert max_difference(results[0], results[1]) < 1e-4 * max(1.0, moved)


def test_bf16_autocast_rounds_lower_the_loss_and_stay_finite() -> None:
    """The peer's CUDA recipe (bf16 autocast, AdamW, DiLoCo) on a batch it can learn."""
    model = tiny_model(CUDA)
    inner = AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    outer = DiLoCo(
        model, inner, LocalAverager(), DiLoCoConfig(inner_steps=10, outer_lr=0.7, outer_momentum=0.9)
    )
    losses = train_rounds(outer, model, inner, token_batches(40, counting=True), CUDA, autocast=True)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(torch.isfinite(g).all() for g in outer.global_params)


def test_with_global_on_a_bf16_cuda_model_puts_the_trained_params_back_and_adds_no_gpu_copy() -> None:
    model = tiny_model(CUDA).to(torch.bfloat16)
    outer = DiLoCo(model, SGD(model.parameters(), lr=0.1), LocalAverager(), DiLoCoConfig())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    trained = [p.detach().clone() for p in model.parameters()]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()

    def evaluate() -> tuple[list[torch.Tensor], int]:
        torch.cuda.synchronize()
        return [p.detach().cpu() for p in model.parameters()], torch.cuda.memory_allocated()

    seen, during = outer.with_global(evaluate)
    assert all(torch.equal(s, g.to(torch.bfloat16)) for s, g in zip(seen, outer.global_params))
    assert during == before, f"{during - before} bytes more on the GPU while θ_global is in"
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained))

    def fails() -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory in the evaluation")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        outer.with_global(fails)
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained))


def test_streaming_fragments_on_cuda_match_the_cpu() -> None:
    data = token_batches(12, seed=1)
    results = []
    for device in (torch.device("cpu"), CUDA):
        model = tiny_model(device)
        inner = SGD(model.parameters(), lr=0.5)
        config = StreamingConfig(
            outer=DiLoCoConfig(inner_steps=4, outer_lr=0.7, outer_momentum=0.9), fragments=2
        )
        outer = StreamingDiLoCo(model, inner, LocalAverager(), config)
        for x, y in data:
            inner_step(model, inner, x, y, device=device)
            outer.after_inner_step(samples=x.shape[0])
        results.append((outer.global_params, [p.detach().cpu() for p in model.parameters()]))
        evaluated = outer.with_global(
            lambda m=model: [p.detach().to("cpu", copy=True) for p in m.parameters()]
        )
        assert all(torch.equal(e, g) for e, g in zip(evaluated, outer.global_params))
    assert max_difference(results[0][0], results[1][0]) < 1e-4
    assert max_difference(results[0][1], results[1][1]) < 1e-4


def test_a_checkpoint_written_on_the_gpu_resumes_on_the_gpu_exactly(tmp_path) -> None:
    """Save mid-run (model, AdamW moments and the outer state come from CUDA tensors), load into
    a fresh CUDA peer: the same state, on the GPU; trained on, it follows the run that never
    stopped (to the rounding of CUDA's atomic adds in the embedding's backward)."""
    data = token_batches(16, seed=2)

    def peer():
        model = tiny_model(CUDA)
        inner = AdamW(model.parameters(), lr=1e-3)
        return model, inner, DiLoCo(model, inner, LocalAverager(), DiLoCoConfig(inner_steps=4))

    model, inner, outer = peer()
    train_rounds(outer, model, inner, data[:8], CUDA, autocast=True)
    checkpoint.save(tmp_path, checkpoint.training_state(outer, model, inner, None))
    saved = [g.clone() for g in outer.global_params]
    moments = [inner.state[p]["exp_avg"].clone() for p in model.parameters()]
    train_rounds(outer, model, inner, data[8:], CUDA, autocast=True)

    payload, _ = checkpoint.load(tmp_path)
    model2, inner2, outer2 = peer()
    checkpoint.restore_training(payload, outer2, model2, inner2, None)
    assert all(torch.equal(a, b) for a, b in zip(outer2.global_params, saved))
    assert all(torch.equal(inner2.state[p]["exp_avg"], m) for p, m in zip(model2.parameters(), moments))
    assert all(p.device.type == "cuda" for p in model2.parameters())
    train_rounds(outer2, model2, inner2, data[8:], CUDA, autocast=True)
    progress = max_difference(outer.global_params, saved)
    assert progress > 1e-3
    assert max_difference(outer2.global_params, outer.global_params) < 1e-2 * progress


def test_the_inner_state_snapshot_comes_to_the_host_and_stays_put() -> None:
    """What a joiner downloads of AdamW (the moments, twice the model): the values at the end of
    the round, on the host, untouched by the steps that follow."""
    model = tiny_model(CUDA)
    inner = AdamW(model.parameters(), lr=1e-3)
    data = token_batches(3, seed=3)
    for x, y in data[:2]:
        inner_step(model, inner, x, y, device=CUDA)
    keys, tensors = inner_state_tensors(inner)
    state = inner.state_dict()["state"]
    expected = [state[index][key] for index, key in keys]
    assert len(tensors) == len(expected) > 0
    assert all(t.device.type == "cpu" and torch.equal(t, e.cpu()) for t, e in zip(tensors, expected))
    kept = [t.clone() for t in tensors]
    inner_step(model, inner, *data[2], device=CUDA)
    assert all(torch.equal(t, k) for t, k in zip(tensors, kept))
