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


@pytest.mark.parametrize("renamed", [True, False], ids=["between-renames", "before-renames"])
def test_a_save_stopped_before_it_was_put_in_place_is_resumed_from(tmp_path, monkeypatch, renamed) -> None:
    """SIGKILL (or a power cut) after a save's write but before its renames: the resume took the
    checkpoint before, though the new one lay complete beside it (a review, stop 71). It is put
    in place now, as the save would have. One stopped as it wrote (incomplete) is passed over."""
    import os

    checkpoint.save(tmp_path, {"step": 1})
    checkpoint.save(tmp_path, {"step": 2})
    real = os.replace

    def killed(source, target):  # type: ignore[no-untyped-def]
        # The process is gone before the new file goes into place (or before any rename).
        if str(source).endswith(".tmp") or not renamed:
            raise KeyboardInterrupt
        return real(source, target)

    monkeypatch.setattr(checkpoint.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, {"step": 3})
    monkeypatch.setattr(checkpoint.os, "replace", real)
    assert (tmp_path / "checkpoint.pt.tmp").exists() and (tmp_path / "checkpoint.pt").exists() is not renamed
    payload, path = checkpoint.load(tmp_path)
    assert payload["step"] == 3 and path.name == "checkpoint.pt"
    assert checkpoint.load(tmp_path)[0]["step"] == 3 and not (tmp_path / "checkpoint.pt.tmp").exists()
    assert checkpoint._read(tmp_path / "checkpoint.prev.pt")["step"] == 2
    unfinished = tmp_path / "checkpoint.pt.tmp"  # a save stopped as it wrote
    unfinished.write_bytes((tmp_path / "checkpoint.pt").read_bytes()[:100])
    assert checkpoint.load(tmp_path)[0]["step"] == 3


def test_no_good_checkpoint_names_both_problems(tmp_path) -> None:
    (tmp_path / "checkpoint.pt").write_bytes(b"garbage")
    (tmp_path / "checkpoint.prev.pt").write_bytes(b"")
    with pytest.raises(
        CheckpointError,
        match="checkpoint.pt is truncated or corrupt.*checkpoint.prev.pt.*start without --resume",
    ):
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


def test_a_position_in_another_stream_starts_this_one_from_its_beginning() -> None:
    """Stop 57, a review: a checkpoint resumed into two folders side by side (each gets a new
    key, so its own stream's seed) made both draw the checkpoint's batches, the same ones; a
    resume with another --shard went on with the old shard's generator in the new range."""
    corpus = ByteCorpus.load(DataConfig(max_bytes=200_000))
    stream = corpus.batches(block_size=16, batch_size=2, seed=3)
    next(stream)
    state = stream.state_dict()
    for other in (
        corpus.batches(block_size=16, batch_size=2, seed=4),  # another peer id's seed
        corpus.batches(block_size=16, batch_size=2, seed=3, shard=1, num_shards=2),
    ):
        fresh = [next(other)[0] for _ in range(2)]
        again = type(other)(
            other.data, other.lo, other.hi, block_size=16, batch_size=2,
            generator=torch.Generator().manual_seed(other.seed),
        )  # fmt: skip
        again.load_state_dict(state)
        assert again.drawn == 0 and all(torch.equal(a, next(again)[0]) for a in fresh)


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
    import collections
    import os
    import signal

    class InterruptsWhilePickled:
        def __reduce__(self):
            os.kill(os.getpid(), signal.SIGINT)
            return (collections.OrderedDict, ())  # (read back as checkpoints are: weights only)

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, {"step": 7, "payload": torch.zeros(1000), "odd": InterruptsWhilePickled()})
    assert checkpoint.load(tmp_path)[0]["step"] == 7  # written whole, then interrupted
    assert not list(tmp_path.glob("*.tmp"))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_during_a_write_waits_for_the_peer_to_say_it_wrote_it(tmp_path) -> None:
    """The peer wraps the save, its log line and its event in another hold: a SIGINT during the
    write stopped the peer before it said it had written a checkpoint (it had)."""
    import collections
    import os
    import signal

    from workbench.run.stopping import not_interrupted

    class InterruptsWhilePickled:
        def __reduce__(self):
            os.kill(os.getpid(), signal.SIGINT)
            return (collections.OrderedDict, ())  # (read back as checkpoints are: weights only)

    said = []
    with pytest.raises(KeyboardInterrupt), not_interrupted():
        checkpoint.save(tmp_path, {"step": 7, "odd": InterruptsWhilePickled()})
        said.append("wrote checkpoint")
    assert said == ["wrote checkpoint"] and checkpoint.load(tmp_path)[0]["step"] == 7
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_failed_write_leaves_no_temp_file(tmp_path) -> None:
    class Unpicklable:
        def __reduce__(self):
            raise OSError("No space left on device")

    checkpoint.save(tmp_path, {"step": 1})
    with pytest.raises(CheckpointError, match="No space left on device.*the earlier checkpoints are kept"):
        checkpoint.save(tmp_path, {"step": 2, "odd": Unpicklable()})
    assert checkpoint.load(tmp_path)[0]["step"] == 1 and not list(tmp_path.glob("*.tmp"))


