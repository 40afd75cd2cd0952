"""Connecting to a run: a DHT node with the run's validators, its signed store and board.

Peers sign with their own identity key (so their heartbeats are bound to their peer id);
an observer (``workbench status``, the monitor) gets a throwaway identity and, to steer,
signs with the owner's key file instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import swarm.dht
from swarm.dht import NetworkConfig, shutdown_quietly
from swarm.identity import remove_ephemeral
from swarm.records import RunKeys

logger = logging.getLogger(__name__)


@dataclass
class RunSession:
    dht: object
    keys: RunKeys
    private_key: object
    store: object  # swarm.store.SignedStore
    board: object  # swarm.progress.ProgressBoard
    identity_path: Path
    _cleanup: list[Path] = field(default_factory=list)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    @property
    def key_kept(self) -> bool:
        """Whether the identity key file outlives this session (False: a throwaway key)."""
        return self.identity_path not in self._cleanup

    def close(self, *nodes: object) -> None:
        """Shut down ``nodes`` (averagers) first, then the DHT; remove throwaway keys."""
        shutdown_quietly(*nodes, self.dht)
        for path in self._cleanup:
            remove_ephemeral(path)


def connect(
    network: NetworkConfig, keys: RunKeys, *, signing_key: str | Path | None = None, dht_factory=None
) -> RunSession:
    """Start a DHT node for run ``keys``. Its identity is ``network.identity_path`` (created if
    missing) or a throwaway one; records are signed with ``signing_key`` if given (an
    observer steering with the owner's key), else with the identity's key."""
    from swarm.identity import ephemeral_identity, load_private_key, make_identity
    from swarm.progress import ProgressBoard
    from swarm.store import SignedStore
    from swarm.validators import record_validators

    cleanup = []
    fresh = True  # a key made just now: nobody else can be using it
    if network.identity_path:
        identity = Path(network.identity_path).expanduser()
        fresh = not identity.exists() and make_identity(identity)
        if fresh:
            logger.info("created a new key in %s (this peer's id is kept across restarts)", identity)
    else:
        identity = ephemeral_identity()
        cleanup.append(identity)
    try:
        private_key = load_private_key(signing_key if signing_key else identity)
    except BaseException:  # a bad --key: no throwaway private key left behind in /tmp
        for path in cleanup:
            remove_ephemeral(path)
        raise
    network = NetworkConfig(**{**network.__dict__, "identity_path": str(identity)})
    try:
        dht = (dht_factory or swarm.dht.start_dht)(
            network, record_validators(keys, private_key), fresh_identity=fresh
        )
    except BaseException:
        for path in cleanup:
            remove_ephemeral(path)
        raise
    store = SignedStore(dht, private_key)
    return RunSession(
        dht=dht,
        keys=keys,
        private_key=private_key,
        store=store,
        board=ProgressBoard(store, keys),
        identity_path=identity,
        _cleanup=cleanup,
    )
