"""All-reduce throughput: the workbench's averaging path against torch.distributed's gloo.

    python -m benchmarks.allreduce [--peers 2 --peers 4] [--mb 1 --mb 10 --mb 100] [--quick]

Baseline: gloo's all_reduce of the same float32 tensor by the same processes, one just before
each measured all-reduce (interleaved: a drift in the machine's speed moves both alike; run
one phase after the other, the same code's ratio moved from 0.50x to 0.29x between two days).
Measured: one all-reduce of the workbench's averager (hivemind's DecentralizedAverager as the
peers run it), timed from the moment every member has its group (matchmaking excluded:
``require_trigger``) to the slowest member's finish, both started like the baseline, right after
a gloo barrier (a multiprocessing barrier let members go up to 0.7 ms apart on 2 busy cores, and the
first to go waited for the last inside the measured time), for each data plane (``hivemind``:
hivemind's butterfly all-reduce through its p2p daemon; ``direct``: the group's own gloo ring
over TCP, when available) and wire codec. Reported: seconds per all-reduce (median of the
repeats), "bus" throughput (2(n-1)/n of the tensor per member, what a ring or butterfly moves),
the gloo all-reduces beside them (``baseline_seconds``), the ratio to gloo (the median of
the attempts' ratios) and those ratios' first and third quartiles (``ratio_middle_half``).
With ``--phases``, each direct row also has ``phases_ms``: where its time went, each phase's
median over the members and attempts, in the order they run (``wake``: the trigger reaching
the ring's thread; ``start``: the averager's buffers' lock; ``scale`` .. ``check``: inside
``DirectPlane.all_reduce``; ``result``: the caller woken with it).
Writes benchmarks/results/allreduce.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _elements(megabytes: float) -> int:
    return int(megabytes * 1e6) // 4


def _entry(name: str, rank: int, *args) -> None:
    """A worker process: run ``name``; on failure put the traceback on the queue (the last arg)."""
    mp.set_start_method("fork", force=True)  # hivemind's averager forks (a spawned child defaults to spawn)
    try:
        globals()[name](rank, *args)
    except BaseException:
        import traceback

        args[-1].put((rank, traceback.format_exc()))
        raise


def _gloo_all_reduce(tensor) -> float:
    """Seconds of one gloo all_reduce of ``tensor`` among the workers, started together."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(tensor)
    return time.perf_counter() - start


