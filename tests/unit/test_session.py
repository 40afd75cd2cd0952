"""Connecting to a run (swarm.session): which keys hivemind checks for a second user."""

from __future__ import annotations

from swarm.dht import NetworkConfig
from swarm.identity import create_identity
from swarm.records import RunKeys
from swarm.session import connect


class _FakeDHT:
    def __init__(self, calls: list[dict], network: NetworkConfig, fresh_identity: bool) -> None:
        calls.append({"identity": network.identity_path, "fresh": fresh_identity})

    def shutdown(self) -> None:
        pass


def _connect(network: NetworkConfig) -> dict:
    calls: list[dict] = []
    session = connect(
        network,
        RunKeys("session-test"),
        dht_factory=lambda net, validators, *, fresh_identity: _FakeDHT(calls, net, fresh_identity),
    )
    for path in session._cleanup:
        path.unlink(missing_ok=True)
    return calls[0]


def test_only_a_key_kept_across_restarts_is_checked_for_another_user(tmp_path) -> None:
    """hivemind's check that no other peer uses a key starts a second p2p daemon and dials the
    key's id (0.5-1 s of a join): worth it for a kept key (two processes started with one
    --identity), not for a key made just now."""
    assert _connect(NetworkConfig())["fresh"] is True  # a throwaway key
    kept = tmp_path / "identity.key"
    first = _connect(NetworkConfig(identity_path=str(kept)))  # created by this start
    assert first == {"identity": str(kept), "fresh": True} and kept.exists()
    assert _connect(NetworkConfig(identity_path=str(kept)))["fresh"] is False  # the next start
    other = create_identity(tmp_path / "other.key")
    assert _connect(NetworkConfig(identity_path=str(other)))["fresh"] is False
