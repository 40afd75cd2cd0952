"""Records peers publish in the DHT, as pydantic models.

Three keys per run (see :class:`RunKeys`), each a dictionary whose subkeys are the writers'
public keys (``[owner:ssh-rsa ...]``):

    <ns>_manifest   RunManifest   written once by the run's owner (``workbench start``)
    <ns>_peers      PeerHeartbeat every peer, every second or so, short expiration
    <ns>_control    ControlState  the owner's steering; anybody else's is ignored and logged

Every DHT node of the run installs :func:`record_validators`: hivemind's
``RSASignatureValidator`` (a record under a public key must be signed with its private key,
so nobody writes under another peer's key), hivemind's ``SchemaValidator`` (values must
parse as these models) and, for a private run, :class:`RunSecretValidator` (every record
sealed with a key derived from the run secret: AES-GCM). Readers validate again and check a heartbeat's peer id against
its signer's key, so a record that slipped past a node without validators is still dropped.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    field_validator,
)

from swarm.bounds import BOUNDS
from swarm.errors import SwarmError

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
NAME_PATTERN = r"^\w[\w .:@+-]{0,63}$"
"""A peer's display name: letters and digits (any script), then also space, '.', ':', '@', '+'
and '-'. No brackets (Rich and Textual markup: a name "[/b]" crashed `workbench status` and
the TUI) and no control characters (an escape sequence in a name cleared the terminal)."""
DEVICE_PATTERN = r"^[\w .:()/+-]{0,32}$"
PEER_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
"""Letters, digits, - and _ (libp2p writes peer ids in base58; the simulator, sim-0, ...)."""
MATE_TAG_PATTERN = r"^[A-Za-z0-9_-]{20}$"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def mate_tag(peer_id: str) -> str:
    """A peer id in 20 characters (120 bits of its SHA-256): what a heartbeat's ``averaged_with``
    names. Two keys sharing a tag take about 2^60 tries (72 bits, a review found, left 2^36:
    hours on a GPU), a key sharing an honest peer's 2^120; and the monitor counts no tag two
    live peers share (:func:`swarm.monitor.owners_mates`)."""
    return base64.urlsafe_b64encode(hashlib.sha256(peer_id.encode()).digest()[:15]).decode()


_NAME = TypeAdapter(Annotated[str, StringConstraints(pattern=NAME_PATTERN)])


def is_name(name: Any) -> bool:
    """Whether a peer may go by ``name``, as a heartbeat's schema judges it: pydantic's regex
    engine, not Python's (their ``\\w`` differ: Python's takes "x²", the schema refuses it, and a
    round mate named so once stopped the peer that copied the name into its heartbeat)."""
    try:
        _NAME.validate_python(name, strict=True)
    except ValidationError:
        return False
    return True


def check_name(name: str) -> str:
    """``name`` if a peer may go by it (:data:`NAME_PATTERN`), else SwarmError saying why."""
    if not is_name(name):
        raise SwarmError(
            f"invalid peer name {name!r} ({len(str(name))} characters): use 1-64 letters, digits, spaces "
            "and . : @ + - _, "
            "starting with a letter or digit"
        )
    return name


def printable(text: str) -> str:
    """``text`` with control characters shown as escapes (``\\x1b``): free text from the network
    (an error, a reason) reaches terminals as text, never as a command to them."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def check_run_id(run_id: str) -> str:
    """Run ids prefix DHT keys and averaging groups: letters, digits, '-' and '_' only."""
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
        raise SwarmError(
            f"invalid run id '{run_id}': use 1-64 letters, digits, '-' or '_', starting with a letter or digit"
        )
    return run_id


def check_owner(owner: str | None) -> str | None:
    """An ``--owner`` as `workbench start` prints it (16 hex digits of the owner's key hash), or
    None; SwarmError naming the value otherwise (a typo would trust no manifest at all)."""
    if owner is not None and not (isinstance(owner, str) and re.fullmatch(r"[0-9a-f]{16}", owner)):
        raise SwarmError(f"--owner takes the 16 hex digits `workbench start` printed (got '{owner}')")
    return owner


