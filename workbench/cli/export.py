"""`workbench export RUN_DIR --csv`: a run's metrics as one table, for spreadsheets and pandas.

Reads every ``metrics.jsonl`` under RUN_DIR (one peer's --run-dir, or a demo's --run-dir with
a folder per peer), keeps the chosen events (default: ``round``), and writes CSV (``--csv``) or
JSON lines, one row per event, columns in first-seen order. Data to stdout or ``--out FILE``.
``--tensorboard DIR`` and ``--wandb PROJECT`` replay the events into those instead, one run per
peer (see :mod:`workbench.run.exporters`).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path
from typing import Any

from swarm.monitor import strict_json
from swarm.records import printable


class ExportError(ValueError):
    pass


def add_export_parser(commands) -> None:
    parser = commands.add_parser(
        "export",
        help="a run's metrics (every metrics.jsonl under RUN_DIR) as CSV or JSON lines",
        description="Export a run's metrics, one row per event, from every metrics.jsonl under RUN_DIR.",
        epilog="examples:\n  workbench export runs/demo --csv > rounds.csv\n"
        "  workbench export runs/peer-a --events round,state_downloaded --out events.jsonl\n"
        "  workbench export runs/demo --tensorboard runs/tb && tensorboard --logdir runs/tb\n"
        "  workbench export runs/demo --wandb my-project   # offline runs under RUN_DIR/wandb",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a peer's or a demo's --run-dir")
    parser.add_argument("--csv", action="store_true", help="CSV (default: JSON lines)")
    parser.add_argument(
        "--events",
        help="comma-separated event kinds, or 'all' (default: round; with --tensorboard/--wandb: all)",
    )
    parser.add_argument("--out", metavar="FILE", help="write here instead of stdout")
    parser.add_argument(
        "--tensorboard", metavar="DIR", help="write TensorBoard event files here (a folder per peer) instead"
    )
    parser.add_argument(
        "--wandb", metavar="PROJECT", help="log to this W&B project instead (one run per peer)"
    )
    parser.add_argument(
        "--wandb-mode",
        choices=("offline", "online"),
        help="offline (default: written under RUN_DIR/wandb, upload with `wandb sync`) or online",
    )


def read_events(
    run_dir: str | Path, kinds: set[str] | None, *, sources: dict[int, str] | None = None
) -> list[dict[str, Any]]:
    """The events of every metrics.jsonl under ``run_dir`` (of ``kinds``; None: all), in time
    order, without the rounds a resume rolled back (see :func:`_events_of`). ``sources``, if
    given, gets each event's folder under ``run_dir`` (by the event's ``id()``)."""
    if not str(run_dir).strip():
        raise ExportError("RUN_DIR is empty: give the --run-dir of a peer or a demo")
    root = Path(run_dir)
    if not root.is_dir():
        raise ExportError(f"{root} is not a folder: give the --run-dir of a peer or a demo")
    files = sorted(root.rglob("metrics.jsonl"))
    if not files:
        raise ExportError(f"no metrics.jsonl under {root}: was the run started with --run-dir {root}?")
    rows, seen, dropped, runs = [], set(), 0, set()
    for path in files:
        if path.exists() and not (path.is_file() or path.is_dir()):  # a FIFO: read for ever
            raise ExportError(f"{path} is not a file (a peer writes its metrics.jsonl as one)")
        events, rolled_back, run = _events_of(path, kinds, seen)
        dropped += rolled_back
        if run is not None:  # its run id and owner (a resume publishes the manifest anew)
            runs.add(run.rsplit("/", 1)[0])
        rows.extend(events)
        if sources is not None:
            folder = str(path.parent.relative_to(root))
            sources.update((id(event), folder) for event in events)
    if kinds and not rows:  # a typo in --events, more often than a run without them
        raise ExportError(
            f"no {', '.join(sorted(kinds))} events under {root} (it has: {', '.join(sorted(seen)) or 'none'}); "
            "see --events"
        )
    missing = sorted(kinds - seen) if kinds else []
    if missing:  # a typo beside a kind that is there: said, not passed over
        print(
            f"no {', '.join(missing)} events under {root} (it has: {', '.join(sorted(seen))}); exported the rest",
            file=sys.stderr,
        )
    if dropped:
        print(
            f"left out {dropped} events of outer steps a resume rolled back (the peer ran them again)",
            file=sys.stderr,
        )
    if len(runs) > 1:  # (merged without a word, a review, stop 72)
        named = ", ".join(f"'{r.split('/')[0]}' of owner {r.split('/')[-1][:8]}" for r in sorted(runs)[:4])
        print(
            f"{root} holds the metrics of {len(runs)} runs ({named}{', ...' if len(runs) > 4 else ''}), "
            "exported together: give one run's folder to export it alone",
            file=sys.stderr,
        )
    rows.sort(key=lambda e: (e.get("time", 0), str(e.get("peer", ""))))
    return rows


def _events_of(
    path: Path, kinds: set[str] | None = None, seen: set[str] | None = None
) -> tuple[list[dict[str, Any]], int, str | None]:
    """One peer's metrics.jsonl, in the order written: its events of ``kinds`` (None: all), how
    many events were left out, and the run they belong to (its last "started" event's ``run``);
    ``seen`` gets the kinds of all its events.

    A peer resumed from a checkpoint older than its last round (``checkpoint.prev.pt`` after a
    corrupt ``checkpoint.pt``, or a kill between checkpoints) runs those outer steps again: the
    events it wrote for them before the resume are left out, as TensorBoard purges the steps
    after a restart, so each outer step is one row. A folder where a run was started over
    (its checkpoints removed, as `start` suggests) holds the events of both: only the last
    run's are kept (each "started" event names its run), and the others are counted. A peer
    resumed from its checkpoint (``resumed_checkpoint`` right after its "started") continues its
    run, though its owner's manifest, published anew, names another.

    Read line by line, the events of other kinds kept as their outer step only, and the keys
    shared: a 137 MB file of 200,000 rounds took 989 MB read whole (its text, its lines, and
    each event's own copy of every key), 430 MB now."""
    events: list[dict[str, Any] | int | None] = []  # an event of another kind: its outer step
    dropped = cut = 0
    run: str | None = None  # the run of the events read so far (its "started" events say it)
    restarted: int | None = None  # where another run's "started" came: a new run unless it resumed
    earlier = 0
    decoder = _shared_keys()
    for number, line, last in _numbered_lines(path):
        if not line.strip():
            continue
        try:
            event = decoder.decode(line)
        except (ValueError, RecursionError):  # not JSON; nested past Python's stack; 5,000 digits
            if last:
                continue  # the last line of a peer still writing (or killed mid-line)
            if not line.startswith('{"event": '):
                raise ExportError(f"{path}:{number} is not a JSON line") from None
            cut += 1  # a peer killed mid-line (or a full disk), then resumed
            # An earlier release wrote the next event onto the cut one: that one is whole (it
            # may be the "started" of a run started over, which the split below needs).
            glued = line.rfind('{"event": ')
            try:
                event = decoder.decode(line[glued:]) if glued > 0 else None
            except (ValueError, RecursionError):
                event = None
            if not isinstance(event, dict):
                continue
        if not isinstance(event, dict):
            continue
        when = event.get("time", 0)
        if not isinstance(when, (int, float)) or isinstance(when, bool) or when != when:
            raise ExportError(
                f"{path}:{number} has a time that is not a number ({when!r}): not a peer's event line"
            )
        kind = event.get("event")
        if seen is not None:
            seen.add(str(kind))
        if restarted is not None and kind != "started":
            # A peer resumed from its checkpoint goes on with its run, whose owner published the
            # manifest anew (another "run": a resumed run's history was left out, a review)
            if kind != "resumed_checkpoint":
                earlier += restarted
                events = events[restarted:]
            restarted = None
        if kind == "started" and isinstance(event.get("run"), str):
            if run is not None and event["run"] != run:  # another run in the same folder, or a resume
                restarted = len(events)
            run = event["run"]
        step = event.get("outer_step")
        if kind == "resumed_checkpoint" and isinstance(step, int):
            kept = [e for e in events if not (isinstance(s := _step_of(e), int) and s > step)]
            dropped += len(events) - len(kept)
            events = kept
        events.append(event if kinds is None or kind in kinds else step if isinstance(step, int) else None)
    if cut:
        print(f"{path}: left out {cut} event line(s) cut short (a peer stopped mid-line)", file=sys.stderr)
    if earlier:  # (a run started over in the folder: its rows were mixed with the new run's)
        print(
            f"{path}: left out {earlier} events of an earlier run in the same folder (the last run's "
            "are exported; give each run its own --run-dir to keep both)",
            file=sys.stderr,
        )
    return [e for e in events if isinstance(e, dict)], dropped, run


def _step_of(event: dict[str, Any] | int | None) -> Any:
    return event.get("outer_step") if isinstance(event, dict) else event


def _numbered_lines(path: Path):
    """(number, line, whether it is the file's last) for each line of ``path``, one read ahead."""
    with open(path, errors="replace", newline=None) as lines:
        previous = None
        for number, line in enumerate(lines, 1):
            if previous is not None:
                yield number - 1, previous, False
            previous = line.rstrip("\n")
        if previous is not None:
            yield number, previous, True


def _shared_keys() -> json.JSONDecoder:
    """A JSON decoder whose objects share one copy of each key (json.loads makes one a line)."""
    keys: dict[str, str] = {}
    return json.JSONDecoder(object_pairs_hook=lambda pairs: {keys.setdefault(k, k): v for k, v in pairs})


def _open_out(path: str, run_dir: str):
    target, root = Path(path).resolve(), Path(run_dir).resolve()
    if target.name == "metrics.jsonl" and target.is_relative_to(root):
        # It overwrote the peer's own events with the rows exported (the rest were lost).
        raise ExportError(
            f"--out {path} is a metrics.jsonl under RUN_DIR, where the peers' events are read from: "
            "give another name, e.g. rounds.jsonl"
        )
    if Path(path).is_dir():
        raise ExportError(f"--out {path} is a folder: give a file name, e.g. {Path(path) / 'rounds.csv'}")
    try:
        return open(path, "w", newline="")  # noqa: SIM115
    except OSError as error:
        raise ExportError(f"cannot write --out {path}: {error.strerror or error}") from None


def _kinds(events: str) -> set[str] | None:
    if events.strip() == "all":
        return None
    kinds = {k.strip() for k in events.split(",") if k.strip()}
    if not kinds:
        raise ExportError(
            f"--events {events!r} names no event kind: e.g. --events round,state_downloaded, or all"
        )
    return kinds


def run_export_command(args: argparse.Namespace) -> int:
    for flag in ("out", "events", "tensorboard", "wandb"):
        if getattr(args, flag) is not None and not getattr(args, flag).strip():
            # Taken as absent, it sent JSON lines to stdout where a file or a service was asked for.
            raise ExportError(f"--{flag} is empty: give it a value, or drop it")
    if args.wandb_mode is not None and not args.wandb:
        raise ExportError(  # as `workbench start` says it: it was taken and did nothing
            f"--wandb-mode {args.wandb_mode} logs to a W&B project, and none is given: add --wandb PROJECT"
        )
    if args.tensorboard or args.wandb:
        if args.csv or args.out:
            raise ExportError(
                f"{'--csv' if args.csv else '--out'} writes the table; with --tensorboard or --wandb the "
                "events go there instead: drop it, or export the table in a second command"
            )
        return _replay(args)
    rows = read_events(args.run_dir, _kinds(args.events or "round"))
    out = _open_out(args.out, args.run_dir) if args.out else sys.stdout
    try:
        if args.csv:
            columns: dict[str, None] = {}
            for row in rows:
                columns.update(dict.fromkeys(row))
            writer = csv.DictWriter(out, fieldnames=list(columns), extrasaction="ignore")
            writer.writeheader()
            for row in rows:
                writer.writerow({k: _cell(v) for k, v in row.items()})
        else:
            for row in rows:
                out.write(json.dumps(strict_json(row), allow_nan=False) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    if args.out:
        print(f"wrote {len(rows)} rows to {args.out}", file=sys.stderr)
    return 0


def _cell(value: Any) -> Any:
    """A CSV cell: a text that a spreadsheet would run as a formula (``=HYPERLINK(...)``, a
    peer's name is the peer's to choose) starts with ``'``, and control characters are shown
    as escapes (stdout may be a terminal; a review, stop 69)."""
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if isinstance(value, str):
        value = printable(value)
        return "'" + value if value[:1] in ("=", "+", "-", "@", "\t", "\r") else value
    return value


def _replay(args: argparse.Namespace) -> int:
    """Every peer's events (of ``--events``; default all) into TensorBoard and/or W&B, one run
    per peer."""
    from workbench.run.exporters import make_exporters

    # By folder and name: two runs' peers both named p0 under RUN_DIR went into one TensorBoard
    # run, their steps 1, 2, 3, 1, 2, 3 (a review, 2026-12-06).
    folders: dict[int, str] = {}
    peers: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for event in read_events(args.run_dir, _kinds(args.events or "all"), sources=folders):
        peers.setdefault((folders[id(event)], str(event.get("peer", "peer"))), []).append(event)
    shared = {peer for folder, peer in peers if sum(1 for _, other in peers if other == peer) > 1}
    wandb_dir = Path(args.run_dir)
    if args.wandb and not os.access(wandb_dir, os.W_OK):
        # wandb put them in the temp folder, unsaid (a review, 2026-12-06): here, and said.
        wandb_dir = Path.cwd()
        print(f"{args.run_dir} is read-only: W&B's runs go under {wandb_dir / 'wandb'}", file=sys.stderr)
    for (folder, peer), events in peers.items():
        name = f"{folder}/{peer}" if peer in shared else peer
        exporters = make_exporters(
            tensorboard=str(Path(args.tensorboard) / name) if args.tensorboard else None,
            wandb_project=args.wandb,
            wandb_mode=args.wandb_mode or "offline",
            wandb_dir=wandb_dir,  # wandb writes its runs under <dir>/wandb
            name=name,
        )
        try:
            for event in events:
                for exporter in exporters:
                    exporter.write(event)
        finally:
            for exporter in exporters:
                exporter.close()
        print(f"{name}: {len(events)} events exported", file=sys.stderr)
    return 0
