"""Inner-step throughput and the cost of a DiLoCo outer step, relative to an inner step.

    python -m benchmarks.train_step [--preset small] [--steps 30] [--device auto]

Baseline: one inner AdamW step (forward, backward, update) of the preset, measured in this
run. Reported: tokens/s of inner steps, and the outer step (pseudo-gradient, Nesterov update,
copy back into the model) as a multiple of one inner step, which is what DiLoCo adds every H
steps before any network time, and that outer step's share of a 50-step round (on a GPU: the
share of a round the GPU idles, network aside). Writes benchmarks/results/train_step.json. On CUDA
(bf16 autocast) it is the GPU check: `--device cuda --preset small --preset medium`.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import time
from pathlib import Path

import torch

from optim import DiLoCo, DiLoCoConfig, LocalAverager
from optim.eager import AdamW
from optim.inner import inner_step
from workbench.run.data import ByteCorpus, DataConfig
from workbench.run.model import autocast_context, build_model, pick_device, preset

RESULTS = Path(__file__).parent / "results"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    preset_name: str, steps: int, device: torch.device, batch_size: int, profile: bool = False
) -> dict:
    config = preset(preset_name)
    corpus = ByteCorpus.load(DataConfig(max_bytes=2_000_000))
    model = build_model(config, seed=0).to(device)
    inner = AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    outer = DiLoCo(model, inner, LocalAverager(), DiLoCoConfig(inner_steps=10**9))
    batches = corpus.batches(block_size=config.block_size, batch_size=batch_size, seed=0)
    losses = []

    def step() -> None:
        x, y = next(batches)
        loss = inner_step(model, inner, x, y, device=device, autocast=lambda: autocast_context(device))
        losses.append(loss.detach())
        outer.note_inner_step(samples=batch_size)

    for _ in range(3):  # warm-up: allocator, kernels, AdamW state
        step()
    _sync(device)
    step_times = []
    for _ in range(steps):  # each timed: the median, as the outer step's (a mean of 30 over a
        start = time.perf_counter()  # median of 5 mixed the two statistics)
        step()
        _sync(device)
        step_times.append(time.perf_counter() - start)
    inner_seconds = statistics.median(step_times)

    outer.sync()  # warm-up: the first round allocates the pinned host buffers (once per run)
    _sync(device)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        outer.sync()
        _sync(device)
        times.append(time.perf_counter() - start)
    outer_seconds = statistics.median(times)
    repeats = len(times)
    if profile:
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [outer.sync() for _ in range(repeats)])
        print(f"--- {preset_name}: where {repeats} outer steps spend their time (cProfile, by own time)")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    values = [float(v) for v in losses]
    return {
        "preset": preset_name,
        "params": model.num_params(),
        "device": str(device),
        "batch_size": batch_size,
        "block_size": config.block_size,
        "inner_step_seconds": inner_seconds,
        "tokens_per_second": batch_size * config.block_size / inner_seconds,
        "outer_step_seconds": outer_seconds,
        "outer_step_vs_inner_step": outer_seconds / inner_seconds,
        # The outer step runs on the host (θ_global lives there in fp32): in a round of H = 50 it
        # is the time the accelerator idles, network time aside.
        "round_share_off_device_h50": outer_seconds / (50 * inner_seconds + outer_seconds),
        "loss_first": values[0],
        "loss_last": values[-1],
        "all_finite": all(v == v and abs(v) != float("inf") for v in values),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", action="append", help="model preset(s) (default: tiny and small)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=RESULTS / "train_step.json")
    parser.add_argument("--profile", action="store_true", help="print where the outer steps spend their time")
    args = parser.parse_args()
    device = pick_device(args.device)
    rows = [
        measure(name, args.steps, device, args.batch_size, args.profile)
        for name in args.preset or ["tiny", "small"]
    ]
    print(f"{'preset':>8} {'params':>10} {'device':>6} {'tokens/s':>10} {'outer/inner':>12} {'loss':>13}")
    for r in rows:
        print(
            f"{r['preset']:>8} {r['params']:>10,} {r['device']:>6} {r['tokens_per_second']:>10,.0f} "
            f"{r['outer_step_vs_inner_step']:>11.2f}x {r['loss_first']:>6.2f}->{r['loss_last']:<5.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "train_step",
        "machine": platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "date": time.strftime("%Y-%m-%d"),
        "results": rows,
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
