"""The run manifest: what a run trains, so a peer with another model is refused at the door.

The owner (``workbench start``) publishes a :class:`~swarm.records.RunManifest` holding the
model fingerprint: a hash of the architecture, the parameter names, shapes and dtypes, and
the outer-optimizer settings every peer must share. A joiner computes its own fingerprint
and compares before it downloads anything.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

import torch

from swarm.errors import SwarmError
from swarm.records import LONG_TTL, RunKeys, RunManifest
from swarm.store import SignedStore

logger = logging.getLogger(__name__)

MANIFEST_TTL = LONG_TTL  # the owner republishes it while it runs


def model_fingerprint(model: torch.nn.Module, optimizer: dict[str, Any]) -> str:
    """sha256 (first 16 hex digits) of the architecture, parameters and ``optimizer`` settings."""
    digest = hashlib.sha256()
    digest.update(repr(model).encode())  # module tree: layer types and their hyperparameters
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}:{param.requires_grad};".encode())
    digest.update(json.dumps(optimizer, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def publish_manifest(store: SignedStore, keys: RunKeys, manifest: RunManifest) -> None:
    if not store.store(keys.manifest, manifest, ttl=MANIFEST_TTL, wait=True):
        raise SwarmError("could not store the run manifest in the DHT")


def find_manifest(store: SignedStore, keys: RunKeys, *, owner: str | None = None, timeout: float = 10.0):
    """The run's manifest (by owner hash if given), or None if the run has none in the DHT.

    Several owners publishing a manifest for one run id means somebody else uses the same run
    id (or is squatting it). The owner named in the join command (``owner``) wins; without one,
    the oldest manifest wins (the run's own came first, a squatter's later) and the conflict is
    logged as a warning naming every owner, so the user can pass ``--owner``. ``created`` is a
    claim like any other: a squatter can back-date it, which ``--owner`` (printed in every join
    command) settles.
    """
    from swarm.identity import key_hash

    deadline = time.monotonic() + timeout
    while True:
        manifests = [
            m for key, m in store.read(keys.manifest, RunManifest).items() if key_hash(key) == m.owner
        ]
        if owner:
            manifests = [m for m in manifests if m.owner == owner]
        if manifests or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if not manifests:
        return None
    if len(manifests) > 1:
        manifests.sort(key=lambda m: (m.created, m.owner))
        others = ", ".join(m.owner for m in manifests[1:])
        logger.warning(
            "run '%s' has manifests from several owners: using the oldest, by %s (the others: %s); "
            "pass --owner with the one the run's `workbench start` printed to be sure",
            keys.run_id,
            manifests[0].owner,
            others,
        )
    return manifests[0]


def check_fingerprint(manifest: RunManifest, fingerprint: str, summary: str) -> None:
    """Refuse to join a run whose model differs from this peer's."""
    if manifest.fingerprint != fingerprint:
        raise SwarmError(
            f"this peer's model does not match run '{manifest.run_id}': the run's fingerprint is "
            f"{manifest.fingerprint} ({manifest.summary}), this peer's is {fingerprint} ({summary}); "
            "use the --model and optimizer flags of the run's join command"
        )


def owner_mismatch(store: SignedStore, keys: RunKeys, owner: str | None) -> str | None:
    """Why the run has no manifest by ``owner`` although it has one by another owner (a
    mistyped ``--owner``), or None. Call once no manifest by ``owner`` was found."""
    if not owner:
        return None
    other = find_manifest(store, keys, timeout=0.0)
    if other is None or other.owner == owner:
        return None
    return (
        f"run '{keys.run_id}' has no manifest by owner {owner}, only one by {other.owner}: check --owner "
        "against the join command the run's `workbench start` printed (or drop --owner to trust the "
        "oldest manifest)"
    )