def test_a_full_disk_in_torch_s_writer_is_one_clear_error(tmp_path, monkeypatch) -> None:
    """torch's zip writer reports a full disk as RuntimeError ("unexpected pos"): two tracebacks."""
    checkpoint.save(tmp_path, {"step": 1})

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError, match="unexpected pos.*is the disk full"):
        checkpoint.save(tmp_path, {"step": 2})
    monkeypatch.undo()
    assert checkpoint.load(tmp_path)[0]["step"] == 1 and not list(tmp_path.glob("*.tmp"))


def _flip(path, at: float = 0.5) -> None:
    """Flip one byte in the middle of ``path``'s first tensor's stored bytes."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        entry = next(i for i in archive.infolist() if "/data/" in i.filename)
    data = bytearray(path.read_bytes())
    header = entry.header_offset  # the local header's name and (alignment) extra field lengths:
    start = header + 30 + int.from_bytes(data[header + 26 : header + 28], "little")
    start += int.from_bytes(data[header + 28 : header + 30], "little")
    data[start + int(entry.compress_size * at)] ^= 0x40
    path.write_bytes(bytes(data))


def test_flipped_bytes_nan_weights_or_a_missing_part_pass_over_the_newest_checkpoint(tmp_path) -> None:
    """torch.load read a checkpoint with flipped bytes without a word: the peer resumed on
    them (one flip in a float32 exponent is NaN, and the peer was told to lower its learning
    rate), and never tried the good previous checkpoint."""
    good = {"model": {"w": torch.ones(256)}, "inner_optimizer": {}, "outer": {"params": [torch.ones(256)]}}

    def flipped(path) -> None:
        checkpoint.save(tmp_path, {**good, "step": 2})
        _flip(path)

    cases = [  # each writes a bad newest checkpoint over a good one at step 1
        ("does not match its checksum", flipped),
        (
            "holds NaN/Inf in the model",
            lambda path: checkpoint.save(
                tmp_path, {**good, "step": 2, "model": {"w": torch.full((256,), float("nan"))}}
            ),
        ),
        # +inf weights passed before stop 71 (a review): a streaming peer resumed on them, and was
        # told to lower its --inner-lr at its first step (-inf stays allowed: an attention mask).
        (
            "holds NaN/Inf in the model",
            lambda path: checkpoint.save(
                tmp_path,
                {**good, "step": 2, "model": {"w": torch.ones(256), "b": torch.tensor([float("inf")])}},
            ),
        ),
        (
            "holds NaN/Inf in the global params",
            lambda path: checkpoint.save(
                tmp_path, {**good, "step": 2, "outer": {"params": [torch.full((4,), float("inf"))]}}
            ),
        ),
        (
            "is incomplete (no inner_optimizer)",
            lambda path: checkpoint.save(tmp_path, {"step": 2, "model": {}, "outer": {}}),
        ),
        # Not checked before stop 69 (a review): NaN moments resumed, and the peer was told to
        # lower its --inner-lr at its first step.
        (
            "holds NaN/Inf in the inner optimizer's state",
            lambda path: checkpoint.save(
                tmp_path,
                {
                    **good,
                    "step": 2,
                    "inner_optimizer": {"state": {0: {"exp_avg": torch.full((4,), float("nan"))}}},
                },
            ),
        ),
        (
            "holds NaN/Inf in the error feedback",
            lambda path: checkpoint.save(
                tmp_path, {**good, "step": 2, "feedback": [torch.ones(2), torch.full((2,), float("inf"))]}
            ),
        ),
        (
            "holds NaN/Inf in the outer state",
            lambda path: checkpoint.save(
                tmp_path,
                {
                    **good,
                    "step": 2,
                    "outer": {**good["outer"], "pending": [[torch.full((2,), float("nan"))]]},
                },
            ),
        ),
        (
            "holds NaN/Inf in the peer's own round state",
            lambda path: checkpoint.save(
                tmp_path, {**good, "step": 2, "local": {"offset": [torch.full((2,), float("-inf"))]}}
            ),
        ),
    ]
    for why, spoil in cases:
        for name in ("checkpoint.pt", "checkpoint.prev.pt"):
            (tmp_path / name).unlink(missing_ok=True)
        checkpoint.save(tmp_path, {**good, "step": 1})
        spoil(tmp_path / "checkpoint.pt")
        with pytest.raises(CheckpointError) as refused:  # (the newest, read alone)
            checkpoint._read(tmp_path / "checkpoint.pt", checkpoint.REQUIRED)
        assert why in str(refused.value)
        payload, path = checkpoint.load(tmp_path, required=checkpoint.REQUIRED)
        assert payload["step"] == 1 and path.name == "checkpoint.prev.pt", why


def test_a_checkpoint_whose_state_does_not_fit_the_peer_is_passed_over_with_its_name(tmp_path) -> None:
    """A checkpoint that passes its checksums but whose state the peer cannot take (another
    release's OuterState fields, a state dict missing keys, a step "x", a parameter at -inf) was
    a traceback or a misleading line ("the downloaded state does not fit this model"), and the
    good previous checkpoint was never tried (a review, stop 71). Now it is passed over as a
    corrupt one is, named with why; a -inf buffer (an attention mask) is taken."""
    model = torch.nn.Linear(4, 2)
    model.register_buffer("mask", torch.full((2,), float("-inf")))
    good = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "inner_optimizer": {},
        "outer": {"step": 1},
    }

    def use(payload, path) -> None:  # as a peer puts a checkpoint's state to use
        model.load_state_dict(payload["model"])
        float(payload["outer"]["step"])
        if set(payload["outer"]) - {"step"}:
            raise TypeError(
                f"OuterState.__init__() got an unexpected keyword argument {sorted(payload['outer'])[0]!r}"
            )
        checkpoint.check_parameters(model, path)

    spoiled = {
        "unexpected keyword argument": {**good, "outer": {"step": 2, "extra": 1}},
        "Missing key(s) in state_dict": {**good, "model": {"weight": torch.ones(2, 4)}},
        "could not convert string to float": {**good, "outer": {"step": "x"}},
        "holds NaN/Inf in the model's weight": {
            **good,
            "model": {**good["model"], "weight": torch.full((2, 4), float("-inf"))},
        },
    }
    for why, payload in spoiled.items():
        for name in ("checkpoint.pt", "checkpoint.prev.pt"):
            (tmp_path / name).unlink(missing_ok=True)
        checkpoint.save(tmp_path, good)
        checkpoint.save(tmp_path, payload)
        taken, path = checkpoint.load(tmp_path, required=checkpoint.REQUIRED, use=use)
        assert path.name == "checkpoint.prev.pt" and taken["outer"]["step"] == 1, why
        (tmp_path / "checkpoint.prev.pt").unlink()
        with pytest.raises(CheckpointError, match="cannot resume") as refused:
            checkpoint.load(tmp_path, required=checkpoint.REQUIRED, use=use)
        assert why in str(refused.value) and "checkpoint.pt" in str(refused.value), why
    checkpoint.save(tmp_path, good)  # the -inf mask: taken
    assert checkpoint.load(tmp_path, required=checkpoint.REQUIRED, use=use)[1].name == "checkpoint.pt"


def test_after_passing_over_a_corrupt_checkpoint_the_next_save_keeps_the_good_previous_one(tmp_path) -> None:
    """The next save moved the corrupt newest checkpoint over the good previous one: two saves
    after a fallback, the only good checkpoint was gone."""
    for step in (1, 2):
        checkpoint.save(tmp_path, {"step": step, "w": torch.ones(64)})
    _flip(tmp_path / "checkpoint.pt", at=0.0)
    assert checkpoint.load(tmp_path)[0]["step"] == 1
    checkpoint.save(tmp_path, {"step": 3})
    assert checkpoint._read(tmp_path / "checkpoint.prev.pt")["step"] == 1
    checkpoint.save(tmp_path, {"step": 4})  # from here on, as always
    assert checkpoint._read(tmp_path / "checkpoint.prev.pt")["step"] == 3


def test_an_unreadable_checkpoint_is_refused_not_passed_over(tmp_path, monkeypatch) -> None:
    import zipfile

    checkpoint.save(tmp_path, {"step": 1})
    checkpoint.save(tmp_path, {"step": 2})

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(zipfile, "ZipFile", denied)
    with pytest.raises(
        CheckpointError, match=r"cannot read .*checkpoint.pt: permission denied \(.*chmod u\+r"
    ):
        checkpoint.load(tmp_path)


def test_a_run_dir_holding_a_checkpoint_is_refused_without_resume(tmp_path) -> None:
    """Started again without --resume, a peer's first saves replaced both checkpoints of the
    folder, silently."""
    checkpoint.check_no_checkpoint(tmp_path, None)  # nothing there
    checkpoint.save(tmp_path, {"step": 10})
    with pytest.raises(CheckpointError, match=f"continue from it with --resume {tmp_path}"):
        checkpoint.check_no_checkpoint(tmp_path, None)
    checkpoint.check_no_checkpoint(tmp_path, tmp_path)  # resumed into its own folder
    with pytest.raises(CheckpointError, match="holds a checkpoint"):
        checkpoint.check_no_checkpoint(tmp_path, tmp_path / "elsewhere")


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


def test_a_peer_resumed_after_its_codec_was_steered_keeps_what_compression_held_back(tmp_path) -> None:
    """A peer started with --update-codec fp16 and error feedback, steered to int8, checkpointed
    and resumed: the resumed peer put the residuals back, then applied the steered codec, whose
    new error feedback dropped them (a resumed run drifted from an uninterrupted one). The steered
    settings now come first and the residuals are the checkpoint's."""
    from torch import nn

    from optim.averager import LocalAverager
    from optim.diloco import DiLoCo, DiLoCoConfig
    from workbench.run.control import Steering

    def peer():
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        inner = torch.optim.AdamW(model.parameters())
        config = DiLoCoConfig(inner_steps=2, codec="fp16", error_feedback=True)
        return model, inner, DiLoCo(model, inner, LocalAverager(), config)

    def steering() -> Steering:
        return Steering(
            None, name="a", peer_id="QmA", joiner=False,
            emit=lambda *a, **k: None, publish=lambda: None, beat=lambda stage: None, checkpoint=lambda: "",
        )  # fmt: skip

    model, inner, outer = peer()
    outer.retune(codec="int8")  # what Steering.apply does with the owner's codec
    held = [torch.full_like(p, 0.5) for p in outer.params]
    outer.feedback.residuals = [h.clone() for h in held]
    payload = {
        **checkpoint.training_state(outer, model, inner, None),
        "control_version": 1,
        "steered": {"codec": "int8"},
    }
    checkpoint.save(tmp_path, payload)
    payload, _ = checkpoint.load(tmp_path)

    model2, inner2, outer2 = peer()
    resumed = steering()
    checkpoint.resume_training(payload, resumed, outer2, model2, inner2, None)
    assert outer2.config.codec == "int8" and resumed.version == 1
    assert outer2.feedback.residuals is not None
    assert all(torch.equal(a, b) for a, b in zip(outer2.feedback.residuals, held))


def test_a_run_dir_this_user_cannot_write_is_one_line_with_the_fix(tmp_path, monkeypatch) -> None:
    import builtins

    real_open = builtins.open

    def read_only(path, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only)
    with pytest.raises(
        CheckpointError, match="cannot write in --run-dir .*Permission denied.*fix its permissions"
    ):
        checkpoint.hold_run_dir(tmp_path)


def test_a_folder_that_cannot_be_made_names_the_part_in_the_way(tmp_path) -> None:
    """mkdir said only "[Errno 20] Not a directory" (a --run-dir under a file) or "[Errno 17]
    File exists" (an --identity key under one)."""
    from swarm.errors import SwarmError
    from swarm.identity import create_identity

    (tmp_path / "afile").write_text("")
    with pytest.raises(
        CheckpointError, match=r"cannot make --run-dir .*/afile/sub \(.*/afile is a file, not a folder\)"
    ):
        checkpoint.make_folder(tmp_path / "afile" / "sub")
    with pytest.raises(SwarmError, match=r"afile is a file, not a folder\): give --identity a path"):
        create_identity(tmp_path / "afile" / "id.key")
    assert checkpoint.make_folder(tmp_path / "a" / "b").is_dir()


def test_a_full_disk_when_a_peer_takes_its_run_dir_is_one_line_with_the_fix(tmp_path, monkeypatch) -> None:
    """Writing the pid into the run dir's lock file on a full disk was a bare OSError traceback."""
    import builtins

    real_open = builtins.open

    class Full:
        def __init__(self, handle) -> None:
            self.handle = handle

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

    def full(path, *args, **kwargs):
        handle = real_open(path, *args, **kwargs)
        return Full(handle) if str(path).endswith(".lock") else handle

    monkeypatch.setattr(builtins, "open", full)
    with pytest.raises(CheckpointError, match="No space left on device; is the disk full.*another --run-dir"):
        checkpoint.hold_run_dir(tmp_path)
    monkeypatch.setattr(builtins, "open", real_open)
    checkpoint.hold_run_dir(tmp_path).close()  # nothing held: the next try takes it


def test_a_full_disk_found_by_the_flush_is_said_as_well(tmp_path, monkeypatch) -> None:
    """On a real full disk the pid lands in the buffer and the flush fails: closing the file
    flushed it again and raised a new OSError, so the message was the bare errno (a review,
    stop 60: "error: [Errno 28] No space left on device (run with -v for details)")."""
    import builtins

    real_open = builtins.open

    class Full:
        def __init__(self, handle) -> None:
            self.handle = handle

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def flush(self) -> None:
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            self.handle.close()
            raise OSError(28, "No space left on device")

    def full(path, *args, **kwargs):
        handle = real_open(path, *args, **kwargs)
        return Full(handle) if str(path).endswith(".lock") else handle

    monkeypatch.setattr(builtins, "open", full)
    with pytest.raises(CheckpointError, match=f"cannot write in --run-dir {tmp_path}.*is the disk full"):
        checkpoint.hold_run_dir(tmp_path)


def test_a_full_disk_for_the_swarm_s_model_is_one_line_and_leaves_no_half_file(tmp_path, monkeypatch) -> None:
    """global_params.pt at the end of a run on a full disk: torch's "unexpected pos" came out
    as two tracebacks and exit 1, and the run's `done` was never said."""
    from pathlib import Path
    from types import SimpleNamespace

    import workbench.run.peer as peer_module
    from workbench.run.peer import Peer

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0\nframe #0 ...")

    monkeypatch.setattr(peer_module.torch, "save", full)
    peer = Peer.__new__(Peer)
    peer.run_dir, peer.name, peer.rounds_done = Path(tmp_path), "a", 3
    peer.diloco = SimpleNamespace(
        outer_step_count=12, global_intact=True, read_global=lambda read: read([torch.ones(2)])
    )
    with pytest.raises(checkpoint.GlobalParamsError) as error:
        peer.save_global_params()
    assert "\n" not in str(error.value) and "unexpected pos 64 vs 0; is the disk full?" in str(error.value)
    assert "outer step 12" in str(error.value) and not list(Path(tmp_path).iterdir())


def test_a_model_buffer_of_minus_infinity_is_no_corruption(tmp_path) -> None:
    """An attention mask kept as a buffer holds -inf by design: such a model must resume."""
    mask = torch.full((4, 4), float("-inf")).triu(1)
    payload = {"model": {"mask": mask}, "inner_optimizer": {}, "outer": {"params": [torch.ones(2)]}}
    checkpoint.save(tmp_path, payload)
    assert torch.equal(checkpoint.load(tmp_path, required=checkpoint.REQUIRED)[0]["model"]["mask"], mask)


@pytest.mark.parametrize("theta", ["finite", "nan"])
def test_a_peer_stopped_by_an_error_keeps_the_swarm_s_model(tmp_path, monkeypatch, theta) -> None:
    """Only Ctrl+C wrote global_params.pt: an inner loss of NaN, or a heartbeat that could no
    longer be published, hours into a run without --rounds, left nothing, though θ_global (the
    swarm's model) was intact. Now θ is written whatever stopped the peer, if it is finite."""
    from torch import nn

    import workbench.run.peer as peer_module
    from optim.averager import LocalAverager
    from optim.diloco import DiLoCo, DiLoCoConfig
    from workbench.config import PeerConfig, RunConfig

    model = nn.Linear(3, 2)
    outer = DiLoCo(model, torch.optim.AdamW(model.parameters()), LocalAverager(), DiLoCoConfig(inner_steps=2))
    if theta == "nan":
        outer.global_params[0].fill_(float("nan"))

    def run(self) -> dict:
        self.diloco, self.rounds_done = outer, 5
        raise FloatingPointError("the inner loss became nan at step 412: lower --inner-lr")

    closed: list[str] = []
    monkeypatch.setattr(peer_module.Peer, "run", run)
    monkeypatch.setattr(peer_module.Peer, "close", lambda self, reason: closed.append(reason))
    with pytest.raises(FloatingPointError):
        peer_module.run_peer(RunConfig(peer=PeerConfig(run_dir=str(tmp_path))))
    assert closed == ["error"]
    saved = tmp_path / "global_params.pt"
    if theta == "nan":
        assert not saved.exists()
    else:
        kept = torch.load(saved, weights_only=True)
        assert all(torch.equal(a, b) for a, b in zip(kept, outer.global_params))


class _Group:
    """A pair whose mean is this peer's own update; the other member's weight grows each call
    (so this peer's share of each mean differs), and call ``refuse`` is refused."""

    def __init__(self, refuse: int = -1) -> None:
        self.calls, self.refuse = 0, refuse

    def expected_group(self) -> int:
        return 2

    def all_reduce(self, tensors, *, weight, info=None):  # type: ignore[no-untyped-def]
        from optim.averager import RoundReport

        self.calls += 1
        group = [dict(info or {}), dict(info or {}, peer="other", weight=float(4 * self.calls))]
        refused = "a test refusal" if self.calls == self.refuse else None
        return RoundReport(group_size=2, group_info=group, refused=refused)


@pytest.mark.parametrize(
    ("eager", "topk", "refuse"),
    [(True, False, -1), (False, True, 3)],
    ids=["eager-share", "error-feedback-refused"],
)
def test_a_checkpoint_taken_while_a_round_averages_resumes_into_the_run_that_went_on(
    tmp_path, eager: bool, topk: bool, refuse: int
) -> None:
    """With --overlap a checkpoint holds the round in flight as a queued mean, but the rest of
    what collecting that round does was lost: the eager stand-in's share it teaches (the resumed
    run used the round before's, 0.6 for 0.5) and, when the group refused it, what error
    feedback sent (taken back by the running peer after its next encode): the resumed run ended
    0.16 of θ away. It now resumes into the same θ, residuals and share, bit for bit."""
    from torch import nn

    from optim.diloco import DiLoCo, DiLoCoConfig

    config = DiLoCoConfig(
        inner_steps=3, delay=1, overlap=True, eager=eager, outlier_ratio=0,
        **(dict(codec="topk", topk_density=0.2, error_feedback=True) if topk else {}),
    )  # fmt: skip

    def peer(seed: int, group: _Group):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, inner, DiLoCo(model, inner, group, config)

    def rounds(model, inner, outer, g, count: int) -> None:
        for _ in range(count * config.inner_steps):
            x = torch.randn(4, 8, generator=g)
            (model(x) - x.sum(1, keepdim=True)).square().mean().backward()
            inner.step()
            inner.zero_grad(set_to_none=True)
            outer.after_inner_step(samples=4)

    model, inner, outer = peer(0, _Group(refuse))
    g = torch.Generator().manual_seed(1)
    rounds(model, inner, outer, g, 3)  # round 3's all-reduce (call 3) in flight
    checkpoint.save(tmp_path, checkpoint.training_state(outer, model, inner, None))
    rng = g.get_state()
    rounds(model, inner, outer, g, 2)
    share = outer._share
    outer.finish()

    payload, _ = checkpoint.load(tmp_path)
    group = _Group(refuse)
    group.calls = 3
    model2, inner2, outer2 = peer(5, group)
    checkpoint.restore_training(payload, outer2, model2, inner2, None)
    g.set_state(rng)
    rounds(model2, inner2, outer2, g, 2)
    assert outer2._share == share
    outer2.finish()
    assert all(torch.equal(a, b) for a, b in zip(outer2.global_params, outer.global_params))
    if topk:
        assert all(torch.equal(a, b) for a, b in zip(outer2.feedback.residuals, outer.feedback.residuals))


def test_a_checkpoint_keeps_the_cuda_generators_on_a_gpu_machine(tmp_path, monkeypatch) -> None:
    """Dropout on CUDA tensors draws from the CUDA generators, which the checkpoint did not keep:
    a resumed GPU peer drew other masks than the run that went on. (No GPU here: torch.cuda's
    generator calls stand in.)"""
    from torch import nn

    from optim.averager import LocalAverager
    from optim.diloco import DiLoCo, DiLoCoConfig

    states = [torch.arange(8, dtype=torch.uint8), torch.arange(8, 16, dtype=torch.uint8)]
    restored: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in states])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    model = nn.Linear(2, 2)
    inner = torch.optim.AdamW(model.parameters())
    outer = DiLoCo(model, inner, LocalAverager(), DiLoCoConfig(inner_steps=2))
    checkpoint.save(tmp_path, checkpoint.training_state(outer, model, inner, None))
    payload, _ = checkpoint.load(tmp_path)
    checkpoint.restore_training(payload, outer, model, inner, None)
    assert [s.tolist() for s in restored] == [s.tolist() for s in states]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # resumed on a machine with one GPU
    restored.clear()
    checkpoint.restore_training(payload, outer, model, inner, None)
    assert restored == []