class Stage(str, enum.Enum):
    """Where a peer is in its protocol, shown in every UI."""

    JOINING = "joining"  # connecting to the DHT, waiting for enough peers
    DOWNLOADING = "downloading"  # fetching the global state from another peer
    TRAINING = "training"  # running inner steps
    WAITING = "waiting"  # done with this round's inner steps, waiting for the others
    AVERAGING = "averaging"  # matchmaking and all-reduce of pseudo-gradients
    PAUSED = "paused"  # the run's owner paused this peer (steering); it trains nothing
    FINISHING = "finishing"  # done with its rounds: checking it ends on the others' θ (swarm.ending)
    LEAVING = "leaving"  # shutting down (Ctrl+C or end of run)


IDLE = frozenset({Stage.JOINING, Stage.DOWNLOADING, Stage.PAUSED, Stage.FINISHING, Stage.LEAVING})
"""Stages in which a peer trains nothing: the rates in its heartbeat are its last round's, so
the UIs show none for it and the swarm's total leaves it out (three paused peers read 20, 21 and
22 samples/s beside a total of 0)."""


PROTOCOL = 2
"""This release's way of finding groups (:attr:`PeerHeartbeat.protocol`): since 2026-12-06 the
matchmaking declarations are signed, and a run's nodes refuse the bare ones earlier releases
make (1); since stop 63 a group's members meet at its matchmaking leader's board (2), where
earlier releases meet at another member's: a peer leaves those of an earlier protocol out of its
groups (:meth:`swarm.averaging.SwarmAverager.round_peers`; a group of both waited at two boards
until its deadline, every attempt, a review), so peers of different ones never average together."""


