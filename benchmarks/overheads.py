"""Overheads: heartbeats, joining with a state download, and the CLI's start-up.

    python -m benchmarks.overheads [--quick]

1. **Heartbeats** (what every inner step pays to be watched): inner steps of the default model
   (`small`) with the peer's per-step heartbeat (build the record; publish at most once a
   second, signed, to a real DHT) against the same steps without, in alternating blocks; and
   the cost of one heartbeat call against one inner step, both measured here.
2. **Joining**: a new peer starts its DHT, finds the run and downloads the global state of a
   25 M-parameter model (θ, outer momentum and AdamW's two moments: 400 MB) from real peers on
   loopback: from one donor over hivemind's stream, then over the direct transport
   (swarm.state_transfer) from one and from three donors. The donors share θ and momentum and
   each has its own moments, as peers of a run do. The donors declare their step 3 s before the
   joiner starts, as peers of a running swarm declared theirs a round ago: each takes its
   snapshot then (a copy of the state from its training process and a hash of every slice;
   ``swarm.state_sharing.READY_BYTES``). A second download right after the first, as a second
   joiner of that step would make, is ``second_download_seconds``. ``join`` holds the three-donor run (its
   fields, plus ``donors``), ``join.runs`` all three. Baseline: the same bytes over one plain
   TCP socket on loopback, in this run, into a reused buffer and into fresh memory; and the
   floor of any download here, ``tcp_state_seconds``: a state of that size held by another
   process, copied through one socket into fresh memory with nothing else
   (``ratio_to_state_copy``: that over the download).
3. **CLI start-up**: `workbench --help` against `python -c pass`, median of 5 runs each.

Writes benchmarks/results/overheads.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from swarm.download import Downloading

RESULTS = Path(__file__).parent / "results"


def heartbeats(blocks: int, steps: int) -> dict:
    import torch

    from optim.eager import AdamW
    from optim.inner import inner_step
    from swarm.dht import NetworkConfig
    from swarm.progress import ProgressBoard
    from swarm.records import PeerHeartbeat, RunKeys, Stage
    from swarm.session import connect
    from workbench.run.data import ByteCorpus, DataConfig
    from workbench.run.model import build_model, preset

    torch.set_num_threads(1)
    session = connect(NetworkConfig(), RunKeys("overheads"))
    board = ProgressBoard(session.store, RunKeys("overheads"))
    config = preset("small")
    model = build_model(config, seed=0)
    optimizer = AdamW(model.parameters(), lr=1e-3)
    batches = ByteCorpus.load(DataConfig(max_bytes=2_000_000)).batches(
        block_size=config.block_size, batch_size=16, seed=0
    )

    def beat(step: int, force: bool = False) -> None:
        board.publish(
            PeerHeartbeat(
                peer_id=session.peer_id, name="bench", stage=Stage.TRAINING, outer_step=0, inner_step=step,
                inner_steps=50, loss=1.0, samples_per_second=100.0, bytes_sent=0, bytes_received=0,
                device="cpu", time=time.time(),
            ),
            force=force,
        )  # fmt: skip

    def block(with_beats: bool) -> float:
        start = time.perf_counter()
        for step in range(steps):
            inner_step(model, optimizer, *next(batches))
            if with_beats:
                beat(step)
        return (time.perf_counter() - start) / steps

    block(False)  # warm-up
    on, off = [], []
    for _ in range(blocks):
        off.append(block(False))
        on.append(block(True))
    calls = 2000
    start = time.perf_counter()
    for step in range(calls):
        beat(step)
    per_call = (time.perf_counter() - start) / calls  # the board's rate limit: mostly no publish
    publishes = []
    for step in range(20):  # what a publish itself costs the training thread (at most one a period)
        start = time.perf_counter()
        beat(step, force=True)
        publishes.append(time.perf_counter() - start)
    publish = statistics.median(publishes)
    session.dht.shutdown()
    step_time = statistics.median(off)
    # A step pays the cheap call, and a publish once every period/step_time steps (each step when
    # steps are slower than the period): 2000 calls in a row held one publish, and their mean
    # alone (the share reported before stop 60) measured the rate limit, not the heartbeat.
    per_step = per_call + publish * min(1.0, step_time / board.period)
    return dict(
        step_seconds_off=step_time,
        step_seconds_on=statistics.median(on),
        ratio_on_off=statistics.median(on) / step_time,
        heartbeat_call_seconds=per_call,
        heartbeat_publish_seconds=publish,
        heartbeat_share_of_step=per_step / step_time,
        goal="<= 1% of step time",
    )


def donor_state(params: int, seed: int):
    """A donor's state: one θ tensor of ``params`` floats, its momentum and AdamW's two moments,
    keyed (param index, name) as a peer's are (the joiner refuses other keys)."""
    import torch

    from optim.diloco import OuterState

    shared = torch.Generator().manual_seed(0)  # θ and momentum: the swarm's consensus
    local = torch.Generator().manual_seed(seed)  # AdamW's moments: each donor's own
    return OuterState(
        outer_step=7,
        params=[torch.randn(params, generator=shared)],
        momentum=[torch.randn(params, generator=shared)],
        pending=[],
        inner=[torch.randn(params, generator=local), torch.rand(params, generator=local)],
        inner_keys=[[0, "exp_avg"], [0, "exp_avg_sq"]],
    )


