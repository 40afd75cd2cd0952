"""Peer addresses: parse and check multiaddrs before hivemind ever sees them.

A join address is a multiaddr that ends in the peer's id, e.g.
``/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...``. hivemind itself fails on a bad one with a
traceback from deep inside its daemon, or waits; here every mistake gets a one-line
:class:`AddressError` that says what to fix.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

from multiaddr import Multiaddr

from swarm.errors import SwarmError

EXAMPLE = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
_NETWORK = {"ip4", "ip6", "dns", "dns4", "dns6"}
_TRANSPORT = {"tcp", "udp"}


class AddressError(SwarmError):
    """A multiaddr given by the user is malformed or unusable."""


def parse_peer_address(text: str) -> Multiaddr:
    """Parse one bootstrap address; it must name a host, a port and the peer's id."""
    text = text.strip()
    if not text:
        raise AddressError(
            f"empty peer address; paste the full multiaddr the first peer printed, e.g. {EXAMPLE}"
        )
    if not text.startswith("/"):
        hint = ""
        if ":" in text and "/" not in text:
            host, _, port = text.rpartition(":")
            hint = f" (for {text} write {_host_part(host.strip('[]'))}/tcp/{port}/p2p/<peer id>)"
        raise AddressError(f"'{text}' is not a multiaddr{hint}; it must look like {EXAMPLE}")
    try:
        address = Multiaddr(text)
    except Exception as error:  # py-multiaddr raises several ParseError/ValueError subclasses
        reason = str(error).split(": ", 1)[-1].split(" (string:")[0]
        if "/p2p/" in text and "CID" in reason:
            reason = f"the peer id after /p2p/ is not valid ({reason})"
        raise AddressError(f"malformed multiaddr '{text}': {reason}; expected e.g. {EXAMPLE}") from None
    names = [protocol.name for protocol in address.protocols()]
    if not names or names[0] not in _NETWORK:
        raise AddressError(f"'{text}' does not start with a host (/ip4/, /ip6/ or /dns/); e.g. {EXAMPLE}")
    if not _TRANSPORT & set(names):
        raise AddressError(f"'{text}' has no port (/tcp/PORT or /udp/PORT/quic); e.g. {EXAMPLE}")
    if "udp" in names and not {"quic", "quic-v1"} & set(names):
        raise AddressError(
            f"'{text}': a /udp/PORT address needs /quic or /quic-v1 after it (or use /tcp/PORT)"
        )
    if "p2p" not in names:
        raise AddressError(
            f"'{text}' lacks the peer id: append /p2p/<peer id> as printed by `workbench start` "
            "(hivemind only connects to a peer it can authenticate)"
        )
    if names[-1] != "p2p":
        raise AddressError(f"'{text}' has parts after /p2p/<peer id>; the peer id must come last")
    if _port_zero(address, names):
        raise AddressError(f"'{text}' has port 0; use the port the running peer printed")
    return address


def _port_zero(address: Multiaddr, names: list[str]) -> bool:
    return any(int(address.value_for_protocol(t)) == 0 for t in _TRANSPORT & set(names))


def _host_part(host: str) -> str:
    """/ip4/H, /ip6/H or /dns4/H for a host written without a protocol."""
    try:
        return f"/ip{ipaddress.ip_address(host).version}/{host}"
    except ValueError:
        return f"/dns4/{host}"


def peer_ids(texts: Iterable[str]) -> list[str]:
    """The peer ids (base58) the bootstrap addresses name, in order, each once: the last
    ``/p2p/`` part (before it, through a relay, the relay's); a bad address raises
    :class:`AddressError` as :func:`parse_peer_address` does."""
    ids = (str(parse_peer_address(text)).rpartition("/p2p/")[2] for text in texts)
    return list(dict.fromkeys(ids))


def parse_peer_addresses(texts: Iterable[str]) -> list[Multiaddr]:
    """Parse several bootstrap addresses; at least one is needed to join."""
    addresses = [parse_peer_address(text) for text in texts]
    if not addresses:
        raise AddressError(f"give at least one peer address to join, e.g. workbench join {EXAMPLE}")
    return addresses


def listen_address(host: str, port: int) -> str:
    """The multiaddr hivemind should listen on for ``--host``/``--port``."""
    if not 0 <= port < 65536:
        raise AddressError(f"--port must be in 0..65535 (got {port}); 0 picks a free port")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise AddressError(
            f"--host must be an IP address to listen on (got '{host}'); use 0.0.0.0 for all interfaces"
        ) from None
    if getattr(ip, "scope_id", None):  # fe80::1%eth0: multiaddrs have no zone (hivemind failed later)
        raise AddressError(
            f"--host {host}: a link-local IPv6 address with a zone cannot be listened on; give a "
            "global IPv6 address, an IPv4 one, or 0.0.0.0"
        )
    return f"/ip{ip.version}/{ip}/tcp/{port}"