class PeerHeartbeat(BaseModel):
    """One peer's progress, republished every second or so; expires when the peer dies.

    Unknown fields are ignored, not refused: a newer peer's heartbeat (with fields this version
    does not know) must still count as a live peer here, or a mixed-version run falls apart."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    peer_id: str = Field(pattern=PEER_ID_PATTERN)
    name: str = Field(pattern=NAME_PATTERN)
    stage: Stage
    outer_step: int = Field(ge=0)
    """Completed outer rounds: peers at the same step hold the same global params."""
    inner_step: int = Field(ge=0)
    """Inner steps done in the current round."""
    inner_steps: int = Field(ge=1)
    """H: inner steps per round on this peer."""
    loss: float | None = None
    samples_per_second: float = Field(default=0.0, ge=0)
    bytes_sent: int = Field(default=0, ge=0)
    bytes_received: int = Field(default=0, ge=0)
    device: str = Field(default="cpu", pattern=DEVICE_PATTERN)
    time: float
    """DHT time when published."""
    last_round_seconds: float | None = Field(default=None, ge=0)
    """Wall time of this peer's last outer round (inner steps + averaging)."""
    group_size: int = Field(default=0, ge=0)
    """How many peers averaged in this peer's last round (1: it stepped alone)."""
    control_version: int = Field(default=0, ge=0)
    """The run owner's ControlState version this peer has applied (0: none yet)."""
    protocol: int = Field(default=0, ge=0)
    """How this peer's release finds its groups: :data:`PROTOCOL` (signed matchmaking
    declarations, :mod:`swarm.signed_groups`, and the board of the group's leader); less for an
    earlier release, which a peer of this one does not group with (nor it with this one)."""
    control_refused: int = Field(default=0, ge=0)
    """The last version this peer refused, applying nothing of it (a value its run cannot take:
    streaming's H not divisible by its fragments, an update codec its method has no use for)."""
    control_refusal: str = Field(default="", max_length=200)
    """Why it refused :attr:`control_refused`."""
    addresses: list[str] = Field(default_factory=list, max_length=16)
    """Multiaddrs this peer can be dialed at (empty for a client-mode peer)."""
    tokens_per_second: float = Field(default=0.0, ge=0)
    dp_bytes: int = Field(default=0, ge=0)
    """What data-parallel would have sent for this peer's inner steps so far (fp32 all-reduce of
    the gradients every step, in the same group sizes): the yardstick for bytes saved."""
    rounds: int = Field(default=0, ge=0)
    """Outer rounds this peer will run (0: until stopped); with round times, the ETA."""
    last_error: str | None = Field(default=None, max_length=300)
    """Why this peer's last round went wrong (fell back to a local step, rejected update, ...)."""
    ignored: dict[str, str] = Field(default_factory=dict, max_length=16)
    """Peers this one caught lying (peer id -> why), for the UIs; a claim like any other."""
    averaged_with: list[Annotated[str, StringConstraints(max_length=128)]] = Field(
        default_factory=list, max_length=16
    )
    """The peers this one last averaged with, each as :func:`mate_tag` of its peer id (most recent
    last, itself left out; in a group of more than 16 others, the 8 either side of it by id):
    the monitor counts the flags (:attr:`ignored`) of the owner's peer and of the peers it names
    here that name it back (:func:`swarm.monitor.owners_mates`). A claim too. Tags, not ids:
    16 peer ids doubled a heartbeat (765 -> 1,631 bytes), and every board read reads them all.
    An entry that is not a tag is dropped, not the heartbeat (another release's form)."""
    round_wait_seconds: float = Field(default=0.0, ge=0)
    """How long this peer's barrier now waits for a round mate still training (learned from the
    last rounds' arrivals, :mod:`swarm.deadlines`; 0: not known)."""
    averaging_deadline_seconds: float = Field(default=0.0, ge=0)
    """How long this peer now gives a round's matchmaking and all-reduce (learned likewise)."""
    matchmaking_window_seconds: float = Field(default=0.0, ge=0)
    """How long this peer's matchmaking now waits for its round's group to form (learned from
    how long the last groups took; a complete group forms sooner)."""
    last_round_steps: int = Field(default=0, ge=0)
    """Inner steps this peer ran in its last round: its H, or what fit in a time-boxed round."""
    serving: bool = False
    """Answering a request for its state right now (a joiner's download or a witness's sketch).
    With ``--overlap`` that answer waits for the round in flight, so the others of that round do
    not wait for the downloader (:mod:`swarm.barrier`). A claim: a peer that always says so
    only makes downloaders land a round later."""
    last_round_spread: float = Field(default=0.0, ge=0, le=86400)
    """Seconds between the first and the last arrival of its last round's group (wall clocks)."""
    last_round_last: str = Field(default="", pattern=NAME_PATTERN + "|^$")
    """The name of the member of its last round's group that arrived last."""
    last_round_alone: str = Field(default="", max_length=200)
    """Why it stepped alone in its last round ("" when it averaged)."""
    download_progress: float = Field(default=0.0, ge=0, le=1)
    """While downloading the state: the share received of what the donor said it would send."""
    download_donors: int = Field(default=0, ge=0, le=64)
    """While downloading the state: how many donors serve it (the direct transport takes slices
    from several at once; hivemind's stream, from one)."""
    final_theta: list[float] = Field(default_factory=list, max_length=16)
    """While finishing, and leaving after it: its θ's sketch (rows, then length) under the
    step's public seed (:func:`swarm.ending.final_sketch`), which the others that end at that
    step compare."""
    settled: bool = False
    """While finishing: this peer would leave now on ``final_theta`` (:mod:`swarm.ending`); it
    leaves once the round mates holding that θ say so too."""

    @property
    def done(self) -> bool:
        """It has run all its rounds (finishing, or downloading the θ the others end on): no
        round mate for anyone (:mod:`swarm.ending`)."""
        return self.stage is Stage.FINISHING or 0 < self.rounds <= self.outer_step

    @field_validator("ignored")
    @classmethod
    def _short_reasons(cls, value: dict[str, str]) -> dict[str, str]:
        if any(not re.fullmatch(PEER_ID_PATTERN, k) or len(v) > 200 for k, v in value.items()):
            raise ValueError("ignored: peer ids (letters and digits) up to 128 characters, reasons up to 200")
        return {k: printable(v) for k, v in value.items()}

    @field_validator("averaged_with")
    @classmethod
    def _tags_only(cls, value: list[str]) -> list[str]:
        return [tag for tag in value if re.fullmatch(MATE_TAG_PATTERN, tag)]

    @field_validator("last_error", "last_round_alone", "control_refusal")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        return None if value is None else printable(value)


class RunManifest(BaseModel):
    """What a run is: written by its owner when it starts; joiners check their model against it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = Field(pattern=RUN_ID_PATTERN.pattern)
    owner: str = Field(pattern=r"^[0-9a-f]{16}$")
    """Hash of the owner's public key (:func:`swarm.identity.key_hash`)."""
    fingerprint: str = Field(pattern=r"^[0-9a-f]{8,128}$")
    """Hash of the model's architecture, parameter shapes and optimizer config."""
    summary: str = Field(default="", max_length=512)
    """The same in words, for error messages (e.g. "gpt small 1.85M params, diloco H=50")."""
    created: float

    @field_validator("summary")
    @classmethod
    def _printable(cls, value: str) -> str:
        return printable(value)


