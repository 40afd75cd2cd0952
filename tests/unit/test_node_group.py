"""A torchrun node's own group (workbench.run.node.NodeGroup), two real gloo ranks in processes of
their own: stopped between a command and its work, and a rank that stops answering."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK = """
import json, os, sys, time
import torch
from workbench.run import node

rank, role = int(os.environ["RANK"]), sys.argv[1]
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
    else:
        group.command()
        if role == "hangs":
            time.sleep(4.5)  # stopped (SIGSTOP), or stuck: never reaches the step's all-reduce
        group.average_gradients(model)
    said = "done"
except node.NodeError as error:
    said = str(error)
print(json.dumps([said, time.monotonic() - started]), flush=True)
group.close()
"""


def _run(role_0: str, role_1: str, script: str = RANK) -> dict[int, tuple]:
    """Both ranks in processes of their own (plain interpreters: a multiprocessing child of
    pytest's worker took 10 s more to start); each prints what it met and when."""
    port = _free_port()
    ranks = []
    for rank, role in enumerate((role_0, role_1)):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
        ranks.append(
            subprocess.Popen(
                [sys.executable, "-c", script, role],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
                cwd=Path(__file__).parents[2],
            )  # fmt: skip
        )
    try:
        said = {}
        for rank, process in enumerate(ranks):
            out, _ = process.communicate(timeout=60)
            said[rank] = tuple(json.loads(out.strip().splitlines()[-1]))
        return said
    finally:
        for process in ranks:
            if process.poll() is None:
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


SHAPES = """
import json, os, sys
import torch
from workbench.run import node

rank = int(os.environ["RANK"])
group = node.NodeGroup()
torch.manual_seed(0)
model = torch.nn.ModuleDict({"used": torch.nn.Linear(2, 1), "unused": torch.nn.Linear(2, 1)})
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
before = model["unused"].weight.detach().clone()
if rank == 0:
    group.command(node.STEP, 0.1)
else:
    group.command()
model["used"](torch.ones(1, 2)).sum().backward()
group.average_gradients(model)
optimizer.step()
moved = not torch.equal(before, model["unused"].weight)
if rank == 1:
    with torch.no_grad():
        model["used"].weight.fill_(float("nan"))  # this rank's θ went NaN
if rank == 0:
    group.command(node.CHECK)
else:
    group.command()
print(json.dumps([moved, group.max_param_diff(model)]), flush=True)
group.close()
"""


def test_a_node_leaves_unused_parameters_alone_and_sees_a_rank_gone_nan():
    """(A review, stop 72.) A parameter no rank used got a zero gradient from the node's average,
    so AdamW decayed it (0.99 where one process keeps 1.0); and the end-of-run check read a
    rank whose θ went NaN as agreeing (0.0: gloo's MAX drops a NaN)."""
    said = _run("", "", SHAPES)
    for moved, diff in said.values():
        assert moved is False and diff == float("inf"), said
