"""Compute utilization on a slow network: the share of wall time each peer spends computing.

    python -m benchmarks.utilization [--rate 100mbit] [--peers 4] [--quick]

Four real peers, each in its own network namespace behind a link capped with tc tbf
(workbench.local.netlab), train the default model (`small`) with each method; a peer's utilization is
the time in its inner steps (forward, backward, AdamW; data-parallel's gradient all-reduce
excluded) over its wall time from its first round's start to its last round's end (overlapped:
to the end of its last all-reduce). Baseline:
the same peers with the same settings on uncapped links, in this run. Needs root and iproute2;
elsewhere it writes the reason and exits 0. Writes benchmarks/results/utilization.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workbench.local import netlab

RESULTS = Path(__file__).parent / "results"

# method -> flags (defaults otherwise: matchmaking 2 s, codec none, direct data plane).
METHODS = {
    "dp": ["--method", "dp", "--rounds", "20"],
    # 5 rounds each, so that the final eval losses compare (the same steps, the same data).
    "diloco": ["--inner-steps", "50", "--rounds", "5"],
    # Each round's all-reduce runs while the next round trains; the wait for the last one counts.
    # (5 rounds: its first round has no mean to apply yet and its last one's all-reduce is waited
    # for at the end, so a short run understates the steady state.) Eager updates, the default.
    "diloco-overlap": ["--inner-steps", "50", "--rounds", "5", "--overlap"],
    "diloco-overlap-naive": ["--inner-steps", "50", "--rounds", "5", "--overlap", "--no-eager"],
    # --rounds counts full rounds of H steps (each of its F fragments synced once): 3 x 48 steps.
    "streaming": ["--method", "streaming", "--inner-steps", "48", "--fragments", "4", "--rounds", "3"],
}


def _events(path: Path, kind: str) -> list[dict]:
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")]
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def run_swarm(lab: netlab.NetLab, peers: int, flags: list[str], directory: Path, timeout: float) -> dict:
    common = [
        "--model", "small", "--batch-size", "16", "--threads", "1", "--run-id", "util",
        "--eval-every", "1000", *flags,
    ]  # fmt: skip
    processes = []

    def start(i: int, args: list[str]) -> subprocess.Popen:
        where = ["--host", lab.address(i), "--name", f"p{i}", "--run-dir", str(directory / f"p{i}")]
        argv = lab.command(i, [sys.executable, "-m", "workbench", *args, *common, *where])
        log = open(directory / f"p{i}.log", "wb")  # noqa: SIM115 - the child owns it
        return subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )

    try:  # every peer started is killed, whatever stops this (Ctrl+C, a peer that fails to start)
        processes.append(start(0, ["start", "--min-peers", str(peers)]))
        deadline = time.monotonic() + 120
        while not _events(directory / "p0" / "metrics.jsonl", "started"):
            if time.monotonic() > deadline or processes[0].poll() is not None:
                raise RuntimeError(
                    f"the first peer did not start:\n{(directory / 'p0.log').read_text()[-2000:]}"
                )
            time.sleep(0.2)
        address = _events(directory / "p0" / "metrics.jsonl", "started")[0]["addresses"][0]
        processes += [start(i, ["join", address, "--min-peers", str(peers)]) for i in range(1, peers)]
        for i, process in enumerate(processes):
            if process.wait(timeout=timeout) != 0:
                raise RuntimeError(f"peer {i} failed:\n{(directory / f'p{i}.log').read_text()[-2000:]}")
    finally:
        for process in processes:  # the peer and its p2p daemon: the namespace must empty
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    shares, comm, steady, timelines, losses = [], [], [], [], []
    for i in range(peers):
        rounds = _events(directory / f"p{i}" / "metrics.jsonl", "round")
        begin = rounds[0]["time"] - rounds[0]["round_seconds"]
        done = _events(directory / f"p{i}" / "metrics.jsonl", "done")
        if done and done[0].get("final_eval_loss") is not None:
            losses.append(done[0]["final_eval_loss"])
        # Overlapped, the last round's all-reduce ends after its round event: add that wait.
        wall = rounds[-1]["time"] - begin + (done[0].get("final_averaging_seconds", 0.0) if done else 0.0)
        shares.append(sum(r["compute_seconds"] for r in rounds) / wall)
        comm.append(sum(r["averaging_seconds"] for r in rounds) / wall)
        # Steady state: every round but the last (which also evaluates, and, overlapped, waits
        # for the run's last all-reduce), from the first round's start.
        if len(rounds) > 1:
            steady.append(sum(r["compute_seconds"] for r in rounds[:-1]) / (rounds[-2]["time"] - begin))
        timelines.append(
            [
                {k: round(r[k], 3) for k in ("round_seconds", "compute_seconds", "averaging_seconds")}
                for r in rounds
            ]
        )
    return dict(
        utilization=sum(shares) / len(shares),
        averaging_share=sum(comm) / len(comm),
        steady_utilization=sum(steady) / len(steady) if steady else None,
        per_peer=shares,
        rounds_per_peer=timelines,
        rounds=len(rounds),
        final_eval_loss=sum(losses) / len(losses) if losses else None,
        group_sizes=sorted({r["group_size"] for r in rounds}),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", default="100mbit", help="link cap, tc syntax (default: 100mbit)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument(
        "--method", action="append", choices=sorted(METHODS), help="default: dp, diloco, diloco-overlap"
    )
    parser.add_argument("--quick", action="store_true", help="2 peers, dp and diloco only")
    parser.add_argument("--out", type=Path, default=RESULTS / "utilization.json")
    args = parser.parse_args()
    peers = 2 if args.quick else args.peers
    # Streaming runs on request only (--method streaming): 4 fragment syncs per round make it the
    # longest here, and the overlapped variant the goal is about is diloco-overlap.
    methods = args.method or (["dp", "diloco"] if args.quick else ["dp", "diloco", "diloco-overlap"])
    result: dict = dict(benchmark="utilization", rate=args.rate, peers=peers, model="small")
    reason = netlab.unavailable()
    if reason and _has_rows(args.out):
        # A machine that cannot run it (not root) keeps the rows measured where it could.
        print(f"skipped: {reason}; {args.out} keeps its earlier rows")
        return
    if reason:
        print(f"skipped: {reason}")
        result["skipped"] = reason
    else:
        rows = []
        for method in methods:
            row = dict(method=method, date=time.strftime("%Y-%m-%d"))
            for label, rate in (("capped", args.rate), ("uncapped", None)):
                with tempfile.TemporaryDirectory() as tmp, netlab.NetLab(peers, rate=rate) as lab:
                    row[label] = run_swarm(lab, peers, METHODS[method], Path(tmp), timeout=900)
            row["ratio_to_uncapped"] = row["capped"]["utilization"] / row["uncapped"]["utilization"]
            loss = row["capped"]["final_eval_loss"]
            print(
                f"{method:<10} eval loss {loss if loss is None else round(loss, 4)}, "
                f"utilization {row['capped']['utilization']:6.1%} at {args.rate} "
                f"(uncapped {row['uncapped']['utilization']:6.1%}; averaging "
                f"{row['capped']['averaging_share']:6.1%} of wall time)",
                flush=True,
            )
            rows.append(row)
            result["rows"] = rows
            _write(args.out, result)  # after each method: a long run interrupted keeps what it measured
    _write(args.out, result)
    print(f"wrote {args.out}")


def _has_rows(path: Path) -> bool:
    try:
        return bool(json.loads(path.read_text()).get("rows"))
    except (OSError, ValueError, AttributeError):
        return False


def _write(path: Path, result: dict) -> None:
    """Write ``result``, keeping the rows of methods this run did not measure (each row says
    when it was measured), so that re-running one method does not drop the others."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and "rows" in result:
        try:
            earlier = json.loads(path.read_text()).get("rows", [])
        except ValueError:
            earlier = []
        fresh = {r["method"] for r in result["rows"]}
        kept = [r for r in earlier if r["method"] not in fresh and r.get("method") in METHODS]
        order = list(METHODS)
        result = {**result, "rows": sorted([*kept, *result["rows"]], key=lambda r: order.index(r["method"]))}
    path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
