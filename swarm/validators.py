"""The DHT record validators every node of a run installs (imports hivemind).

hivemind applies them on every store a node receives and on every value it returns, in
priority order: the run secret's seal (private runs), then the RSA signature, then the
schema. A node without them cannot even read the run's signed keys (hivemind's get hangs).
"""

from __future__ import annotations

import hmac
import os
from typing import Any

import pydantic.v1
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from pydantic import BaseModel

from swarm.records import (
    CLOCK_SLACK,
    DONOR_BYTES,
    DONOR_TTL,
    HEARTBEAT_TTL,
    LONG_TTL,
    MATCHMAKING_TTL,
    RECORD_BYTES,
    ControlState,
    PeerHeartbeat,
    RunKeys,
    RunManifest,
    parse_record,
)


def _owner_subkey(serialized: bytes) -> bool:
    """Whether a record's subkey (as stored: msgpack) is one ``[owner:...]`` key and nothing else."""
    from hivemind.utils.serializer import MSGPackSerializer

    from swarm.store import subkey_public_key

    try:
        subkey = MSGPackSerializer.loads(serialized)
    except Exception:  # noqa: BLE001 - not msgpack: not ours
        return False
    return subkey_public_key(subkey) is not None


def record_validators(keys: RunKeys, private_key) -> list[RecordValidatorBase]:
    """Schema + signature (+ secret) validators for ``keys``' records; ``private_key`` signs
    what this node stores under its own public key."""
    schema = pydantic.v1.create_model(
        "RunRecords",
        manifest=(dict[BytesWithPublicKey, _dht_value(RunManifest)], None),
        peers=(dict[BytesWithPublicKey, _dht_value(PeerHeartbeat)], None),
        control=(dict[BytesWithPublicKey, _dht_value(ControlState)], None),
    )
    validators: list[RecordValidatorBase] = [
        RecordBoundsValidator(keys),
        SchemaValidator(schema, allow_extra_keys=True, prefix=keys.namespace),
        RSASignatureValidator(private_key),
    ]
    if keys.secret:
        validators.append(RunSecretValidator(keys))
    return validators


def _dht_value(model: type[BaseModel]) -> type:
    """A pydantic-v1 field type (what hivemind's SchemaValidator takes) checked by our v2 model.
    The value comes back unchanged when it parses, so hivemind's no-conversion check holds."""

    class Value:
        @classmethod
        def __get_validators__(cls):
            yield cls.check

        @classmethod
        def check(cls, value: Any) -> Any:
            if parse_record(model, value) is None:
                raise ValueError(f"not a valid {model.__name__}")
            return value

    Value.__name__ = Value.__qualname__ = f"{model.__name__}Value"
    return Value


class RunSecretValidator(RecordValidatorBase):
    """Private runs: every record under the run's keys is sealed with a key derived from the run
    secret (AES-GCM, bound to the record's key, subkey and expiration): a node holding the
    secret refuses any store it cannot open, and any other node stores bytes it cannot read.
    (The keys themselves are derived from the secret too, see :class:`~swarm.records.RunKeys`.)

    Before (to stop 63) the records carried an HMAC only: the run's heartbeats (names, steps,
    addresses), its manifest and its steering were stored in the clear on whichever nodes of the
    DHT were nearest their keys, an outsider's among them (a review, stop 64). So were the
    matchmaking declarations, which carried nothing at all."""

    _SEALED = b"[run-sealed]"
    _NONCE = 12

    def __init__(self, keys: RunKeys) -> None:
        self.namespace = keys.namespace
        secret, purpose = (keys.secret or "").encode(), b"workbench-records:" + keys.namespace.encode()
        self._key = hmac.new(secret, purpose, "sha256").digest()
        self._protected = {
            DHTID.generate(source=key).to_bytes()
            for key in (keys.manifest, keys.peers, keys.control, *keys.donors, *keys.matchmaking)
        }
        self._cipher: Any = None  # made at first use (it does not pickle into the DHT's process)

    def _aead(self):
        if self._cipher is None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._cipher = AESGCM(self._key)
        return self._cipher

    @staticmethod
    def _bound_to(record: DHTRecord) -> bytes:
        return b"\x00".join([record.key, record.subkey or b"", repr(float(record.expiration_time)).encode()])

    def _open(self, record: DHTRecord) -> bytes | None:
        """The record's value unsealed, or None if it was not sealed with this run's key."""
        value = record.value
        if not value.startswith(self._SEALED):
            return None
        nonce = value[len(self._SEALED) : len(self._SEALED) + self._NONCE]
        try:
            return self._aead().decrypt(
                nonce, value[len(self._SEALED) + self._NONCE :], self._bound_to(record)
            )
        except Exception:  # noqa: BLE001 - InvalidTag, a short value: not this run's
            return None

    def validate(self, record: DHTRecord) -> bool:
        return record.key not in self._protected or self._open(record) is not None

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._protected:
            return record.value
        nonce = os.urandom(self._NONCE)
        return self._SEALED + nonce + self._aead().encrypt(nonce, record.value, self._bound_to(record))

    def strip_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._protected:
            return record.value
        opened = self._open(record)
        return b"" if opened is None else opened  # (validated first: never None here)

    @property
    def priority(self) -> int:
        return 20  # outermost: opened before the signature is checked (it signs the value inside)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, RunSecretValidator) and other.namespace == self.namespace

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cipher": None}