def applied(peers: Iterable[PeerHeartbeat], version: int) -> tuple[int, int]:
    """(peers that applied the control ``version`` or later, peers that can): a paused peer
    applies nothing until it is resumed, so it is not counted (the monitor's "3/4 applied" stayed
    short for as long as a peer was paused)."""
    active = [p for p in peers if p.stage is not Stage.PAUSED]
    return sum(p.control_version >= version and not 0 < version <= p.control_refused for p in active), len(
        active
    )


def refused(peers: Iterable[PeerHeartbeat], version: int) -> dict[str, str]:
    """The peers that refused the control ``version`` (peer id -> why), applying nothing of it."""
    return {p.peer_id: p.control_refusal for p in peers if 0 < version <= p.control_refused}


MAX_VERSION = 2**52
"""The largest steering version: one a record or a heartbeat says above it is absurd."""


class ControlStep(BaseModel):
    """One version of the owner's settings and the outer step its peers apply it at."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(ge=1, le=MAX_VERSION + 1)
    from_step: int = Field(default=0, ge=0)
    """Peers apply the settings at the start of this outer step, all at the same step (the outer
    lr changes θ: peers applying it at different rounds would drift apart)."""
    outer_lr: float | None = Field(default=None, gt=BOUNDS["outer_lr"].low, le=BOUNDS["outer_lr"].high)
    inner_steps: int | None = Field(default=None, ge=BOUNDS["inner_steps"].low, le=BOUNDS["inner_steps"].high)
    round_seconds: float | None = Field(
        default=None, ge=BOUNDS["round_seconds"].low, le=BOUNDS["round_seconds"].high
    )
    """Time-boxed rounds of this many seconds (0: back to H steps each)."""
    codec: str | None = Field(default=None, max_length=16)
    """Codec of the pseudo-gradients (optim.codecs name: none, fp16, bf16, int8, int4, topk)."""
    checkpoint: int = Field(default=0, ge=0)
    """Bumped to ask every peer to write a checkpoint now."""

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, value: str | None) -> str | None:
        from swarm.bounds import UPDATE_CODECS

        if value is not None and value not in UPDATE_CODECS:
            raise ValueError(f"unknown codec '{value}' (choose from {', '.join(UPDATE_CODECS)})")
        return value

    def changes(self) -> dict[str, Any]:
        """The settings this version sets (for logs and UIs)."""
        return {
            k: v
            for k, v in self.model_dump().items()
            if k not in ("version", "time", "from_step", "earlier")
            and v not in (None, [])
            and (v != 0 or k == "round_seconds")  # round_seconds 0 turns time boxes off
        }


EARLIER_KEPT = 8
"""Versions before the newest that a control record keeps, with their steps (ControlState.earlier)."""


class ControlState(ControlStep):
    """The run owner's steering, versioned; every field left None keeps the peers' setting.

    Each version holds every setting (the ones it changes on top of the one before), and the
    versions before it that peers may not have applied yet (``earlier``): a peer that first
    sees version 3 while its step is version 2's applies 2 first. With the newest alone, a
    peer that read the record after the owner's next change applied version 2's outer lr at
    version 3's step, rounds after the others, and their θ drifted apart meanwhile."""

    paused: list[str] = Field(default_factory=list, max_length=256)
    """Peer ids (or names) the owner paused; they idle until a later version drops them."""
    time: float = 0.0
    """DHT time when the owner published it."""
    earlier: list[ControlStep] = Field(default_factory=list, max_length=EARLIER_KEPT)
    """The versions before this one, newest first (their own settings and steps)."""

    @field_validator("paused")
    @classmethod
    def _short_names(cls, value: list[str]) -> list[str]:
        if any(
            not (re.fullmatch(PEER_ID_PATTERN, name) or re.fullmatch(NAME_PATTERN, name)) for name in value
        ):
            raise ValueError("paused: peer ids or peer names (see NAME_PATTERN), up to 128 characters")
        return value

    def step(self) -> ControlStep:
        """This version's settings and step, as the next version keeps them in ``earlier``."""
        return ControlStep(**{k: getattr(self, k) for k in ControlStep.model_fields})

    def due(self, outer_step: int, after: int) -> ControlStep | None:
        """The newest version past ``after`` (the one a peer applied) whose step has come at
        ``outer_step``, or None: each holds every setting, so it stands for the ones between."""
        for version in (self.step(), *self.earlier):
            if version.version <= after:
                return None
            if version.from_step <= outer_step:
                return version
        return None

    def pauses(self, peer_id: str, name: str) -> bool:
        return peer_id in self.paused or name in self.paused


