"""Atomic checkpoints: what is written, what survives a crash, and clear errors for bad files."""

from __future__ import annotations

import pytest
import torch

from workbench.run import checkpoint
from workbench.run.checkpoint import CheckpointError
from workbench.run.data import ByteCorpus, DataConfig, DataError


def test_save_then_load_round_trips(tmp_path) -> None:
    checkpoint.save(tmp_path, {"run_id": "r", "weights": torch.arange(4.0)})
    payload, path = checkpoint.load(tmp_path)
    assert path.name == "checkpoint.pt" and payload["run_id"] == "r"
    assert torch.equal(payload["weights"], torch.arange(4.0))
    assert not list(tmp_path.glob("*.tmp"))  # the temp file was renamed into place


def test_the_previous_checkpoint_is_kept_and_used_when_the_newest_is_corrupt(tmp_path) -> None:
    checkpoint.save(tmp_path, {"step": 1})
    checkpoint.save(tmp_path, {"step": 2})
    assert checkpoint.load(tmp_path)[0]["step"] == 2
    newest = tmp_path / "checkpoint.pt"
    newest.write_bytes(newest.read_bytes()[: len(newest.read_bytes()) // 2])  # truncated
    payload, path = checkpoint.load(tmp_path)
    assert payload["step"] == 1 and path.name == "checkpoint.prev.pt"


def test_no_good_checkpoint_names_both_problems(tmp_path) -> None:
    (tmp_path / "checkpoint.pt").write_bytes(b"garbage")
    (tmp_path / "checkpoint.prev.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="checkpoint.pt is truncated or corrupt.*checkpoint.prev.pt"):
        checkpoint.load(tmp_path)


def test_missing_folder_and_foreign_files(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="no such folder"):
        checkpoint.load(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load(tmp_path)
    torch.save({"just": "a dict"}, tmp_path / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="not a workbench checkpoint"):
        checkpoint.load(tmp_path)


def test_the_data_position_resumes_the_same_stream() -> None:
    corpus = ByteCorpus.load(DataConfig(max_bytes=200_000))
    stream = corpus.batches(block_size=16, batch_size=2, seed=3)
    for _ in range(5):
        next(stream)
    state = stream.state_dict()
    expected = [next(stream)[0] for _ in range(3)]
    again = corpus.batches(block_size=16, batch_size=2, seed=3)
    again.load_state_dict(state)
    assert all(torch.equal(a, next(again)[0]) for a in expected)
    assert again.drawn == 8
    other = corpus.batches(block_size=16, batch_size=4, seed=3)
    with pytest.raises(DataError, match="same --batch-size"):
        other.load_state_dict(state)


def test_a_run_dir_held_by_a_live_peer_is_refused(tmp_path) -> None:
    import subprocess
    import sys

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, pathlib; from workbench.run.checkpoint import hold_run_dir\n"
            f"lock = hold_run_dir(pathlib.Path({str(tmp_path)!r})); print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match=rf"in use by another running peer \(pid {holder.pid}\)"):
            checkpoint.hold_run_dir(tmp_path)
    finally:
        holder.communicate("")  # it ends: the kernel releases its lock
    checkpoint.hold_run_dir(tmp_path).close()  # free again


def test_ctrl_c_during_a_write_takes_effect_after_it(tmp_path) -> None:
    """A SIGINT while torch.save runs (here: sent from inside the pickling) used to break the
    write with two tracebacks and leave checkpoint.pt.tmp behind."""
    import os
    import signal

    class InterruptsWhilePickled:
        def __reduce__(self):
            os.kill(os.getpid(), signal.SIGINT)
            return (dict, ())

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, {"step": 7, "payload": torch.zeros(1000), "odd": InterruptsWhilePickled()})
    assert checkpoint.load(tmp_path)[0]["step"] == 7  # written whole, then interrupted
    assert not list(tmp_path.glob("*.tmp"))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_failed_write_leaves_no_temp_file(tmp_path) -> None:
    class Unpicklable:
        def __reduce__(self):
            raise OSError("No space left on device")

    checkpoint.save(tmp_path, {"step": 1})
    with pytest.raises(OSError, match="No space"):
        checkpoint.save(tmp_path, {"step": 2, "odd": Unpicklable()})
    assert checkpoint.load(tmp_path)[0]["step"] == 1 and not list(tmp_path.glob("*.tmp"))


def test_a_peers_training_state_round_trips_with_adamw_saved_once(tmp_path) -> None:
    """θ, the outer momentum and AdamW's moments come back bit for bit; the moments are in the
    file once (the outer state's copy of them, as served to joiners, is left out)."""
    from torch import nn

    from optim.averager import LocalAverager
    from optim.diloco import DiLoCo, DiLoCoConfig

    def peer(seed: int):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, inner, DiLoCo(model, inner, LocalAverager(), DiLoCoConfig(inner_steps=2))

    model, inner, outer = peer(0)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):  # two rounds and a step into the third
        model(torch.randn(3, 4, generator=g)).square().mean().backward()
        inner.step()
        inner.zero_grad(set_to_none=True)
        outer.after_inner_step(samples=3)
    checkpoint.save(tmp_path, checkpoint.training_state(outer, model, inner, None))
    payload, _ = checkpoint.load(tmp_path)
    assert payload["outer"]["inner"] == [] and payload["outer"]["inner_keys"] == []

    model2, inner2, outer2 = peer(7)
    checkpoint.restore_training(payload, outer2, model2, inner2, None)
    assert outer2.outer_step_count == 2
    assert all(torch.equal(a, b) for a, b in zip(outer2.global_params, outer.global_params))
    assert all(torch.equal(a, b) for a, b in zip(outer2.momentum_buffers(), outer.momentum_buffers()))
    mine, theirs = inner.state_dict()["state"], inner2.state_dict()["state"]
    assert mine.keys() == theirs.keys() and all(
        torch.equal(mine[i][k], theirs[i][k]) for i in mine for k in mine[i]
    )