class RecordBoundsValidator(RecordValidatorBase):
    """Every record under the run's keys is small and short-lived: at most
    :data:`~swarm.records.RECORD_BYTES` on the wire, and expiring no later than its kind's TTL
    (plus :data:`~swarm.records.CLOCK_SLACK`) from now. Checked first, on the raw value, on every
    store and every read. Without it, the run's nodes stored whatever signed record an outsider
    sent (unknown fields are allowed, for newer peers): 1 MB heartbeats, each held for the year
    its writer chose, with no process left running, and a well-formed one stayed a ghost peer.

    The donors' declarations (:attr:`~swarm.records.RunKeys.donors`, hivemind's
    ``all_averagers``) are bounded too, and each subkey must be a writer's ``[owner:...]`` key
    (which the signature validator then checks): hivemind's own subkey, the bare peer id, was
    anybody's to write, and an outsider wrote None under every donor's id for a year, so that
    their renewals were refused and every joiner found no donor. So are the matchmaking
    declarations (:attr:`~swarm.records.RunKeys.matchmaking`, :mod:`swarm.signed_groups`),
    where the same squat left every peer alone in every round."""

    def __init__(self, keys: RunKeys) -> None:
        self.namespace = keys.namespace
        ttl = {"manifest": LONG_TTL, "peers": HEARTBEAT_TTL, "control": LONG_TTL}
        self._limits = {
            DHTID.generate(source=getattr(keys, kind)).to_bytes(): (
                RECORD_BYTES[kind],
                ttl[kind] + CLOCK_SLACK,
            )
            for kind in ("manifest", "peers", "control")
        }
        self._donors = {DHTID.generate(source=key).to_bytes() for key in keys.donors}
        for key in self._donors:
            self._limits[key] = (DONOR_BYTES, DONOR_TTL + CLOCK_SLACK)
        matchmaking = {DHTID.generate(source=key).to_bytes() for key in keys.matchmaking}
        for key in matchmaking:
            self._limits[key] = (DONOR_BYTES, MATCHMAKING_TTL + CLOCK_SLACK)
        self._owned = self._donors | matchmaking  # subkeys: their writers' [owner:...] keys only

    def validate(self, record: DHTRecord) -> bool:
        limits = self._limits.get(record.key)
        if limits is None:
            return True
        if record.key in self._owned and not _owner_subkey(record.subkey):
            return False
        most_bytes, most_seconds = limits
        from hivemind.utils.timed_storage import get_dht_time

        return len(record.value) <= most_bytes and record.expiration_time <= get_dht_time() + most_seconds

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value

    @property
    def priority(self) -> int:
        return 30  # outermost: the raw value, before any other validator reads it

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, RecordBoundsValidator) and other.namespace == self.namespace

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)