def test_a_checkpoint_that_cannot_be_written_stops_nothing(tmp_path, monkeypatch) -> None:
    """A full disk at a periodic checkpoint raised out of the round loop and stopped the peer
    (the swarm lost it; the earlier checkpoint was intact). Now an error line and a
    ``checkpoint_failed`` event, and training goes on; the next checkpoint is tried at its time."""
    from pathlib import Path

    from workbench.run.peer import Peer

    def full(self, payload):  # type: ignore[no-untyped-def]
        raise CheckpointError(
            "cannot write the checkpoint: No space left on device; the earlier checkpoints are kept"
        )

    def bare(self, payload):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")  # a step that says no CheckpointError

    monkeypatch.setattr(checkpoint, "training_state", lambda *args: {})
    for failing in (full, bare):
        monkeypatch.setattr(Peer, "_write_checkpoint", failing)
        events: list[tuple[str, dict]] = []
        peer = Peer.__new__(Peer)
        peer.run_dir, peer.name = Path(tmp_path), "a"
        peer.diloco = type("Rounds", (), {"outer_step_count": 12})()
        peer.model = peer.inner_optimizer = peer.batches = None
        peer.emit = lambda event, **fields: events.append((event, fields))  # noqa: B023
        assert peer.save_checkpoint() is None
        assert events == [("checkpoint_failed", {"error": events[0][1]["error"], "outer_step": 12})]
        assert "No space left" in events[0][1]["error"]


