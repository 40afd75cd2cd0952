"""`workbench doctor MULTIADDR...`: why can't I join? Each check says what is wrong and the fix.

Checks, in order: the addresses parse; each bootstrap peer's TCP port answers; the DHT
bootstraps through them; what addresses this machine would announce (public, private or
loopback only: reachable from outside, or only as a client / via a relay); the run (its
manifest and live peers, with ``--run-id``); versions of workbench, hivemind and the record
protocol. Exit status 0 when nothing failed, 2 when an address is malformed, 1 when another
check failed. The port probe waits up to ``--connect-timeout`` seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import socket
from dataclasses import asdict, dataclass

from swarm.errors import SwarmError

PROTOCOL = "workbench-records/3"
"""Version of the DHT record layout (swarm.records); peers with another one cannot see each other.
2 (stop 57): a steering record holds the versions before it (``earlier``), which peers of layout
1 refuse as malformed: they apply no steering of a run whose owner runs layout 2.
3 (stop 58): donors declare their state under their signed ``[owner:...]`` key (``RunKeys.donors``),
which the run's nodes require: joiners of layout 2 find no donor of layout 3, and the reverse."""


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail | info
    detail: str
    fix: str = ""


def add_doctor_parser(commands) -> None:
    from workbench.cli.status import add_observer_options

    parser = commands.add_parser(
        "doctor",
        help="check the connection to a swarm and say how to fix what is wrong",
        description="Diagnose joining a swarm: bootstrap peers, this peer's reachability, versions.",
        epilog="example:\n  workbench doctor /ip4/192.0.2.7/tcp/31337/p2p/QmXyz... --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "peers", nargs="+", metavar="MULTIADDR", help="the bootstrap peers you would join through"
    )
    add_observer_options(parser)
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def _tcp_target(address) -> tuple[str, int] | None:
    host = port = None
    for proto in address.protocols():
        if proto.name in ("ip4", "ip6", "dns", "dns4", "dns6"):
            host = address.value_for_protocol(proto.code)
        if proto.name == "tcp":
            port = int(address.value_for_protocol(proto.code))
    return (host, port) if host and port else None


def _kind(ip: str) -> str:
    try:
        parsed = ipaddress.ip_address(ip)
    except ValueError:
        return "name"
    if parsed.is_loopback:
        return "loopback"
    return "private" if parsed.is_private else "public"


MULTISTREAM = b"\x13/multistream/1.0.0\n"
"""What a libp2p listener (a peer's hivemind daemon) sends first on every TCP connection."""


def speaks_libp2p(host: str, port: int, *, timeout: float) -> bool | None:
    """Whether what answers at ``host:port`` is a libp2p listener (None: could not tell)."""
    try:
        probe = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None
    first = b""
    with probe:
        probe.settimeout(min(timeout, 2.0))
        try:
            while len(first) < len(MULTISTREAM):
                chunk = probe.recv(len(MULTISTREAM) - len(first))
                if not chunk:
                    break
                first += chunk
        except TimeoutError:
            return False  # (a web server waits for a request: nothing comes)
        except OSError:
            return None
    return first == MULTISTREAM


def probe_port(host: str, port: int, *, timeout: float) -> Check:
    """Whether ``host:port`` accepts a TCP connection within ``timeout`` seconds; when it does
    not, the fix for what the error says (the name, nothing listening, no answer, no route)."""
    name = f"port {host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except socket.gaierror as error:
        return Check(
            name,
            "fail",
            f"the name {host} does not resolve ({error.strerror})",
            "check the name's spelling, or use the IP address the peer printed (/ip4/A.B.C.D/...)",
        )
    except ConnectionRefusedError:
        if _kind(host) == "loopback" or host == "localhost":
            fix = f"is the peer running on this machine? check port {port} against the address it printed"
        else:
            kind = {"name": "dns4"}.get(
                _kind(host), "ip6" if ":" in host else "ip4"
            )  # /ip4/NAME is no address
            fix = (
                f"is the peer running, with --port {port}? A peer started with the default "
                "--host 127.0.0.1 listens on its own machine only: restart it with --host 0.0.0.0 "
                f"--port {port} --announce /{kind}/{host}/tcp/{port}"
            )
        return Check(name, "fail", "connection refused: nothing listens there", fix)
    except TimeoutError:
        return Check(
            name,
            "fail",
            f"no answer within {timeout:g} s (see --connect-timeout)",
            f"a firewall or NAT between here and {host} drops the connection: open TCP port {port} "
            "on the peer's machine (and forward it on its router), and check that the peer's "
            "--announce names an address reachable from here",
        )
    except OSError as error:
        return Check(
            name,
            "fail",
            f"cannot connect: {error.strerror or error}",
            f"this machine has no route to {host}: check the address and this machine's network",
        )
    return Check(name, "ok", "the TCP port answers")


