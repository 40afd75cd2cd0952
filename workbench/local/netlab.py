"""A slow network on one machine: peers in their own Linux network namespaces, each link capped.

    with NetLab(peers=4, rate="100mbit") as lab:
        subprocess.Popen(lab.command(0, ["workbench", "start", "--host", lab.address(0), ...]))

Layout: one bridge on the host (``10.<subnet>.0.1/24``); namespace ``i`` holds ``10.<subnet>.0.<i+2>``
behind a veth pair. Each veth end gets a ``tc tbf`` qdisc, so a peer's upload (its namespace's
egress) and download (the bridge's egress towards it) are each capped at ``rate``, like a home
link. tbf, not netem: netem is missing from some kernels (this development machine's among them).

Needs root (or CAP_NET_ADMIN) and iproute2; :func:`unavailable` says why a machine cannot, so
tests and benchmarks skip with that message.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence


class NetLabError(RuntimeError):
    pass


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode:
        raise NetLabError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


def _tc(*args: str, netns: str | None = None) -> None:
    argv = [*(["ip", "netns", "exec", netns] if netns else []), "tc", *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise NetLabError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


def unavailable() -> str | None:
    """Why network namespaces with tc caps cannot be made here, or None if they can."""
    if not shutil.which("ip") or not shutil.which("tc"):
        return "iproute2 (`ip`, `tc`) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (or CAP_NET_ADMIN)"
    # Everything a lab does, once: a namespace, a veth pair into it, a tbf qdisc on each end
    # (a container may allow namespaces but not veth pairs, or lack the tbf module).
    tag = f"wbp{os.getpid() % 100000}"
    steps = [
        ["ip", "netns", "add", tag],
        ["ip", "link", "add", f"{tag}h", "type", "veth", "peer", "name", f"{tag}p"],
        ["ip", "link", "set", f"{tag}p", "netns", tag],
        [
            "tc",
            "qdisc",
            "add",
            "dev",
            f"{tag}h",
            "root",
            "tbf",
            "rate",
            "1mbit",
            "burst",
            "32kb",
            "latency",
            "100ms",
        ],
    ]
    try:
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode:
                return f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}"
    finally:
        _ip("link", "del", f"{tag}h", check=False)
        _ip("netns", "del", tag, check=False)
    return None


class NetLab:
    """``peers`` network namespaces on one bridge, every link capped at ``rate`` (tc syntax:
    ``100mbit``, ``20mbit``, ``1gbit``); ``rate=None`` leaves the links uncapped.

    Stop every process started in a namespace (and its children: a peer's p2p daemon) before
    leaving the ``with`` block; a namespace lives on while a process holds it."""

    _made_here = 0

    def __init__(self, peers: int, rate: str | None = "100mbit", *, burst: str = "64kb") -> None:
        if peers < 1:
            raise ValueError(f"a lab needs at least one peer, got {peers}")
        self.peers, self.rate, self.burst = peers, rate, burst
        NetLab._made_here += 1
        self._name((os.getpid() * 7 + NetLab._made_here) % 10000)
        self._made: list[str] = []

    def _name(self, tag: int) -> None:
        """Names (short: 15-character links) and a subnet for the lab ``tag``."""
        self.tag = tag
        self.subnet = 100 + tag % 150  # 10.<subnet>.0.0/24, away from the usual 10.0.x.x
        self.bridge = f"wbbr{tag}"
        self.namespaces = [f"wb{tag}n{i}" for i in range(self.peers)]

    def _free_tag(self) -> None:
        """Move to the first tag from this one whose names and subnet nothing here holds: a lab
        of a killed run stays (its namespaces, its bridge and its route), and two process ids
        10,000 apart, or 150 tags apart, picked the same names ("File exists") or subnet (two
        routes to one 10.x.0.0/24: packets went to the other lab's bridge)."""
        links = _ip("-o", "link", "show", check=False).stdout
        names = set(re.findall(r"^\d+: ([^:@\s]+)", links, re.MULTILINE))
        names |= {line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line}
        subnets = {
            int(n) for n in re.findall(r"\b10\.(\d+)\.0\.0/24\b", _ip("-o", "route", check=False).stdout)
        }
        for step in range(150):
            tag = (self.tag + step) % 10000
            if 100 + tag % 150 in subnets or f"wbbr{tag}" in names:
                continue
            if not any(f"wb{tag}n{i}" in names for i in range(self.peers)):
                self._name(tag)
                return
        raise NetLabError(
            "no free lab name or 10.x.0.0/24 subnet is left here: remove old labs (ip netns list)"
        )

    def address(self, i: int) -> str:
        return f"10.{self.subnet}.0.{i + 2}"

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside namespace ``i``."""
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def __enter__(self) -> NetLab:
        reason = unavailable()
        if reason:
            raise NetLabError(reason)
        self._free_tag()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append("bridge")
            _ip("addr", "add", f"10.{self.subnet}.0.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.namespaces):
                host_end, ns_end = f"{ns}h", f"{ns}p"
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
                _ip("link", "set", ns_end, "netns", ns)
                _ip("link", "set", host_end, "master", self.bridge)
                _ip("link", "set", host_end, "up")
                _ip("addr", "add", f"{self.address(i)}/24", "dev", ns_end, netns=ns)
                _ip("link", "set", ns_end, "up", netns=ns)
                _ip("link", "set", "lo", "up", netns=ns)
                if self.rate:
                    tbf = ["root", "tbf", "rate", self.rate, "burst", self.burst, "latency", "100ms"]
                    _tc("qdisc", "add", "dev", host_end, *tbf)  # the peer's download
                    _tc("qdisc", "add", "dev", ns_end, *tbf, netns=ns)  # its upload
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for name in reversed(self._made):
            if name == "bridge":
                _ip("link", "del", self.bridge, check=False)
            else:
                _ip("link", "del", f"{name}h", check=False)  # the veth pair, even if the namespace lingers
                _ip("netns", "del", name, check=False)
        self._made.clear()