def _written_by(tmp_path, config, model) -> tuple[str, str]:
    """A checkpoint in ``tmp_path`` of run "r" as a peer started with ``config`` writes it (the
    fingerprint, its summary and the flags it covers); (fingerprint, summary)."""
    from workbench.run import joining

    fingerprint, summary = joining.fingerprint(config, model)
    checkpoint.save(
        tmp_path,
        {"run_id": "r", "fingerprint": fingerprint, "summary": summary,
         "fingerprinted": joining.fingerprinted_flags(config, model),
         "model": {}, "inner_optimizer": {}, "outer": {"params": [torch.ones(2)]}},
    )  # fmt: skip
    return fingerprint, summary


def test_a_refused_resume_names_the_flags_that_differ(tmp_path) -> None:
    """`--resume` with another --update-codec, --outer-momentum or --clip-norm printed two
    identical summaries ("diloco H=5 outer lr 0.7 codec none" twice): the user could not tell
    which flag to change (a review, stop 60)."""
    from workbench.config import RunConfig
    from workbench.run import joining
    from workbench.run.model import build_model, tiny

    model = build_model(tiny(), seed=0)
    started = RunConfig()
    started.diloco.codec, started.diloco.outer_momentum = "int8", 0.8
    now = RunConfig()
    fingerprint, summary = _written_by(tmp_path, started, model)
    state = {"model": {}, "inner_optimizer": {}, "outer": {"params": [torch.ones(2)]}}
    mine, my_summary = joining.fingerprint(now, model)
    with pytest.raises(CheckpointError) as refused:
        checkpoint.load_for(
            tmp_path, run_id="r", fingerprint=mine, summary=my_summary,
            fingerprinted=joining.fingerprinted_flags(now, model),
        )  # fmt: skip
    assert "--outer-momentum 0.8 (this peer: 0.9); --update-codec int8 (this peer: none)" in str(
        refused.value
    )
    assert "--clip-norm" not in str(refused.value)
    # A checkpoint of an earlier release (no flags kept): the fingerprints, as before.
    checkpoint.save(tmp_path, {"run_id": "r", "fingerprint": fingerprint, "summary": summary, **state})
    with pytest.raises(CheckpointError, match="written for model fingerprint"):
        checkpoint.load_for(tmp_path, run_id="r", fingerprint=mine, fingerprinted={"--method": "diloco"})