def diagnose(args: argparse.Namespace) -> list[Check]:
    import importlib.metadata

    from swarm.addresses import parse_peer_addresses
    from swarm.records import RunKeys, check_owner

    check_owner(args.owner)  # a malformed --owner is the user's to fix: one line, exit 2
    # So is a --secret too short or a bad --run-id: said now, not as a failed bootstrap after the
    # port probes ("check the address and that the peer's firewall lets TCP in").
    from workbench.cli.status import observer_settings

    observer_settings(args)
    RunKeys(args.run_id, args.secret)
    checks: list[Check] = []
    try:
        version = importlib.metadata.version("swarm-workbench")
    except importlib.metadata.PackageNotFoundError:
        version = "source checkout"
    checks.append(
        Check("versions", "info", f"workbench {version}, hivemind {_hivemind_version()}, {PROTOCOL}")
    )
    checks.append(device_check())
    try:
        addresses = parse_peer_addresses(args.peers)
    except SwarmError as error:
        checks.append(
            Check(
                "addresses", "fail", str(error), "paste the address exactly as `workbench start` printed it"
            )
        )
        return checks
    checks.append(Check("addresses", "ok", f"{len(addresses)} well-formed multiaddr(s) with peer ids"))
    for address in addresses:
        target = _tcp_target(address)
        if target is None:
            checks.append(Check(f"port of {address}", "info", "not a TCP address; skipped"))
            continue
        checks.append(probe_port(*target, timeout=args.connect_timeout))
    ports = [c for c in checks if c.name.startswith("port ")]
    if ports and all(c.status == "fail" for c in ports):
        checks.append(Check("bootstrap", "fail", "skipped: no bootstrap peer's port answers", ports[0].fix))
        return checks
    try:
        session, read = _observer(args)
    except SwarmError as error:
        # A port that answers and a DHT that reached nobody: not a firewall (a daemon that did not
        # start, or another hivemind version, fail otherwise and keep the general advice).
        answered = any(c.status == "ok" for c in ports) and "could not reach any bootstrap peer" in str(error)
        targets = [t for t in map(_tcp_target, addresses) if t is not None]
        # A web server (or anything else) on that port said "check the peer id" too (a review).
        strangers = [
            f"{host}:{port}"
            for host, port in targets
            if answered and speaks_libp2p(host, port, timeout=args.connect_timeout) is False
        ]
        if strangers:
            fix = (
                f"something answers at {', '.join(strangers)}, but not a peer (no libp2p there): check "
                "the port against the one the peer printed in its join command"
            )
        elif answered:
            fix = (
                "its TCP port answers, so something listens there, but not the peer named by the address's "
                "/p2p/ id: check that id against the one the peer printed (a peer started with another "
                "--run-dir or key file has a new id)"
            )
        else:
            fix = "check the address and that the peer's firewall lets TCP in"
        checks.append(Check("bootstrap", "fail", str(error), fix))
        return checks
    try:
        checks.append(Check("bootstrap", "ok", "joined the DHT through the given peers"))
        checks.extend(_reachability([t for t in map(_tcp_target, addresses) if t is not None]))
        checks.extend(_run_checks(args, session, read))
    finally:
        session.close()
    return checks


def device_check() -> Check:
    """Where a peer started here would train: the GPU torch sees, or the CPU, and why (a CPU
    build of torch on a machine with an NVIDIA driver trains on the CPU without a word)."""
    import os
    import shutil

    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return Check(
            "device", "ok",
            f"torch {torch.__version__} sees {count} CUDA device(s), the first a {torch.cuda.get_device_name(0)}: "
            "peers train there with bf16 autocast (--device auto)",
        )  # fmt: skip
    driver = shutil.which("nvidia-smi") is not None or os.path.exists("/proc/driver/nvidia/version")
    if driver and torch.version.cuda is None:
        return Check(
            "device", "warn",
            f"this machine has an NVIDIA driver but torch {torch.__version__} is a CPU build: peers will train on the CPU",
            "install a CUDA build of the same version (pip install torch==" + torch.__version__.split("+")[0]
            + " from PyPI on Linux, or from https://download.pytorch.org/whl/ for another CUDA), then run doctor again",
        )  # fmt: skip
    if driver:
        return Check(
            "device", "warn",
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU although an NVIDIA "
            "driver is installed: peers will train on the CPU",
            "check `nvidia-smi`: a driver older than this torch's CUDA, or CUDA_VISIBLE_DEVICES hiding the GPUs",
        )  # fmt: skip
    return Check("device", "info", f"torch {torch.__version__}, no GPU: peers train on the CPU")