def _serve_state(params: int, seed: int, plane: str, initial, addresses, ready, stop) -> None:
    mp.set_start_method("fork", force=True)  # spawned, this process would spawn the averager too
    import torch

    from swarm.dht import NetworkConfig
    from swarm.group_averager import GroupAverager
    from swarm.records import RunKeys
    from swarm.session import connect

    session = connect(NetworkConfig(initial_peers=initial), RunKeys("join-bench"))
    state = donor_state(params, seed)
    averager = GroupAverager(
        [torch.zeros(params)], session.dht, prefix="joinbench", state_provider=lambda: state,
        declare_state_period=1, data_plane=plane, start=True,
    )  # fmt: skip
    averager.state_sharing_priority = 7.0
    addresses.put([str(a) for a in session.dht.get_visible_maddrs()])
    ready.wait()
    stop.wait()
    averager.shutdown()
    session.dht.shutdown()


class _Joiner(Downloading):
    """The download a joining peer runs (direct transport, else hivemind's stream), without the
    rest of the peer: no heartbeat, no witnesses."""

    def __init__(self, averager) -> None:
        self.averager, self.on_download = averager, None

    def beat(self, stage) -> None:
        pass

    def _verifiers(self, distrusted: set[str]) -> list[str]:
        return []


def join(params: int, donors: int, plane: str = "direct") -> dict:
    """A joiner's download from ``donors`` donors (each a process with its own DHT and
    averager), over the direct transport or hivemind's stream (``plane``)."""
    import torch

    from swarm.dht import NetworkConfig
    from swarm.group_averager import GroupAverager
    from swarm.records import RunKeys
    from swarm.session import connect

    context = mp.get_context("spawn")  # a fork of this process after an earlier run would hang
    addresses, ready, stop = context.Queue(), context.Event(), context.Event()
    processes, initial = [], []
    for index in range(donors):
        process = context.Process(
            target=_serve_state, args=(params, 1 + index, plane, initial, addresses, ready, stop)
        )
        process.start()
        processes.append(process)
        found = addresses.get(timeout=120)
        initial = initial or found
    ready.set()
    time.sleep(3)  # the donors declare their state (every second)
    start = time.perf_counter()
    session = connect(NetworkConfig(initial_peers=initial), RunKeys("join-bench"))
    averager = GroupAverager(
        [torch.zeros(params)], session.dht, prefix="joinbench", state_provider=None,
        allow_state_sharing=False, data_plane=plane, start=True,
    )  # fmt: skip
    connected = time.perf_counter()
    state, *_ = _Joiner(averager)._fetch_state(set(), set(), time.monotonic() + 300) or (None,)
    done = time.perf_counter()
    if state is None:
        raise SystemExit(
            f"benchmarks.overheads: the joiner downloaded no state from {donors} donor(s) ({plane})"
        )
    tensors = [*state.params, *state.momentum, *state.inner]
    size = sum(t.numel() * t.element_size() for t in tensors)
    served_by = int(averager.download[2])
    del state, tensors
    again = time.perf_counter()  # a second joiner at the same step: the donors' snapshots are taken
    again_state, *_ = _Joiner(averager)._fetch_state(set(), set(), time.monotonic() + 300) or (None,)
    second = time.perf_counter() - again
    if again_state is None:  # (its time was written as a download's: a review, stop 72)
        raise SystemExit(
            f"benchmarks.overheads: the second joiner downloaded no state from {donors} donor(s)"
        )
    del again_state
    stop.set()
    averager.shutdown()
    session.dht.shutdown()
    for process in processes:
        process.join(timeout=30)
    baseline = _tcp_seconds(size)
    fresh = _tcp_seconds(size, into_fresh_memory=True)
    copy = _state_copy_seconds(size)
    download = done - connected
    return dict(
        params=params,
        state_mb=size / 1e6,
        join_seconds=done - start,
        connect_seconds=connected - start,
        download_seconds=download,
        download_mb_s=size / 1e6 / download,
        tcp_baseline_seconds=baseline,
        ratio_to_tcp=baseline / download,
        tcp_fresh_seconds=fresh,
        tcp_state_seconds=copy,
        ratio_to_state_copy=copy / download,
        second_download_seconds=second,
        second_ratio_to_tcp=baseline / second,
        donors=donors,
        served_by=served_by,
        transport=plane,
    )


