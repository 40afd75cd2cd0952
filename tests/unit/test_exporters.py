"""TensorBoard and W&B exporters write files their own tools read back."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from workbench.cli.command import main
from workbench.run.exporters import ExporterError, scalars

EVENTS = [
    {"event": "started", "time": 1.0, "peer": "a", "peer_id": "x"},
    {"event": "initial_eval", "time": 2.0, "peer": "a", "outer_step": 0, "eval_loss": 5.5},
    *[
        {
            "event": "round",
            "time": 3.0 + r,
            "peer": "a",
            "outer_step": r,
            "loss": 5.0 - r,
            "eval_loss": 5.2 - r,
            "group_size": 2,
            "bytes_sent": 1000 * r,
            "alone_reason": None,
            "resync": None,
        }
        for r in (1, 2, 3)
    ],
    {"event": "done", "time": 9.0, "peer": "a", "syncs": 3, "final_eval_loss": 2.1, "bytes_sent": 3000},
]


def test_scalars_take_numbers_at_the_runs_clock() -> None:
    step, values = scalars(EVENTS[2])
    assert step == 1 and values == {"loss": 4.0, "eval_loss": 4.2, "group_size": 2.0, "bytes_sent": 1000.0}
    assert scalars(EVENTS[0]) is None  # nothing numeric to plot
    assert scalars({"event": "round", "outer_step": 4, "loss": float("nan")}) == (4, {})
    # --eval-every: a round that did not evaluate carries the last evaluation, not plotted again
    stale = {"event": "round", "outer_step": 5, "loss": 2.0, "eval_loss": 2.5, "evaluated": False}
    assert scalars(stale) == (5, {"loss": 2.0})


def _run_dir(tmp_path: Path) -> Path:
    peer = tmp_path / "run" / "a"
    peer.mkdir(parents=True)
    (peer / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
    return tmp_path / "run"


def test_a_folder_of_several_runs_is_said_so_as_it_is_exported(tmp_path: Path, capsys) -> None:
    """`export` of a folder holding three unrelated runs wrote one table of them all, no run
    column and no word (a hands-on review, stop 72); the peers of one run in two folders are
    one run."""
    started = {"event": "started", "time": 0.5, "peer": "a", "run": "r/ed8b0000/1.0", "owner": "ed8b0000"}
    for folder, run in (("x", "r/ed8b0000/1.0"), ("y", "r/ed8b0000/1.0"), ("z", "other/414e0000/2.0")):
        (tmp_path / folder).mkdir()
        lines = [dict(started, run=run, peer=folder), *EVENTS[1:]]
        (tmp_path / folder / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert main(["export", str(tmp_path / "x"), "--csv"]) == 0
    assert "runs" not in capsys.readouterr().err
    for folder in ("y", "z"):
        (tmp_path / "x" / folder).mkdir()
        (tmp_path / "x" / folder / "metrics.jsonl").write_text(
            (tmp_path / folder / "metrics.jsonl").read_text()
        )
    assert main(["export", str(tmp_path / "x"), "--csv"]) == 0
    said = capsys.readouterr().err
    assert "holds the metrics of 2 runs ('other' of owner 414e0000, 'r' of owner ed8b0000)" in said, said


def test_tensorboard_event_files_load_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main(["export", str(_run_dir(tmp_path)), "--tensorboard", str(tmp_path / "tb")]) == 0
    accumulator = EventAccumulator(str(tmp_path / "tb" / "a"))
    accumulator.Reload()
    assert [(s.step, s.value) for s in accumulator.Scalars("loss")] == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert accumulator.Scalars("initial_eval/eval_loss")[0].value == 5.5
    assert accumulator.Scalars("done/final_eval_loss")[0].step == 3


def test_peers_of_one_name_in_two_folders_are_two_tensorboard_runs(tmp_path: Path, capsys) -> None:
    """Two runs under RUN_DIR, each with a peer named `a`: export wrote one TensorBoard run `a`,
    its loss at steps 1, 2, 3, 1, 2, 3 (a review, 2026-12-06)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for run in ("first", "second"):
        peer = tmp_path / "runs" / run / "a"
        peer.mkdir(parents=True)
        (peer / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
    assert main(["export", str(tmp_path / "runs"), "--tensorboard", str(tmp_path / "tb")]) == 0
    for run in ("first", "second"):
        accumulator = EventAccumulator(str(tmp_path / "tb" / run / "a" / "a"))
        accumulator.Reload()
        assert [s.step for s in accumulator.Scalars("loss")] == [1, 2, 3]
    assert "first/a/a: 6 events exported" in capsys.readouterr().err


def test_a_replay_keeps_the_events_asked_for_and_refuses_table_flags(tmp_path: Path, capsys) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = _run_dir(tmp_path)
    assert main(["export", str(run_dir), "--events", "round", "--tensorboard", str(tmp_path / "tb")]) == 0
    accumulator = EventAccumulator(str(tmp_path / "tb" / "a"))
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    assert "loss" in tags and not any(t.startswith(("initial_eval/", "done/")) for t in tags), tags
    assert "a: 3 events exported" in capsys.readouterr().err
    for flag in (["--csv"], ["--out", str(tmp_path / "x.csv")]):  # ignored before: no table, no error
        assert main(["export", str(run_dir), *flag, "--tensorboard", str(tmp_path / "tb2")]) == 2
        error = capsys.readouterr().err
        assert f"{flag[0]} writes the table" in error and error.count("\n") == 1, error
    assert not (tmp_path / "tb2").exists() and not (tmp_path / "x.csv").exists()


def test_wandb_offline_runs_hold_the_history(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = _run_dir(tmp_path)
    assert main(["export", str(run_dir), "--wandb", "workbench-test"]) == 0
    files = list((run_dir / "wandb").glob("offline-run-*/*.wandb"))
    assert len(files) == 1, list((run_dir / "wandb").rglob("*"))
    deadline = time.monotonic() + 30  # wandb's service process may still be writing, under load
    while True:
        history, kinds = _wandb_history(files[0])
        losses = [(row["_step"], row["loss"]) for row in history if "loss" in row]
        if len(losses) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert losses == [(1, 4.0), (2, 3.0), (3, 2.0)], (kinds, files[0].stat().st_size)


def test_wandb_that_cannot_start_online_is_one_line_and_closes_the_others(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """`--wandb-mode online` with no API key: wandb's own UsageError came out of `export` and a
    peer's start as a traceback, and a TensorBoard writer made before it was left open (a
    review, stop 72). One line with the fix now, exit 2."""
    wandb = pytest.importorskip("wandb")
    from workbench.run import exporters

    def no_key(**kwargs):  # type: ignore[no-untyped-def]
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    closed: list[str] = []
    monkeypatch.setattr(wandb, "init", no_key)
    monkeypatch.setattr(exporters.TensorBoardExporter, "close", lambda self: closed.append("tensorboard"))
    run_dir = _run_dir(tmp_path)
    argv = [
        "export",
        str(run_dir),
        "--wandb",
        "p",
        "--wandb-mode",
        "online",
        "--tensorboard",
        str(tmp_path / "tb"),
    ]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "cannot start W&B (No API key configured" in error and "wandb login" in error, error
    assert error.count("\n") == 1 and closed == ["tensorboard"], (error, closed)


def _wandb_history(path: Path) -> tuple[list[dict], list[str]]:
    """The logged rows of an offline run: its records (LevelDB log framing after a 7-byte
    ':W&B' header: 32 KiB blocks, each record with a crc32, a length and a type) parsed with
    wandb's own protobuf messages."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    rows, kinds, chunks, offset, block = [], [], b"", 7, 32768
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # too little room left in this block for a header
            offset += block - offset % block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        chunks += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            kinds.append(record.WhichOneof("record_type"))
            if kinds[-1] == "history":
                rows.append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in record.history.item
                    }
                )
        elif kind == 0:
            break  # zero padding at the end
    return rows, kinds


def test_a_missing_exporter_package_is_a_clear_error(tmp_path: Path, monkeypatch, capsys) -> None:
    import builtins

    real_import = builtins.__import__

    def without_tensorboard(name, *args, **kwargs):
        if name == "torch.utils.tensorboard":
            raise ImportError("no tensorboard")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_tensorboard)
    assert main(["export", str(_run_dir(tmp_path)), "--tensorboard", str(tmp_path / "tb")]) == 2
    assert "pip install 'swarm-workbench[tensorboard]'" in capsys.readouterr().err
    with pytest.raises(ExporterError):
        from workbench.run.exporters import TensorBoardExporter

        TensorBoardExporter(tmp_path / "tb2")


def test_a_failing_exporter_is_dropped_and_the_others_still_get_every_event() -> None:
    """The loop stopped at the failing exporter: the ones after it missed that event (TensorBoard
    on a full disk cost W&B that round's scalars)."""
    from workbench.run.telemetry import Events

    class Failing:
        def write(self, record: dict) -> None:
            raise OSError(28, "No space left on device")

    class Kept:
        def __init__(self) -> None:
            self.records: list[dict] = []

        def write(self, record: dict) -> None:
            self.records.append(record)

    kept, events = Kept(), Events()
    events.open(None, name="p", exporters=[Failing(), kept])
    events.emit("round", outer_step=1)
    events.emit("round", outer_step=2)
    assert [r["outer_step"] for r in kept.records] == [1, 2] and events.exporters == [kept]


def test_a_full_disk_under_metrics_jsonl_loses_events_not_the_run(caplog) -> None:
    """metrics.jsonl was written unguarded: a full disk raised out of the round's report and
    stopped the peer, and then out of close(), before the averager and the DHT were shut down."""
    from unittest import mock

    from workbench.run.peer import Peer
    from workbench.run.telemetry import Events

    class Full:
        def __init__(self) -> None:
            self.space = False

        def write(self, line: str) -> None:
            if not self.space:
                raise OSError(28, "No space left on device")

        def close(self) -> None:
            raise OSError(28, "No space left on device")

    events = Events()
    events._file = Full()
    with caplog.at_level("ERROR"):
        events.emit("round", outer_step=1)
        events.emit("round", outer_step=2)
    assert caplog.text.count("cannot write metrics.jsonl") == 1  # said once, not every event
    peer = Peer.__new__(Peer)
    peer.outer = peer.dht = peer.board = peer.node = None
    session = mock.MagicMock()
    peer.peer_id, peer.session, peer.events = "", session, events
    peer.close("finished")
    assert session.close.called


def test_a_peer_refused_before_it_started_says_nothing_of_leaving() -> None:
    """A refused --resume (a checkpoint of another model) appended a "left" event to the
    checkpoint folder's metrics.jsonl, which `export` then listed; only a peer that said
    "started" says "left"."""
    from unittest import mock

    from workbench.run.peer import Peer

    for announced in (False, True):
        said: list[str] = []
        peer = Peer.__new__(Peer)
        peer.outer = peer.dht = peer.board = peer.node = None
        peer.peer_id, peer.session, peer.events = "", mock.MagicMock(), mock.MagicMock()
        peer.emit = lambda event, said=said, **fields: said.append(event)
        peer.announced = announced
        peer.close("error")
        assert said == (["left"] if announced else [])


def test_wandb_runs_of_a_read_only_run_dir_go_where_the_export_says(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """`export --wandb` of a read-only RUN_DIR (another user's, a mounted copy): wandb put its
    runs in the temp folder and said nothing (a review, 2026-12-06). They go under ./wandb, and
    the export says so; a W&B exporter given a read-only folder says that in one line."""
    pytest.importorskip("wandb")
    import os

    from workbench.run.exporters import ExporterError, WandbExporter

    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = _run_dir(tmp_path)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    writable = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != run_dir and writable(path, mode))
    assert main(["export", str(run_dir), "--wandb", "workbench-test"]) == 0
    assert f"{run_dir} is read-only: W&B's runs go under {here / 'wandb'}" in capsys.readouterr().err
    assert list((here / "wandb").glob("offline-run-*/*.wandb")) and not (run_dir / "wandb").exists()
    with pytest.raises(ExporterError, match="it is read-only"):
        WandbExporter("workbench-test", directory=run_dir, name="p0")