def parse_announce_addresses(texts: Sequence[str]) -> list[str]:
    """``--announce`` addresses: public host and port others should dial (no peer id)."""
    result = []
    for text in texts:
        try:
            address = Multiaddr(text)
        except Exception as error:
            reason = str(error).split(": ", 1)[-1].split(" (string:")[0]
            raise AddressError(
                f"malformed --announce multiaddr '{text}': {reason}; e.g. /ip4/203.0.113.7/tcp/31337"
            ) from None
        names = [protocol.name for protocol in address.protocols()]
        if "p2p" in names:
            raise AddressError(f"--announce '{text}' must not include /p2p/: the peer id is added for you")
        if not names or names[0] not in _NETWORK or not _TRANSPORT & set(names):
            raise AddressError(
                f"--announce '{text}' needs a host and a port, e.g. /ip4/203.0.113.7/tcp/31337"
            )
        if names[1:] != ["tcp"]:  # /udp/5, /tcp/1/p2p-circuit, /tcp/5/http: nobody could dial them
            raise AddressError(
                f"--announce '{text}' must be a host and a TCP port, nothing more (this peer listens on "
                "TCP): e.g. /ip4/203.0.113.7/tcp/31337 or /dns4/peer.example.org/tcp/31337"
            )
        host = address.value_for_protocol(names[0])
        if names[0] in ("ip4", "ip6") and plain_ip(host).is_unspecified:
            raise AddressError(
                f"--announce '{text}': {host} is no address others can dial (it means every interface "
                "here): give this machine's public IP, as others reach it"
            )
        if _port_zero(address, names):
            raise AddressError(
                f"--announce '{text}' has port 0: others cannot dial it; give the port this peer "
                "listens on (--port) or the one your router forwards to it"
            )
        if str(address) not in result:
            result.append(str(address))
    return result


def reached_at(host: str, connections: Iterable[Multiaddr]) -> bool:
    """Is ``host`` (an IP literal another peer names as its own listener) the far end of one of
    this peer's connections to it (``connections``: their remote multiaddrs, as hivemind's
    daemon lists them)? A relayed connection's IP is the relay's, so it vouches for nothing."""
    try:
        ip = plain_ip(host)
    except ValueError:
        return False
    return ip in direct_ips(connections)


def direct_ips(addresses: Iterable[Multiaddr]) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IPs of ``addresses`` (multiaddrs, as hivemind's daemon lists connections or its own
    listeners), in order, but relayed ones (the IP is the relay's) and those without an IP."""
    found = []
    for address in addresses:
        names = [protocol.name for protocol in address.protocols()]
        if names[:1] == ["ip6zone"] and "ip6" in names:
            # A link-local connection (/ip6zone/eth0/ip6/fe80::...; this multiaddr release lists
            # a made-up ip4 between them): the peer at fe80::, not "this machine".
            names = names[names.index("ip6") :]
        if "p2p-circuit" in names or not names or names[0] not in ("ip4", "ip6"):
            continue
        try:
            found.append(plain_ip(address.value_for_protocol(names[0])))
        except ValueError:
            continue
    return found


def plain_ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The IP ``text`` names, an IPv4-mapped IPv6 one as its IPv4 (``::ffff:127.0.0.1`` is
    loopback, and the same peer as ``127.0.0.1``); ValueError if it is none."""
    ip = ipaddress.ip_address(text)
    return ip.ipv4_mapped if ip.version == 6 and ip.ipv4_mapped is not None else ip


def origin(ip: str) -> str:
    """What one party's connections have in common: an IPv4 address, or the /64 of an IPv6 one
    (whoever holds one address of a /64 usually holds them all)."""
    try:
        parsed = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if parsed.version == 6 and parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    if parsed.version == 6 and parsed.is_link_local:
        # Every host of a link holds fe80::/64: each address is its own party (as one /64 all
        # the LAN's joiners shared one host's limits, a review, stop 72; one host can take many,
        # as it could when these counted as this machine, and the total caps still hold).
        return str(parsed)
    if parsed.version == 6:
        return str(ipaddress.ip_network(f"{parsed}/64", strict=False))
    return str(parsed)


def far_ip(connections: Iterable[Multiaddr], mine: Iterable[str] = ()) -> str | None:
    """The :func:`origin` of the address another peer is connected from (``connections``: their
    remote multiaddrs, as hivemind's daemon lists them), None when it is on this machine
    (loopback, or one of this peer's own addresses, ``mine``) or reached only through a relay
    (whose IP says nothing of the peer's)."""
    ip = next(iter(direct_ips(connections)), None)
    return None if ip is None or ip.is_loopback or str(ip) in set(mine) else origin(str(ip))