def _hold_and_send(size: int, ports) -> None:
    """A donor's part of :func:`_state_copy_seconds`: ``size`` bytes of random floats, sent to
    the first connection after one byte asks for them."""
    import torch

    state = torch.randn(size // 4)
    server = socket.create_server(("127.0.0.1", 0))
    ports.put(server.getsockname()[1])
    connection, _ = server.accept()
    with connection:
        connection.recv(1)
        connection.sendall(memoryview(state.numpy()).cast("B"))


def _state_copy_seconds(size: int) -> float:
    """``size`` bytes of a state another process holds (touched, as a donor's snapshot is),
    through one loopback TCP socket into fresh memory here, with nothing else: no protocol, no
    hashes, one connection. The floor of any download of that state on this machine."""
    import torch

    context = mp.get_context("spawn")
    ports = context.Queue()
    donor = context.Process(target=_hold_and_send, args=(size, ports), daemon=True)
    donor.start()
    try:
        port = ports.get(timeout=120)
        time.sleep(1)  # the state filled, as a donor's is long before a joiner comes
        view = memoryview(torch.empty(size, dtype=torch.uint8).numpy())
        with socket.create_connection(("127.0.0.1", port)) as connection:
            start = time.perf_counter()
            connection.sendall(b"?")
            total = 0
            while total < size:
                got = connection.recv_into(view[total : total + (1 << 20)])
                if not got:
                    raise ConnectionError(f"the state's copy ended after {total} of {size} bytes")
                total += got
            return time.perf_counter() - start
    finally:
        donor.join(timeout=30)
        if donor.is_alive():  # the copy failed before it connected: the donor waits for nobody
            donor.kill()


def _tcp_seconds(size: int, into_fresh_memory: bool = False) -> float:
    """``size`` bytes through one loopback TCP socket (the baseline of the download): into one
    reused 1 MiB buffer, or into a buffer of ``size`` bytes allocated for it, as a download
    must (each page is touched for the first time: ~0.6 s per 400 MB on this VM)."""
    import torch

    server = socket.create_server(("127.0.0.1", 0))
    received = []

    def sink() -> None:
        connection, _ = server.accept()
        total = 0
        if into_fresh_memory:
            view = memoryview(torch.empty(size, dtype=torch.uint8).numpy())
            while got := connection.recv_into(view[total : total + (1 << 20)]):
                total += got
        else:
            while chunk := connection.recv(1 << 20):
                total += len(chunk)
        received.append(total)

    thread = threading.Thread(target=sink)
    thread.start()
    block = bytes(1 << 22)
    start = time.perf_counter()
    with socket.create_connection(server.getsockname()) as client:
        for _ in range(size // len(block)):
            client.sendall(block)
        client.sendall(block[: size % len(block)])  # all of it (the rest was dropped: 3 MB sent nothing)
    thread.join()
    return time.perf_counter() - start


def cli_start() -> dict:
    def median_run(argv: list[str]) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            subprocess.run(argv, capture_output=True, check=True)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    help_seconds = median_run([sys.executable, "-m", "workbench", "--help"])
    python = median_run([sys.executable, "-c", "pass"])
    return dict(help_seconds=help_seconds, python_seconds=python, ratio_to_python=help_seconds / python)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer blocks, a 5 M-parameter state")
    parser.add_argument("--out", type=Path, default=RESULTS / "overheads.json")
    args = parser.parse_args()
    result = dict(benchmark="overheads")
    result["heartbeats"] = heartbeats(blocks=3 if args.quick else 6, steps=10 if args.quick else 20)
    print("heartbeats:", json.dumps(result["heartbeats"]), flush=True)
    params = 5_000_000 if args.quick else 25_000_000
    runs = []
    for donors, plane in ((1, "hivemind"), (1, "direct"), (3, "direct")):
        runs.append(join(params, donors, plane))
        print("join:", json.dumps(runs[-1]), flush=True)
    result["join"] = dict(runs[-1], runs=runs, goal="join_seconds < 2 and ratio_to_tcp >= 0.25 with 3 donors")
    result["cli"] = cli_start()
    print("cli:", json.dumps(result["cli"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
