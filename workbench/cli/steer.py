"""`workbench steer MULTIADDR --key OWNER_KEY ...`: change a live run as its owner.

Publishes a new version of the run's ControlState (signed with the owner's key file, the
``--identity`` of `workbench start`, or ``<run-dir>/identity.key``), then follows its
propagation until every live peer reports it applied ("3/4 peers applied v7").
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from swarm.bounds import parser as bounded
from swarm.errors import SwarmError
from workbench.settings.commands import command_settings


def add_steer_parser(commands) -> None:
    from workbench.cli.status import add_observer_options

    parser = commands.add_parser(
        "steer",
        help="change a live run's outer lr, H or codec, pause/resume a peer (owner only)",
        description="Publish a steering change to a live run, signed with the owner's key. Example:\n"
        "  workbench steer /ip4/127.0.0.1/tcp/31337/p2p/QmXyz... --key run/identity.key --outer-lr 0.5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("peers", nargs="+", metavar="MULTIADDR", help="any peer of the run")
    add_observer_options(parser)
    parser.add_argument("--key", required=True, metavar="FILE", help="the run owner's key file")
    # The settings a steering record may change: the schema's, with what the change means here.
    settings = command_settings("start")
    settings["outer_lr"].add_to(parser, default=None, help="new outer learning rate")
    settings["inner_steps"].add_to(parser, default=None, help="new inner steps per round")
    settings["round_seconds"].add_to(
        parser, default=None, help="time-boxed rounds of T seconds of inner steps (0: back to H steps each)"
    )
    settings["update_codec"].add_to(parser, help="new pseudo-gradient codec")
    parser.add_argument(
        "--pause", action="append", default=[], metavar="PEER", help="pause a peer (id or name)"
    )
    parser.add_argument("--resume", action="append", default=[], metavar="PEER", help="resume a paused peer")
    parser.add_argument("--checkpoint", action="store_true", help="ask every peer to write a checkpoint now")
    parser.add_argument(
        "--from-step",
        type=bounded("from_step"),
        help="outer step to apply at (default: 2 rounds ahead; one before a change not applied yet replaces it)",
    )
    parser.add_argument(
        "--wait",
        type=bounded("wait"),
        default=60.0,
        help="seconds to follow propagation (0: do not wait; default 60)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run_steer_command(args: argparse.Namespace) -> int:
    from swarm.identity import key_hash
    from swarm.manifest import find_manifest, owner_mismatch
    from swarm.records import RunKeys, Stage, check_owner, refused
    from swarm.steering import Steering, aliases_of, live_peer_id
    from workbench.cli.status import observer_settings, open_observer

    observer_settings(args)
    RunKeys(args.run_id, args.secret)
    check_owner(args.owner)
    if (
        not any(
            [args.outer_lr, args.inner_steps, args.update_codec, args.pause, args.resume, args.checkpoint]
        )
        and args.round_seconds is None
    ):
        raise SwarmError(
            "nothing to change: give --outer-lr, --inner-steps, --round-seconds, --update-codec, --pause, "
            "--resume or --checkpoint"
        )
    empty = [
        flag
        for flag, peers in (("--pause", args.pause), ("--resume", args.resume))
        if any(not p.strip() for p in peers)
    ]
    if empty:  # checked before connecting (it failed after, as "no live peer is named")
        raise SwarmError(
            f"{empty[0]} is empty: name a peer by its id or name (`workbench status` lists them)"
        )
    both = sorted(set(args.pause) & set(args.resume))
    if both:
        raise SwarmError(f"--pause and --resume both name {', '.join(both)}: give one of them")
    session, _ = open_observer(args, signing_key=args.key)
    try:
        # The owner's own key always steers its own run, whatever else claims the run id.
        mine = key_hash(session.store.public_key)
        manifest = find_manifest(session.store, session.keys, owner=args.owner or mine, timeout=3.0)
        if manifest is None and not args.owner:
            manifest = find_manifest(session.store, session.keys)
        if manifest is None:
            raise SwarmError(
                owner_mismatch(session.store, session.keys, args.owner)
                or f"run '{args.run_id}' has no manifest in the DHT: is its first peer still running?"
            )
        steering = Steering(session.store, session.keys, owner=manifest.owner, board=session.board)
        current = steering.current()
        paused = list(current.paused) if current else []
        live = session.board.fetch() if (args.pause or args.resume) else {}

        # A typo would sit in the record, pausing nobody (or a later peer of that name); and a
        # name is anyone's to take, so the record names the peer's id.
        pause_ids = [live_peer_id(peer, live) for peer in args.pause]
        not_paused = [p for p in args.resume if not aliases_of(p, live) & set(paused)]
        if not_paused:
            raise SwarmError(
                f"{', '.join(not_paused)} is not paused (paused: {', '.join(paused) or 'nobody'})"
            )
        resumed = set().union(*(aliases_of(p, live) for p in args.resume))
        # As changes to the record as it is when published: the list read above, seconds
        # earlier, dropped a pause another UI made meanwhile (the TUI's fix, stop 57; a review).
        control = steering.publish(
            outer_lr=args.outer_lr,
            inner_steps=args.inner_steps,
            codec=args.update_codec,
            round_seconds=args.round_seconds,
            pause=pause_ids or None,
            resume=sorted(resumed) or None,
            checkpoint=args.checkpoint,
            from_step=args.from_step,
        )
        if not args.json:
            # What this version changes, not the whole record: `--resume beta` printed
            # {'outer_lr': 0.5}, an lr set two versions earlier, and not the resume (a review).
            before = current.changes() if current else {}
            changed = {k: v for k, v in control.changes().items() if k != "paused" and before.get(k) != v}
            moves = [
                f"paused {', '.join(pause_ids)}" if pause_ids else "",
                f"resumed {', '.join(args.resume)}" if args.resume else "",
            ]
            said = "; ".join(m for m in moves if m)
            print(
                f"published control v{control.version} (from outer step {control.from_step}): "
                f"{changed or 'no setting changed'}{'; ' + said if said else ''}"
            )
        deadline = time.monotonic() + args.wait
        applied, total, peers, refusals = 0, 0, {}, {}
        while True:
            peers = session.board.fetch()
            applied, total = steering.propagation(peers, control.version)
            refusals = refused(peers.values(), control.version)
            if not args.json:
                print(f"{applied}/{total} peers applied v{control.version}", flush=True)
            if (total and applied + len(refusals) >= total) or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        # Heartbeats are anyone's to publish: name the peers that did not apply it, so that one
        # that never will (not the run's) is told from one still training its round.
        missing = {
            i: p.name
            for i, p in peers.items()
            if p.stage is not Stage.PAUSED and p.control_version < control.version and i not in refusals
        }
        if args.json:
            print(
                json.dumps(
                    {
                        "control": control.model_dump(mode="json"),
                        "applied": applied,
                        "peers": total,
                        "not_applied": sorted(missing),
                        "refused": refusals,
                    }
                )
            )
        if refusals:
            # A value the run cannot take: nothing of the version applies on these peers, and
            # every later change carries it (a change is made on top of the last): say which.
            first = next(iter(refusals))
            # Pauses are not tied to a step: the record's list holds whatever its version (it
            # said "apply nothing of it" while the peer paused, a review, stop 71).
            pauses = (
                " (its --pause/--resume apply all the same: pauses are not tied to an outer step)"
                if args.pause or args.resume
                else ""
            )
            print(
                f"error: {len(refusals)} peer(s) refused v{control.version} and apply none of its settings: "
                f"{peers[first].name if first in peers else first[-8:]}: {refusals[first]}{pauses} (later "
                f"changes carry v{control.version}'s values: publish one the run takes, e.g. another "
                "--inner-steps or --update-codec)",
                file=sys.stderr,
            )
            return 1
        if args.wait and total and applied < total:
            names = ", ".join(f"{name} ({i[-8:]})" for i, name in list(missing.items())[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            print(
                f"not every peer applied v{control.version} within {args.wait:.0f} s: {names}{more} did not "
                "(a peer applies it at the start of its round; see `workbench status`)",
                file=sys.stderr,
            )
            return 1
        return 0
    finally:
        session.close()
