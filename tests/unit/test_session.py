"""Connecting to a run (swarm.session): which keys hivemind checks for a second user."""

from __future__ import annotations

from swarm.dht import NetworkConfig
from swarm.identity import create_identity, remove_ephemeral
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
        remove_ephemeral(path)
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


def test_a_key_file_is_never_readable_by_others_and_two_creators_share_one_key(tmp_path, monkeypatch) -> None:
    """Stop 57, a review: hivemind wrote the key under the user's umask (0644) and chmodded it
    afterwards: another user opened it in between (5 of 6 tries) and kept the key; two peers
    given one --identity both took theirs for fresh, and one signed with another key than its
    daemon loaded."""
    import os
    import stat
    import threading

    from hivemind.p2p import P2P

    from swarm.identity import load_private_key, make_identity

    written = []
    real = P2P.generate_identity

    def generate(path):
        real(path)
        written.append(path)

    seen_modes = []
    real_chmod = os.chmod

    def chmod(path, mode, *args, **kwargs):  # the mode the key had before hivemind's chmod
        seen_modes.append(stat.S_IMODE(os.stat(path).st_mode))
        return real_chmod(path, mode, *args, **kwargs)

    monkeypatch.setattr(P2P, "generate_identity", staticmethod(generate))
    monkeypatch.setattr(os, "chmod", chmod)
    key = tmp_path / "id.key"
    created = []
    threads = [threading.Thread(target=lambda: created.append(make_identity(key))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(created) == [False, False, False, True]
    assert seen_modes and all(mode & 0o077 == 0 for mode in seen_modes), [oct(m) for m in seen_modes]
    assert stat.S_IMODE(key.stat().st_mode) == 0o400 and [p.name for p in tmp_path.iterdir()] == ["id.key"]
    load_private_key(key)


def test_a_throwaway_key_lives_in_a_folder_only_this_user_can_write() -> None:
    """Stop 57, a review of the diff: its name, freed in /tmp while the key was made, could be
    taken by another user, and the peer would have run on that user's key."""
    import stat

    from swarm.identity import ephemeral_identity

    key = ephemeral_identity()
    try:
        assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700 and stat.S_IMODE(key.stat().st_mode) == 0o400
    finally:
        remove_ephemeral(key)
    assert not key.parent.exists()
