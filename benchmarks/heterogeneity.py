"""Peers of different speeds: fixed H against time-boxed rounds, on real peers.

    python -m benchmarks.heterogeneity [--peers 4] [--inner-steps 20] [--rounds 8]

Four real peers on 127.0.0.1 (separate processes, the direct data plane), two of them slowed to
half speed with the lab's throttle (a sleep per inner step as long as a measured step). First
``fixed``: every peer runs H inner steps per round for ``--rounds`` rounds; the fast peers wait
at the barrier for the slow ones. Then ``timeboxed``: ``--round-seconds T`` with T the fast
peers' time for H steps in the fixed run, for the same wall-clock budget (the peers are stopped
with Ctrl+C when the fixed run's time is up). Per mode: ``seconds`` (wall time from the first
round's start to the last round's end), ``final_eval_loss`` (the mean over peers of the eval
each made of the global params it ended on, or, for a peer that left no summary, of its last
evaluated round: with ``--eval-every`` above 1 a round event carries the last evaluation's
loss, not its own), ``fast_peer_utilization``
(the fast peers' inner-step time over their wall time), and for ``timeboxed`` also
``seconds_to_fixed_final_loss`` (when its eval loss first reached the fixed run's final one).
Writes benchmarks/results/heterogeneity.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _events(path: Path, kind: str) -> list[dict]:
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")]
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def measure_step_ms(model: str, batch_size: int) -> float:
    """One inner step of ``model`` on one thread, in this process (the throttle's length)."""
    import torch

    from workbench.config import RunConfig, TrainConfig
    from workbench.run.data import DataConfig
    from workbench.run.model import preset
    from workbench.run.training import build_training, train_step

    torch.set_num_threads(1)
    config = RunConfig(
        model=preset(model), data=DataConfig(batch_size=batch_size), train=TrainConfig(threads=1)
    )
    training = build_training(config)
    batches = training.corpus.batches(block_size=config.model.block_size, batch_size=batch_size, seed=0)
    for _ in range(3):
        train_step(
            training.model, training.inner_optimizer, *next(batches), training.device, 0.0, lambda: None
        )
    started = time.perf_counter()
    for _ in range(10):
        train_step(
            training.model, training.inner_optimizer, *next(batches), training.device, 0.0, lambda: None
        )
    return (time.perf_counter() - started) / 10 * 1000


def run_swarm(
    directory: Path, *, peers: int, slow: int, throttle_ms: float, flags: list[str], budget: float | None
) -> dict:
    """Start ``peers`` peers (the last ``slow`` throttled); wait for them to end, or stop them
    with Ctrl+C ``budget`` seconds after the first round began; the mode's figures."""
    from swarm.faults import FaultPlan

    fault = directory / "slow.json"
    FaultPlan(throttle_ms=throttle_ms).write(fault)
    processes: list[subprocess.Popen] = []

    def start(i: int, args: list[str]) -> subprocess.Popen:
        where = ["--name", f"p{i}", "--run-dir", str(directory / f"p{i}")]
        throttle = ["--fault-file", str(fault)] if i >= peers - slow else []
        log = open(directory / f"p{i}.log", "wb")  # noqa: SIM115 - the child owns it
        return subprocess.Popen(
            [sys.executable, "-m", "workbench", *args, *flags, *where, *throttle],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def metrics(i: int) -> Path:
        return directory / f"p{i}" / "metrics.jsonl"

    try:  # every peer started is killed, whatever stops this (Ctrl+C, a peer that fails to start)
        processes.append(start(0, ["start", "--min-peers", str(peers)]))
        deadline = time.monotonic() + 120
        while not _events(metrics(0), "started"):
            if time.monotonic() > deadline or processes[0].poll() is not None:
                raise RuntimeError(
                    f"the first peer did not start:\n{(directory / 'p0.log').read_text()[-2000:]}"
                )
            time.sleep(0.2)
        address = _events(metrics(0), "started")[0]["addresses"][0]
        processes += [start(i, ["join", address, "--min-peers", str(peers)]) for i in range(1, peers)]
        if budget is not None:
            deadline = time.monotonic() + 300
            while not _events(metrics(0), "round"):  # the budget counts from the first round
                if time.monotonic() > deadline or processes[0].poll() is not None:
                    raise RuntimeError(f"no first round:\n{(directory / 'p0.log').read_text()[-2000:]}")
                time.sleep(0.2)
            first = _events(metrics(0), "round")[0]
            begun = time.monotonic() - (time.time() - (first["time"] - first["round_seconds"]))
            time.sleep(max(0.0, begun + budget - time.monotonic()))
            for process in processes:
                process.send_signal(signal.SIGINT)
        for i, process in enumerate(processes):
            if process.wait(timeout=900) != 0:
                raise RuntimeError(f"peer {i} failed:\n{(directory / f'p{i}.log').read_text()[-2000:]}")
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    rounds = [_events(metrics(i), "round") for i in range(peers)]
    begin = min(r[0]["time"] - r[0]["round_seconds"] for r in rounds)
    end = max(r[-1]["time"] for r in rounds)
    fast = range(peers - slow)
    utilization = [
        sum(r["compute_seconds"] for r in rounds[i]) / (rounds[i][-1]["time"] - begin) for i in fast
    ]
    # The swarm's curve is peer 0's evaluations (rounds it evaluated in: --eval-every).
    curve = [(r["time"] - begin, r["eval_loss"]) for r in rounds[0] if r.get("evaluated", True)]

    def last_evaluated(events: list[dict]) -> float:
        return next(r["eval_loss"] for r in reversed(events) if r.get("evaluated", True))

    return dict(
        seconds=end - begin,
        # At the end every peer evaluates the global params it ends on (a run stopped with
        # Ctrl+C too); the last round's eval where a peer left no summary.
        final_eval_loss=statistics.mean(
            (_events(metrics(i), "done") or [{}])[0].get("final_eval_loss") or last_evaluated(rounds[i])
            for i in range(peers)
        ),
        fast_peer_utilization=statistics.mean(utilization),
        rounds=len(rounds[0]),
        steps_per_round={f"p{i}": [r["inner_steps"] for r in rounds[i]] for i in range(peers)},
        group_sizes=sorted({r["group_size"] for r in rounds[0]}),
        curve=[(round(t, 2), round(loss, 4)) for t, loss in curve],
        fast_compute_per_round=statistics.median(r["compute_seconds"] for i in fast for r in rounds[i][1:]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--slow", type=int, default=2, help="how many of them run at half speed (default 2)")
    parser.add_argument("--model", default="small")
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=8, help="the fixed run's rounds (default 8)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--peer-flags",
        default="",
        help="more flags for every peer of both modes, e.g. '--overlap --eval-every 2'",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "heterogeneity.json")
    args = parser.parse_args()
    step_ms = measure_step_ms(args.model, args.batch_size)
    common = [
        "--model", args.model, "--batch-size", str(args.batch_size), "--threads", "1",
        "--run-id", "hetero", "--matchmaking-time", "1.0", *shlex.split(args.peer_flags),
    ]  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        fixed_dir, boxed_dir = Path(tmp, "fixed"), Path(tmp, "timeboxed")
        fixed_dir.mkdir()
        boxed_dir.mkdir()
        fixed = run_swarm(
            fixed_dir,
            peers=args.peers,
            slow=args.slow,
            throttle_ms=step_ms,
            flags=[*common, "--inner-steps", str(args.inner_steps), "--rounds", str(args.rounds)],
            budget=None,
        )
        rows.append(dict(mode="fixed", **fixed))
        box = fixed["fast_compute_per_round"]  # the fast peers' time for H steps
        boxed = run_swarm(
            boxed_dir,
            peers=args.peers,
            slow=args.slow,
            throttle_ms=step_ms,
            # the cap well above H: the box decides; --rounds large: the budget ends the run
            flags=[*common, "--inner-steps", str(4 * args.inner_steps), "--round-seconds", f"{box:.3f}"],
            budget=fixed["seconds"],
        )
        reached = next((t for t, loss in boxed["curve"] if loss <= fixed["final_eval_loss"]), None)
        rows.append(
            dict(mode="timeboxed", round_seconds=round(box, 3), seconds_to_fixed_final_loss=reached, **boxed)
        )
    result = dict(
        benchmark="heterogeneity",
        date=time.strftime("%Y-%m-%d"),
        machine=f"{os.cpu_count()} CPUs",
        peers=args.peers,
        slow_peers=args.slow,
        model=args.model,
        inner_steps=args.inner_steps,
        step_ms=round(step_ms, 2),
        peer_flags=args.peer_flags,
        rows=rows,
    )
    for row in rows:
        print(
            f"{row['mode']:<10} {row['seconds']:6.1f} s, {row['rounds']} rounds, eval loss {row['final_eval_loss']:.4f}, "
            f"fast peers' utilization {row['fast_peer_utilization']:.0%}"
            + (
                f", reached fixed's final loss at {row['seconds_to_fixed_final_loss']} s"
                if row["mode"] == "timeboxed"
                else ""
            ),
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