def test_a_checkpoint_of_another_owner_s_run_of_the_same_id_is_refused(tmp_path) -> None:
    """A volunteer's `join --resume` with a checkpoint of an earlier run that had the same run id
    (another owner): the new run's owner, at outer step 0, downloaded the joiner's state, 4 rounds
    of the old run, and went on from it (a review, stop 64). Refused, saying what to do; a
    checkpoint of an earlier release (no owner) and one of the same owner are taken."""
    state = {"model": {}, "inner_optimizer": {}, "outer": {"params": [torch.ones(2)]}}
    checkpoint.save(tmp_path, {"run_id": "r", "owner": "9a46", "fingerprint": "f", **state})
    with pytest.raises(CheckpointError) as refused:
        checkpoint.load_for(tmp_path, run_id="r", fingerprint="f", owner="da93")
    assert "another run named 'r' (owner 9a46; this one's is da93)" in str(refused.value)
    assert "join without --resume" in str(refused.value) and "\n" not in str(refused.value)
    assert checkpoint.load_for(tmp_path, run_id="r", fingerprint="f", owner="9a46")[0]["owner"] == "9a46"
    assert checkpoint.load_for(tmp_path, run_id="r", fingerprint="f")  # owner unknown (`start`): taken
    checkpoint.save(tmp_path, {"run_id": "r", "fingerprint": "f", **state})  # an earlier release's
    assert checkpoint.load_for(tmp_path, run_id="r", fingerprint="f", owner="da93")


