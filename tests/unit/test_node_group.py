"""A torchrun node's own group (workbench.run.node.NodeGroup), two real gloo ranks in processes of
their own: stopped between a command and its work, and a rank that stops answering."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, role: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    from workbench.run import node

    node.WORK_TIMEOUT = 3.0
    group = node.NodeGroup()
    model = torch.nn.Linear(4, 1)
    started = time.monotonic()
    try:
        if rank == 0:
            group.command(node.STEP, 0.1)
            if role == "stopped mid-step":  # a Ctrl+C in the forward pass: straight to close
                group.stop()
            else:
                group.average_gradients(model)
            results.put((rank, "done", time.monotonic() - started))
        else:
            group.command()
            if role == "hangs":
                time.sleep(4.5)  # stopped (SIGSTOP), or stuck: never reaches the step's all-reduce
            group.average_gradients(model)
            results.put((rank, "done", time.monotonic() - started))
    except node.NodeError as error:
        results.put((rank, str(error), time.monotonic() - started))
    finally:
        group.close()


def _run(role_0: str, role_1: str) -> dict[int, tuple[str, float]]:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    ranks = [
        context.Process(target=_rank, args=(r, port, role, results))
        for r, role in enumerate((role_0, role_1))
    ]
    for process in ranks:
        process.start()
    try:
        return {rank: (what, seconds) for rank, what, seconds in (results.get(timeout=60) for _ in ranks)}
    finally:
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()


def test_stopped_between_a_command_and_its_work_the_node_closes_at_once():
    """SIGTERM to rank 0 during a step's forward pass: stop() sent STOP while the follower waited
    in the step's all-reduce, and rank 0 hung until its close deadline (20 s, then a thread dump
    and exit 1: 2 of 3 tries in a review, stop 64). The group is now torn down instead, and the
    follower's wait ends with one line."""
    results = _run("stopped mid-step", "follows")
    assert results[0][0] == "done" and results[0][1] < 2.0, results
    what, seconds = results[1]
    assert what.startswith("node rank 1: the node's step failed") and seconds < 10, results


def test_a_rank_that_stops_answering_fails_the_step_in_bounded_time():
    """A follower stopped (SIGSTOP) held rank 0 in the step's all-reduce for the group's 12 hours,
    without a word, and Ctrl+C could not stop it. The node's work now waits WORK_TIMEOUT."""
    results = _run("leads", "hangs")
    what, seconds = results[0]
    assert what.startswith("node rank 0: the node's step failed: a rank is gone or did not answer within 3 s")
    assert 2.5 < seconds < 15, results
    assert "\n" not in what
