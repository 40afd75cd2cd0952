"""Signed records in the DHT: store under this node's public key, read everybody's.

Each record key of a run (see :class:`~swarm.records.RunKeys`) is a dictionary whose subkeys
are ``[owner:<ssh-rsa public key>]``; hivemind's ``RSASignatureValidator`` signs what we store
under our own key and refuses any store under a key whose private half the writer lacks.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from pydantic import BaseModel

from swarm.dht import wait_for
from swarm.records import parse_record

logger = logging.getLogger(__name__)

_OWNER = re.compile(rb"\[owner:(.+?)\]")


def subkey_public_key(subkey: Any) -> str | None:
    """The OpenSSH public key inside a record subkey, or None."""
    if not isinstance(subkey, bytes):
        return None
    found = _OWNER.fullmatch(subkey)
    return found.group(1).decode(errors="replace") if found else None


class SignedStore:
    """Store this node's records and read all writers' records of one DHT key."""

    def __init__(self, dht, private_key, *, timeout: float = 5.0) -> None:
        from swarm.identity import public_key_text

        self.dht = dht
        self.public_key = public_key_text(private_key)
        self.subkey = b"[owner:" + self.public_key.encode() + b"]"
        self.timeout = timeout
        self.failures = 0
        """Fire-and-forget stores that raised in a row (reset by one that did not)."""
        self.last_failure = ""

    def _note(self, future) -> None:
        """A fire-and-forget store's outcome (its future's callback): count failures in a row."""
        error = future.exception() if not future.cancelled() else None
        if error is None:
            self.failures = 0
        else:
            self.failures += 1
            self.last_failure = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

    def store(
        self, key: str, record: BaseModel, *, ttl: float, wait: bool = False, timeout: float | None = None
    ) -> bool:
        """Store ``record`` under our key; with ``wait``, block until stored (or ``timeout``,
        this store's own by default)."""
        from hivemind.utils import get_dht_time

        future = self.dht.store(
            key,
            subkey=self.subkey,
            value=record.model_dump(mode="json"),
            expiration_time=get_dht_time() + ttl,
            return_future=True,
        )
        if not wait:
            future.add_done_callback(self._note)
            return True
        return bool(wait_for(future, self.timeout if timeout is None else timeout, f"storing {key}"))

    def read(self, key: str, model: type[BaseModel]) -> dict[str, BaseModel]:
        """Every valid record under ``key`` by its writer's public key (malformed ones dropped).
        Raises SwarmError if the DHT does not answer in time."""
        found = wait_for(self.dht.get(key, latest=True, return_future=True), self.timeout, f"a read of {key}")
        if found is None or not isinstance(found.value, dict):
            return {}
        records = {}
        for subkey, entry in found.value.items():
            public_key = subkey_public_key(subkey)
            record = parse_record(model, getattr(entry, "value", None))
            if public_key is None or record is None:
                logger.debug("dropping a malformed %s record under %r", model.__name__, subkey)
                continue
            records[public_key] = record
        return records