# --- where records live ---------------------------------------------------------------------------

HEARTBEAT_TTL = 10.0
"""Seconds a heartbeat lives (a peer republishes it every second or so)."""
LONG_TTL = 7 * 24 * 3600.0
"""Seconds the manifest and the owner's steering live (the owner republishes them while it runs)."""
CLOCK_SLACK = 120.0
"""Clocks differ: a time up to this far ahead of a reader's is still believed."""
RECORD_BYTES = {"manifest": 4096, "peers": 16384, "control": 49152}
"""The most bytes a record under each key may take on the wire, signature and a private run's seal included
(an honest heartbeat at its fields' limits is about 9 KB, a steering record pausing 256 peers
about 34 KB, a manifest about 1 KB)."""

DONOR_TTL = 60.0
"""Seconds a donor's declaration (:attr:`RunKeys.donors`) may live; a peer renews its own every
10 s (``declare_state_period``)."""
DONOR_BYTES = 2048
"""The most bytes a donor's declaration may take (a number, its signature and a private run's seal: about 500)."""
MATCHMAKING_TTL = 180.0
"""Seconds a matchmaking declaration (:attr:`RunKeys.matchmaking`) may live: hivemind's is
until its step's matchmaking window ends (``--matchmaking-time``, at most 120 s)."""
MAX_FRAGMENTS = 1024
"""The most fragments a streaming run averages (``--fragments``; each its own group)."""
STATE_GROUPS = ("diloco", "fragment0")
"""The averaging groups whose peers serve the state (:class:`swarm.averaging.SwarmAverager`'s
default group; streaming's fragment 0)."""


@dataclass(frozen=True)
class RunKeys:
    """The DHT names of one run. With a run secret, the names are derived from it, so peers
    without the secret cannot find the run's records or its averaging groups."""

    run_id: str
    secret: str | None = None

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if self.secret is not None and len(self.secret) < 8:
            raise SwarmError("a run secret must be at least 8 characters (use a long random one)")

    @property
    def namespace(self) -> str:
        """The run id, or for a private run an HMAC of it with the secret, and nothing of the
        run id: the namespace names the run's handlers too, which libp2p lists to anyone who
        connects to one of its peers (it began with the run id until stop 63: a review)."""
        if not self.secret:
            return self.run_id
        tag = hmac.new(self.secret.encode(), f"workbench-run:{self.run_id}".encode(), hashlib.sha256)
        return f"private_{tag.hexdigest()[:32]}"

    @property
    def manifest(self) -> str:
        return f"{self.namespace}_manifest"

    @property
    def peers(self) -> str:
        return f"{self.namespace}_peers"

    @property
    def control(self) -> str:
        return f"{self.namespace}_control"

    def group(self, name: str) -> str:
        """The prefix of an averaging group (hivemind matchmaking and state sharing keys)."""
        return f"{self.namespace}_{name}"

    @property
    def donors(self) -> tuple[str, ...]:
        """The keys where the peers that serve the state declare it (hivemind's
        ``<prefix>.all_averagers``), one per group in :data:`STATE_GROUPS`: each subkey is a
        writer's ``[owner:...]`` key, so only that peer can write or withdraw its own entry."""
        return tuple(f"{self.group(name)}.all_averagers" for name in STATE_GROUPS)

    @property
    def matchmaking(self) -> tuple[str, ...]:
        """The keys where peers looking for a group declare it (hivemind's ``<prefix>.0b``: the
        run's groups start with no group bits and keep none), one per averaging group: each
        subkey is a writer's ``[owner:...]`` key (:mod:`swarm.signed_groups`)."""
        groups = ("diloco", *(f"fragment{f}" for f in range(MAX_FRAGMENTS)))
        return tuple(f"{self.group(name)}.0b" for name in groups)


def parse_record(model: type[BaseModel], value: Any) -> BaseModel | None:
    """``value`` as ``model``, or None if it does not parse (untrusted input is never raised on)."""
    try:
        return model.model_validate(value)
    except (ValidationError, TypeError, ValueError):
        return None