def _hivemind_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("hivemind")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _observer(args: argparse.Namespace):
    from workbench.cli.status import open_observer

    return open_observer(args)


def _reachability(targets: list[tuple[str, int]]) -> list[Check]:
    """What others would dial: the address this machine reaches the bootstrap peers from (the
    one the OS routes through; a UDP socket's connect sends nothing). The observer's own DHT
    listens on 127.0.0.1 whatever this machine has, so its addresses said "loopback only" on
    every machine (before stop 57)."""
    mine = []
    for host, port in targets:
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((host, port))
                mine.append(probe.getsockname()[0])
        except OSError:
            continue
    kinds = {_kind(ip): ip for ip in mine}
    if not kinds:
        return [Check("reachability", "info", "no route from this machine to the bootstrap peers' addresses")]
    if "public" in kinds:
        ip = kinds["public"]
        return [
            Check(
                "reachability",
                "ok",
                f"this machine reaches the swarm from a public address, {ip}: others can dial it if no "
                "firewall is in the way",
                f"start or join with --host 0.0.0.0 --port PORT --announce /ip{6 if ':' in ip else 4}/{ip}/tcp/PORT",
            )
        ]
    if "private" in kinds:
        return [
            Check(
                "reachability",
                "warn",
                f"this machine reaches the swarm from a private (LAN) address, {kinds['private']}: peers "
                "outside your network cannot dial you",
                "forward a port and pass --host 0.0.0.0 --port PORT --announce /ip4/PUBLIC_IP/tcp/PORT, "
                "or join with --client-mode (you can average, but not serve state to newcomers); "
                "hivemind relays connections through public peers when they allow it",
            )
        ]
    return [
        Check(
            "reachability",
            "warn",
            "the bootstrap peers are on this machine (loopback): only peers on this machine can dial them",
            "for other machines pass --host 0.0.0.0 and --announce /ip4/PUBLIC_IP/tcp/PORT, or join with --client-mode",
        )
    ]


def _run_checks(args: argparse.Namespace, session, read) -> list[Check]:
    from swarm.manifest import find_manifest

    reading = read()
    checks = []
    other = None
    if reading.manifest is None and args.owner:
        try:  # any owner's: the run may be there, owned by another key
            other = find_manifest(session.store, session.keys, timeout=0.0)
        except SwarmError:  # the DHT did not answer in time: the check below says "not found"
            other = None
        if other is not None and other.owner == args.owner:  # it arrived between the two reads
            reading = dataclasses.replace(reading, manifest=other)
            other = None
    if other is not None:  # the run is there, owned by another key than --owner says
        checks.append(
            Check(
                f"run '{args.run_id}'",
                "fail",
                f"no manifest by owner {args.owner}, only one by {other.owner}",
                "check --owner against the join command the run's `workbench start` printed "
                "(or drop --owner to trust the oldest manifest)",
            )
        )
    elif reading.manifest is None:
        checks.append(
            Check(
                f"run '{args.run_id}'",
                "fail" if not reading.peers else "warn",
                "no manifest found" + ("" if reading.peers else " and no live peer"),
                "check --run-id (and --secret for a private run) against the run's join command",
            )
        )
    else:
        m = reading.manifest
        checks.append(
            Check(f"run '{args.run_id}'", "ok", f"owner {m.owner}, model {m.fingerprint} ({m.summary})")
        )
    live = [p for p in reading.peers.values() if p.stage.value != "leaving"]
    if live:
        top = max(p.outer_step for p in live)
        checks.append(Check("peers", "ok", f"{len(live)} live peer(s), outer round {top}"))
    return checks


def run_doctor_command(args: argparse.Namespace) -> int:
    checks = diagnose(args)
    if args.json:
        print(json.dumps([asdict(c) for c in checks]))
    else:
        marks = {
            "ok": "[green]ok  [/green]",
            "warn": "[yellow]warn[/yellow]",
            "fail": "[red]FAIL[/red]",
            "info": "info",
        }
        from rich.console import Console
        from rich.markup import escape

        console = Console(highlight=False, soft_wrap=True)  # a multiaddr is never split over lines
        for c in checks:  # details name what the user typed: brackets in it are not markup
            console.print(f"{marks[c.status]}  {escape(c.name)}: {escape(c.detail)}")
            if c.fix:
                console.print(f"      fix: {escape(c.fix)}")
    if any(c.name == "addresses" and c.status == "fail" for c in checks):
        return 2  # a malformed address: the user's input, as with every other command
    return 1 if any(c.status == "fail" for c in checks) else 0