def _averager_worker(
    rank: int,
    world: int,
    port: int,
    configs: list[tuple],
    repeats: dict,
    phases: bool,
    barrier,
    addresses,
    failed,
    out,
) -> None:
    import torch
    import torch.distributed as dist
    from hivemind import DHT

    from swarm.averaging import CODECS
    from swarm.group_averager import GroupAverager

    torch.set_num_threads(1)
    # Before hivemind's DHT and averager fork from this process: they inherit gloo's sockets,
    # unused, and are shut down before the group is destroyed (a failed run kills them all).
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if rank == 0:
        dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        for _ in range(world - 1):
            addresses.put([str(a) for a in dht.get_visible_maddrs()])
    else:
        dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=addresses.get())
    results = {}
    for mb, codec, plane in configs:
        tensor = torch.randn(_elements(mb))
        averager = GroupAverager(
            [tensor],
            dht,
            prefix=f"bench{round(mb * 1000)}kb-{codec}-{plane}",  # no dots in a hivemind prefix
            state_provider=None,
            compression=CODECS[codec](),
            min_matchmaking_time=1.0,
            request_timeout=3.0,
            allreduce_timeout=120.0,
            target_group_size=world,
            allow_state_sharing=False,
            data_plane=plane,
            codec=codec,
            start=True,
        )
        times, baseline, timelines = [], [], []
        ring = averager._driver.plane if phases and averager._driver is not None else None
        attempt = failures = 0
        while attempt <= repeats[mb]:  # the first is a warm-up
            # The baseline, interleaved: gloo's all-reduce of the same tensor, by the same
            # processes just before, so drift in the machine's speed moves both alike.
            seconds = _gloo_all_reduce(tensor.clone())
            barrier.wait()
            control = averager.step(wait=False, require_trigger=True, timeout=60)
            while control.stage.name == "LOOKING_FOR_GROUP" and not control.done():
                time.sleep(0.005)
            barrier.wait()  # every member has its group
            if ring is not None:
                ring.timeline = []
            dist.barrier()  # all go together, as before the baseline's all-reduce
            start = time.perf_counter()
            control.allow_allreduce()
            try:
                whole = len(control.result(timeout=180)) == world
            except Exception as error:  # noqa: BLE001 - a group not found: retried below
                whole, why = False, error
            else:
                why = f"a group of fewer than {world} (here or on another member)"
            finished = time.perf_counter() - start
            if ring is not None:
                marks = [("trigger", start), *ring.timeline, ("result", start + finished)]
                timeline = [(name, t - before) for (_, before), (name, t) in zip(marks, marks[1:])]
            # Counted only if every member averaged in the whole group; else all try again
            # (hivemind's matchmaking now and then misses a member on 2 busy cores).
            failed[rank] = not whole
            barrier.wait()
            if any(failed):
                failures += 1
                if failures >= 5:
                    raise RuntimeError(f"{mb} MB {codec} {plane}: 5 attempts failed, the last: {why}")
                barrier.wait()  # everyone read the flags before they are set again
                continue
            if attempt:
                times.append(finished)
                baseline.append(seconds)
                if ring is not None:
                    timelines.append(timeline)
            attempt += 1
            barrier.wait()
        averager.shutdown()
        results[(mb, codec, plane)] = (times, baseline, timelines)
    out.put((rank, results))
    barrier.wait()
    dht.shutdown()
    dist.destroy_process_group()


def _run(target, world: int, *args) -> list[dict]:
    """Start ``world`` workers ``target(rank, world, *args, barrier, addresses, failed, out)``."""
    context = mp.get_context("spawn")
    out = context.Queue()
    args = (*args, context.Barrier(world), context.Queue(), context.Array("b", world))
    processes = [
        context.Process(target=_entry, args=(target.__name__, r, world, *args, out)) for r in range(world)
    ]
    for p in processes:
        p.start()
    results = []
    for _ in processes:
        rank, result = out.get(timeout=900)
        if isinstance(result, str):  # a worker failed: stop the others too
            for p in processes:
                p.kill()
            raise RuntimeError(f"benchmark worker {rank} failed:\n{result}")
        results.append((rank, result))
    for p in processes:
        p.join(timeout=60)
        if p.exitcode not in (0, None):
            raise RuntimeError(f"a benchmark worker exited with {p.exitcode}")
    return [r for _, r in sorted(results, key=lambda x: x[0])]


def _paired_ratios(baseline: list[list[float]], measured: list[list[float]]) -> list[float]:
    """Gloo's time over ours, each the slowest member's, attempt by attempt (the pairs the
    interleaving made)."""
    return [max(b) / max(m) for b, m in zip(zip(*baseline), zip(*measured))]


def _middle_half(values: list[float]) -> list[float]:
    """The first and third quartiles (the spread a row's median hides: on 2 busy cores one
    attempt's ratio moves by 0.1 and more)."""
    if len(values) < 2:
        return [values[0], values[0]]
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return [quartiles[0], quartiles[2]]


def _slowest(per_member: list[list[float]]) -> float:
    """Median over repeats of the slowest member's time (the all-reduce ends when it does)."""
    return statistics.median(max(times) for times in zip(*per_member))