def test_a_trimmed_mean_checkpoint_of_an_earlier_release_still_resumes(tmp_path) -> None:
    """The run's fingerprint covers --aggregate since stop 62 (a trimmed-mean joiner was let into
    a mean run); a trimmed-mean peer's checkpoint written before then holds the fingerprint
    without it, and `--resume` with the same flags was refused (a review of the change)."""
    from workbench.config import RunConfig
    from workbench.run import joining
    from workbench.run.model import build_model, tiny

    model = build_model(tiny(), seed=0)
    config = RunConfig()
    config.averaging.aggregate = "trimmed-mean"
    old, summary = joining.fingerprint(config, model, before_aggregate=True)
    flags = {k: v for k, v in joining.fingerprinted_flags(config, model).items() if k != "--aggregate"}
    state = {"model": {}, "inner_optimizer": {}, "outer": {"params": [torch.ones(2)]}}
    checkpoint.save(
        tmp_path, {"run_id": "r", "fingerprint": old, "summary": summary, "fingerprinted": flags, **state}
    )
    mine = joining.fingerprint(config, model)[0]
    assert mine != old
    fingerprinted = joining.fingerprinted_flags(config, model)
    with pytest.raises(CheckpointError, match="--aggregate"):  # (without the earlier fingerprint)
        checkpoint.load_for(tmp_path, run_id="r", fingerprint=mine, fingerprinted=fingerprinted)
    payload, _ = checkpoint.load_for(
        tmp_path, run_id="r", fingerprint=mine, fingerprinted=fingerprinted, also=(old,)
    )
    assert payload["fingerprint"] == old


