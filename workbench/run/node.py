"""A peer made of several processes on one node: ``torchrun --nproc-per-node N -m workbench start``.

As in OpenDiLoCo and INTELLECT-1, the node is one peer of the swarm: data-parallel inside the
node over ``torch.distributed`` (gloo on CPU, NCCL-free so it runs anywhere), one hivemind
identity for the node, and the swarm averaging the node's pseudo-gradient with the others'.

Rank 0 runs the full :class:`~workbench.run.peer.Peer` (DHT, heartbeats, averaging, steering,
checkpoints) and drives the other ranks, the followers, with one small broadcast before each
action:

    STEP(lr)  every rank trains one inner step on its own batch; gradients are averaged over
              the node before the optimizer step, so all ranks keep the same θ_local
    SYNC      rank 0's parameters and inner optimizer state go to every rank (at each round's
              start: after an outer step, a state download or a resume)
    CHECK     the largest parameter difference between any rank and rank 0 (end of run)
    STOP      followers return (after a barrier: nothing is in flight when the group is
              destroyed), and end their process at once (:func:`workbench.run.stopping.end_process`)

The node's averaging weight is the samples of all its ranks, so a 2-rank node counts twice as
much as a 1-process peer with the same batch size.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import socket
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

STEP, SYNC, CHECK, STOP = range(4)

WORK_TIMEOUT = 300.0
"""Seconds a rank waits in the node's work (a step's gradients, a sync, a check) for the others:
a step's all-reduce waits for the slowest rank's forward and backward. Commands wait longer (the
node's default group: a follower waits through rank 0's rounds, downloads and pauses). Until
stop 64 the work waited 12 hours too: a follower stopped or hung (SIGSTOP) held the node that
long without a word, and Ctrl+C could not stop rank 0 (Python's handler waits for gloo)."""


class NodeError(RuntimeError):
    """A collective of the node's ranks failed: a rank is gone (killed, crashed) or stopped
    answering within :data:`WORK_TIMEOUT`."""


def node_world() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) outside torchrun."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class NodeGroup:
    """The node's process group, as seen from any rank."""

    def __init__(self) -> None:
        if not dist.is_initialized():
            # gloo: CPU tensors on every platform; a long timeout, since followers wait through
            # rank 0's averaging rounds, state downloads and steering pauses.
            dist.init_process_group("gloo", timeout=timedelta(hours=12))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.work = dist.new_group(backend="gloo", timeout=timedelta(seconds=WORK_TIMEOUT))
        self.stopped = False
        self.pending = False  # rank 0: a command sent whose work the followers now wait in

    @classmethod
    def from_env(cls) -> NodeGroup | None:
        return cls() if node_world()[1] > 1 else None

    # --- commands (rank 0 sends, followers receive) -----------------------------------------

    def command(self, op: int = STEP, lr: float = 0.0) -> tuple[int, float]:
        message = torch.tensor([float(op), lr], dtype=torch.float64)
        with self._failing("command"):
            dist.broadcast(message, src=0)
        self.pending = self.rank == 0 and op in (STEP, SYNC, CHECK)
        return int(message[0]), float(message[1])

    def stop(self) -> None:
        """Rank 0: tell the followers to return, and wait until every rank has the word (a
        barrier), so that no rank tears its side of the group down with a message in flight.
        Stopped between a command and its work (a Ctrl+C or SIGTERM during a step's forward
        pass), the followers wait in that work, not for a command: the group is torn down
        instead, which ends their wait with an error (a STOP sent then met their all-reduce, and
        rank 0 hung until its close deadline: a review, stop 64)."""
        if not self.stopped and self.rank == 0:
            self.stopped = True
            if self.pending:
                logger.info("node: stopped during the ranks' work; the followers end as the group closes")
                return
            self.command(STOP)
            with self._failing("stop"):
                dist.barrier(group=self.work)

    @contextlib.contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        """gloo's error (a C++ message, often with a stack of frames) as one line naming the rank."""
        try:
            yield
        except RuntimeError as error:
            first = next((line for line in str(error).splitlines() if line.strip()), "")
            first = re.sub(r"^\[[^\]]*\]\s*", "", first)[:160]  # gloo's "[.../pair.cc:553] "
            waited = "" if what == "command" else f" or did not answer within {WORK_TIMEOUT:.0f} s"
            raise NodeError(
                f"node rank {self.rank}: the node's {what} failed: a rank is gone{waited} ({first})"
            ) from None

    # --- collectives -------------------------------------------------------------------------

    @torch.no_grad()
    def sync_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Rank 0's parameters and inner optimizer state onto every rank."""
        with self._failing("sync"):
            for p in model.parameters():
                buffer = p.detach().to("cpu", copy=True)
                dist.broadcast(buffer, src=0, group=self.work)
                if self.rank:
                    p.copy_(buffer.to(p.device))
            state = [optimizer.state_dict() if self.rank == 0 else None]
            dist.broadcast_object_list(state, src=0, group=self.work)
        self.pending = False
        if self.rank:
            optimizer.load_state_dict(state[0])

    @torch.no_grad()
    def average_gradients(self, model: torch.nn.Module) -> None:
        """Each gradient ← its mean over the node's ranks (one flat all-reduce); a parameter
        that no rank used keeps no gradient, as in one process (a zero one, AdamW decayed it
        and moved it by its momentum: 0.99 on a 2-rank node where one process keeps 1.0, a
        review, stop 72)."""
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        used = torch.tensor([float(p.grad is not None) for p in params])
        flat = torch.cat([*(g.detach().reshape(-1).float().cpu() for g in grads), used])
        with self._failing("step"):
            dist.all_reduce(flat, group=self.work)
        self.pending = False
        used = flat[-len(params) :] if params else used
        flat /= self.world_size
        offset = 0
        for p, g, any_rank in zip(params, grads, used.tolist()):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).to(g.device, g.dtype) if any_rank else None
            offset += n

    @torch.no_grad()
    def max_param_diff(self, model: torch.nn.Module) -> float:
        """The largest |θ_rank − θ_rank0| over the node (0 when the ranks agree)."""
        flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])
        reference = flat.clone()
        with self._failing("check"):
            dist.broadcast(reference, src=0, group=self.work)
            # NaN as inf: gloo's MAX drops a NaN, so a rank whose θ went NaN read as agreeing
            # (a review, stop 72).
            gap = (flat - reference).abs().max() if flat.numel() else torch.tensor(0.0)
            diff = torch.tensor([float(torch.nan_to_num(gap, nan=math.inf))])
            dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=self.work)
        self.pending = False
        return float(diff)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def follow(config) -> int:
    """A follower rank: train when rank 0 says so, until it says stop. Returns an exit code."""
    from workbench.run.joining import follower_batches
    from workbench.run.training import build_training, train_step

    node = NodeGroup()
    cfg = config
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    training = build_training(cfg)
    model, optimizer = training.model, training.inner_optimizer
    # Each rank reads its own stream of the node's shard: the seed mixed with the rank and the
    # node (its machine and torchrun's rendezvous address).
    where = f"{socket.gethostname()}/{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    batches = follower_batches(cfg, training.corpus, node.rank, where)
    logger.info("node rank %d of %d: following rank 0", node.rank, node.world_size)
    try:
        while True:
            op, lr = node.command()
            if op == STEP:
                for group in optimizer.param_groups:
                    group["lr"] = lr
                x, y = next(batches)
                train_step(
                    model,
                    optimizer,
                    x,
                    y,
                    training.device,
                    cfg.train.grad_clip,
                    lambda: node.average_gradients(model),
                )
            elif op == SYNC:
                node.sync_state(model, optimizer)
            elif op == CHECK:
                node.max_param_diff(model)
            elif op == STOP:
                dist.barrier(group=node.work)  # rank 0's stop(): every rank has the word
                logger.info("node rank %d: stopped by rank 0", node.rank)
                return 0
    except NodeError as error:  # rank 0 stopped mid-step (it closed the group), or a rank is gone
        logger.warning("%s; this rank stops", error)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        node.close()