def _phases(per_member: list[list[list[tuple[str, float]]]]) -> dict[str, float]:
    """Each phase's median milliseconds over the members' attempts, in the order they ran."""
    spent: dict[str, list[float]] = {}
    for timelines in per_member:
        for timeline in timelines:
            for name, seconds in timeline:
                spent.setdefault(name, []).append(seconds * 1000)
    return {name: round(statistics.median(values), 3) for name, values in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, action="append", help="group sizes (default: 2 and 4)")
    parser.add_argument("--mb", type=float, action="append", help="tensor sizes in MB (default: 1, 10, 100)")
    parser.add_argument("--codec", action="append", help="wire codecs (default: none, fp16)")
    parser.add_argument("--plane", action="append", help="data planes (default: hivemind, direct)")
    parser.add_argument("--quick", action="store_true", help="2 peers, 1 and 10 MB, fewer repeats")
    parser.add_argument(
        "--phases", action="store_true", help="also time the direct plane's phases (phases_ms)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "allreduce.json")
    args = parser.parse_args()
    peers = args.peers or ([2] if args.quick else [2, 4])
    sizes = args.mb or ([1.0, 10.0] if args.quick else [1.0, 10.0, 100.0])
    codecs = args.codec or ["none", "fp16"]
    planes = args.plane or ["hivemind", "direct"]
    repeats = {
        # A median of a dozen: on 2 cores one scheduling hiccup moves a 10 MB all-reduce by 20 %.
        mb: (5 if mb >= 100 else 12 if mb >= 10 else 16) // (2 if args.quick else 1) or 1
        for mb in sizes
    }
    rows = []
    for world in peers:
        port = 29500 + os.getpid() % 1000 + world
        configs = [(mb, codec, plane) for mb in sizes for codec in codecs for plane in planes]
        ours = _run(_averager_worker, world, port, configs, repeats, args.phases)
        for mb in sizes:
            # The gloo row: every baseline sample of this size, over all the configurations.
            base = _slowest([sum((o[(m, c, p)][1] for m, c, p in configs if m == mb), []) for o in ours])
            moved = 2 * (world - 1) / world * mb
            rows.append(
                dict(
                    peers=world,
                    mb=mb,
                    path="gloo",
                    codec="none",
                    seconds=base,
                    bus_mb_s=moved / base,
                    ratio=1.0,
                )
            )
            for codec in codecs:
                for plane in planes:
                    measured = [o[(mb, codec, plane)][0] for o in ours]
                    beside = [o[(mb, codec, plane)][1] for o in ours]
                    seconds = _slowest(measured)
                    ratios = _paired_ratios(beside, measured)
                    rows.append(
                        dict(
                            peers=world,
                            mb=mb,
                            path=plane,
                            codec=codec,
                            seconds=seconds,
                            bus_mb_s=moved / seconds,
                            ratio=statistics.median(ratios),
                            ratio_middle_half=_middle_half(ratios),
                            baseline_seconds=_slowest(beside),
                        )
                    )
                    timelines = [o[(mb, codec, plane)][2] for o in ours]
                    if any(timelines):
                        rows[-1]["phases_ms"] = _phases(timelines)
            for row in rows[-1 - len(codecs) * len(planes) :]:
                print(
                    f"{row['peers']} peers {row['mb']:>5g} MB  {row['path']:<8} {row['codec']:<5} "
                    f"{row['seconds'] * 1000:8.1f} ms  {row['bus_mb_s']:7.0f} MB/s  {row['ratio']:.2f}x gloo",
                    flush=True,
                )
                if "phases_ms" in row:
                    print("    " + ", ".join(f"{k} {v:.2f}" for k, v in row["phases_ms"].items()), flush=True)
    result = dict(
        benchmark="allreduce",
        date=time.strftime("%Y-%m-%d"),
        machine=dict(platform=platform.platform(), cpus=os.cpu_count()),
        baseline="torch.distributed gloo all_reduce of the same float32 tensor by the same processes, "
        "interleaved with the measured all-reduces (one before each)",
        # The members start each measured all-reduce together (a barrier, since 2026-12-05):
        # rows without this field were measured before, which was unfair to the direct plane.
        method="barrier",
        rows=rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