def test_a_mean_runs_checkpoint_does_not_resume_into_a_trimmed_mean_peer(tmp_path) -> None:
    """A review (stop 69): a trimmed-mean peer's earlier-release fingerprint (without
    --aggregate) is a mean peer's fingerprint now, so a mean run's checkpoint resumed silently
    into `--resume ... --aggregate trimmed-mean` (the other way round was refused)."""
    from workbench.config import RunConfig
    from workbench.run import joining
    from workbench.run.model import build_model, tiny

    model = build_model(tiny(), seed=0)
    mean, trimmed = RunConfig(), RunConfig()
    trimmed.averaging.aggregate = "trimmed-mean"
    fingerprint, _ = _written_by(tmp_path, mean, model)
    assert fingerprint == joining.fingerprint(trimmed, model, before_aggregate=True)[0]
    with pytest.raises(CheckpointError, match=r"--aggregate mean \(this peer: trimmed-mean\)"):
        checkpoint.load_for(
            tmp_path,
            run_id="r",
            fingerprint=joining.fingerprint(trimmed, model)[0],
            fingerprinted=joining.fingerprinted_flags(trimmed, model),
            also=(fingerprint,),
        )


def test_a_checkpoint_that_cannot_be_put_in_place_is_a_checkpoint_error(tmp_path, monkeypatch) -> None:
    """A review (stop 69): only the write itself was turned into a CheckpointError; a rename
    that failed (a full disk) or a folder that cannot be synced (FUSE, network file systems)
    raised a bare OSError out of the round loop and stopped the peer, the second after the
    checkpoint was written."""
    import errno
    import os

    checkpoint.save(tmp_path, {"step": 1})
    real_replace = os.replace

    def full(*args):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(CheckpointError, match="No space left on device.*earlier checkpoints are kept"):
        checkpoint.save(tmp_path, {"step": 2})
    monkeypatch.setattr(os, "replace", real_replace)
    assert not list(tmp_path.glob("*.tmp")) and checkpoint.load(tmp_path)[0]["step"] == 1
    real_fsync = os.fsync

    def no_folder_sync(fd):  # type: ignore[no-untyped-def]
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", no_folder_sync)
    assert checkpoint.save(tmp_path, {"step": 3}).name == "checkpoint.pt"
    assert checkpoint.load(tmp_path)[0]["step"] == 3


def test_a_resume_with_another_inner_lr_says_so() -> None:
    """`--resume d --inner-lr 0.01` said only the weight decay it changed: the inner lr (not in
    AdamW's state as the flag: the schedule's) was taken without a word (a review, stop 60)."""
    saved = {"--inner-lr": 0.001, "--warmup-steps": 20, "--grad-clip": 1.0}
    assert checkpoint.changed_flags(saved, dict(saved)) is None
    assert checkpoint.changed_flags(None, saved) is None  # an earlier release's checkpoint
    assert checkpoint.changed_flags(saved, {**saved, "--inner-lr": 0.01}) == (
        "resumed with --inner-lr 0.01 of its flags (the checkpoint's: --inner-lr 0.001)"
    )


class _RunsCode:
    """What a checkpoint handed to a user could hold: unpickling it calls ``touch``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_a_checkpoint_that_would_run_code_is_refused_unread(tmp_path) -> None:
    """Checkpoints were read with torch.load(weights_only=False): `--resume DIR` of a checkpoint
    a user was given ran any code its pickle named (a review, stop 60). Only tensors, numbers,
    strings and containers are read now; anything else is refused before it runs."""
    proof = tmp_path / "ran"
    payload = {"model": {"w": torch.ones(2)}, "inner_optimizer": {}, "outer": {"params": [torch.ones(2)]}}
    checkpoint.save(tmp_path / "given", {**payload, "extra": _RunsCode(str(proof))})
    with pytest.raises(CheckpointError, match="holds more than a checkpoint's tensors and numbers"):
        checkpoint.load(tmp_path / "given", required=checkpoint.REQUIRED)
    assert not proof.exists()
    checkpoint.save(tmp_path / "own", payload)  # the peers' own: read as before
    assert checkpoint.load(tmp_path / "own", required=checkpoint.REQUIRED)[0]["model"]["w"].sum() == 2


def test_a_checkpoint_passed_over_leaves_none_of_its_steered_settings(tmp_path) -> None:
    """The newest checkpoint (written after the owner steered H 8, int8, outer lr 0.3) fails as
    its state goes in; the previous one (before the steer) is taken, and the peer ran with the
    newer one's H, codec and lr all the same: the previous one retunes only what it steered (a
    review, stop 71)."""
    from optim.averager import LocalAverager
    from optim.diloco import DiLoCo, DiLoCoConfig
    from workbench.run.control import Steering

    def peer():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        inner = torch.optim.AdamW(model.parameters())
        config = DiLoCoConfig(inner_steps=2, codec="fp16", error_feedback=True, outer_lr=0.7)
        return model, inner, DiLoCo(model, inner, LocalAverager(), config)

    model, inner, outer = peer()
    checkpoint.save(tmp_path, {**checkpoint.training_state(outer, model, inner, None), "steered": {}})
    outer.retune(inner_steps=8, codec="int8", outer_lr=0.3)
    bad = checkpoint.training_state(outer, model, inner, None)
    bad["model"] = {"weight": bad["model"]["weight"]}  # no bias: edited, or another release's
    steered = {"inner_steps": 8, "codec": "int8", "outer_lr": 0.3}
    checkpoint.save(tmp_path, {**bad, "control_version": 1, "steered": steered})

    model2, inner2, outer2 = peer()
    steering = Steering(
        None, name="a", peer_id="QmA", joiner=False, emit=lambda *a, **k: None,
        publish=lambda: None, beat=lambda stage: None, checkpoint=lambda: "",
    )  # fmt: skip

    def use(payload, path) -> None:
        checkpoint.resume_training(payload, steering, outer2, model2, inner2, None)

    _, path = checkpoint.load(tmp_path, required=checkpoint.REQUIRED, use=use)
    assert path.name == "checkpoint.prev.pt" and steering.version == 0 and steering.settings == {}
    config = outer2.config
    assert (config.inner_steps, config.codec, config.outer_lr) == (2, "fp16", 0.7)
    assert outer2.outer_optimizer.param_groups[0]["lr"] == 0.7
