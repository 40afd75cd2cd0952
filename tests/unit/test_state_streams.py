"""hivemind's state stream as a donor serves it (swarm.state_sharing.StateSharing): each stream
holds a copy of the state while it runs, so streams are bounded in number and cut when a reader
stops reading. Driven in one event loop, hivemind's own stream stood in for by a generator."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from hivemind.proto import averaging_pb2, runtime_pb2
from multiaddr import Multiaddr

from swarm import state_sharing
from swarm.state_sharing import MAX_STREAMS, StateSharing

PART = 64 << 10


class _HivemindStream:
    """hivemind's rpc_download_state: a copy of the state, then its parts (counted while held)."""

    held = 0

    async def rpc_download_state(self, request, context):
        _HivemindStream.held += 1
        try:
            for _ in range(64):
                yield averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=b"\0" * PART))
                await asyncio.sleep(0)
        finally:
            _HivemindStream.held -= 1


class _Id(str):
    def to_base58(self) -> str:
        return str(self)


class _P2P:
    """hivemind's daemon as far as the donor asks it: where each peer is connected from."""

    def __init__(self) -> None:
        self.addresses: dict[str, str] = {}

    async def get_visible_maddrs(self) -> list[Multiaddr]:
        return [Multiaddr("/ip4/10.0.0.1/tcp/31337")]  # this peer's own address

    async def list_peers(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(peer_id=p, addrs=[Multiaddr(a)]) for p, a in self.addresses.items()]


class _Donor(StateSharing, _HivemindStream):
    def __init__(self) -> None:
        self._fault_file = None
        self._streams = {}
        self._own_ips = None
        self._p2p = _P2P()
        self._members_key = None  # a public run's: anybody


def _context(peer: str):
    return SimpleNamespace(remote_id=_Id(peer))


async def _read(donor: _Donor, peer: str, *, stall_after: int | None = None) -> int:
    """Read the stream as hivemind's handler does, in a task of its own; the parts received."""
    received = 0
    async for _message in donor.rpc_download_state(averaging_pb2.DownloadRequest(), _context(peer)):
        received += 1
        if stall_after is not None and received >= stall_after:
            await asyncio.sleep(3600)  # a reader that stopped reading
    return received


async def _until(condition, seconds: float = 10.0) -> None:
    """Let the event loop run until ``condition()`` (a stream's clean-up takes a few turns)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)


def test_streams_are_bounded_in_number_and_per_peer(monkeypatch):
    async def run() -> list[int | BaseException]:
        donor = _Donor()
        stalled = [asyncio.ensure_future(_read(donor, f"peer{i}", stall_after=1)) for i in range(MAX_STREAMS)]
        await _until(lambda: _HivemindStream.held == MAX_STREAMS)
        again = await _read(donor, "peer0")  # the same peer a second time: refused
        more = await _read(donor, "another")  # one stream too many: refused
        assert _HivemindStream.held == MAX_STREAMS
        for task in stalled:
            task.cancel()
        await asyncio.gather(*stalled, return_exceptions=True)
        await _until(lambda: not donor._streams and not _HivemindStream.held)
        after = await _read(donor, "another")  # the stalled ones gone: served
        return [again, more, after]

    assert asyncio.run(run()) == [0, 0, 64]
    assert _HivemindStream.held == 0


def test_a_reader_that_stops_reading_is_cut_and_its_copy_dropped(monkeypatch):
    """6 stalled streams of a 200 MB state held 3.1 GB in the donor until the attacker died."""
    monkeypatch.setattr(state_sharing, "STREAM_GRACE", 0.2)
    monkeypatch.setattr(state_sharing, "STREAM_WINDOW", 0.2)

    async def run() -> None:
        donor = _Donor()
        reader = asyncio.ensure_future(_read(donor, "slow", stall_after=2))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(reader, timeout=5)
        await _until(lambda: not donor._streams and not _HivemindStream.held)
        assert not donor._streams and _HivemindStream.held == 0

    asyncio.run(run())


def test_one_address_gets_one_stream_whatever_keys_it_brings():
    """Fresh keys are free: three of them on one machine held all MAX_STREAMS streams. Another
    machine's address gets one stream at a time; peers on this machine (loopback, or this
    peer's own address) and those reached through a relay (whose address is the relay's) are
    one per peer as before."""

    async def run() -> list[int]:
        donor = _Donor()
        donor._p2p.addresses = {
            "key1": "/ip4/10.0.0.9/tcp/4001",
            "key2": "/ip4/10.0.0.9/tcp/4002",
            "honest": "/ip4/10.0.0.7/tcp/4001",
            "local1": "/ip4/127.0.0.1/tcp/4001",
            "local2": "/ip4/127.0.0.1/tcp/4002",
            "here": "/ip4/10.0.0.1/tcp/4005",
            "relayed": "/ip4/10.0.0.9/tcp/4003/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N/p2p-circuit",
        }
        held = asyncio.ensure_future(_read(donor, "key1", stall_after=1))
        await _until(lambda: "key1" in donor._streams)
        got = [await _read(donor, "key2"), await _read(donor, "honest"), await _read(donor, "relayed")]
        local = asyncio.ensure_future(_read(donor, "local1", stall_after=1))
        await _until(lambda: "local1" in donor._streams)
        held.cancel()  # key1's reader gone: its stream ends
        await asyncio.gather(held, return_exceptions=True)
        await _until(lambda: "key1" not in donor._streams)
        here = asyncio.ensure_future(_read(donor, "here", stall_after=1))
        await _until(lambda: "here" in donor._streams)
        got.append(await _read(donor, "local2"))
        assert donor._streams == {"local1": None, "here": None}
        for task in (local, here):
            task.cancel()
        await asyncio.gather(local, here, return_exceptions=True)
        return got

    assert asyncio.run(run()) == [0, 64, 64, 64]
    assert _HivemindStream.held == 0


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch deprecates quantize_per_tensor, used by 8-bit
def test_a_joiner_refuses_a_streamed_state_that_comes_compressed(monkeypatch):
    """The stream's limit counted the bytes on the wire: a donor naming 8-bit compression sent
    64 MiB that hivemind decoded whole (8 bytes for every byte sent: the codes as int64) before
    any check; its declared size is the donor's word. Donors send their state uncompressed: a
    compressed part is refused before anything is decoded."""
    import torch
    from hivemind.compression import serialize_torch_tensor
    from hivemind.utils.streaming import split_for_streaming

    class Joiner(StateSharing):
        def __init__(self, limit: int, tensors) -> None:
            self._state_limit, self.download = limit, [0.0, 0.0, 0.0]
            self.next_chunk_timeout, self.request_timeout = 5.0, 5.0
            self._p2p, self.prefix = None, "run"
            self.serializer = SimpleNamespace(loads=lambda raw: {"bytes": 1})
            self.tensors = tensors

        def get_stub(self, *args, **kwargs):
            tensors = self.tensors

            async def rpc_download_state(request):
                async def stream():  # as hivemind's: the metadata with the first part
                    parts = [p for tensor in tensors for p in split_for_streaming(tensor, 1 << 20)]
                    yield averaging_pb2.DownloadData(tensor_part=parts[0], metadata=b"m")
                    for part in parts[1:]:
                        yield averaging_pb2.DownloadData(tensor_part=part)

                return stream()

            return SimpleNamespace(rpc_download_state=rpc_download_state)

    eight_bit = runtime_pb2.CompressionType.UNIFORM_8BIT
    packed = serialize_torch_tensor(torch.randn(1 << 20), eight_bit)  # 1 MiB on the wire
    decoded: list = []
    monkeypatch.setattr(state_sharing, "deserialize_torch_tensor", lambda part: decoded.append(part))
    assert asyncio.run(Joiner(8 << 20, [packed])._download_from(_Id("donor"))) == (None, False)
    assert decoded == []  # refused before decoding, though its bytes were within the limit
    monkeypatch.undo()
    plain = serialize_torch_tensor(
        torch.randn(1 << 20), runtime_pb2.CompressionType.NONE
    )  # as donors send it
    (metadata, tensors), stalled = asyncio.run(Joiner(8 << 20, [plain])._download_from(_Id("donor")))
    assert [t.numel() for t in tensors] == [1 << 20]


def test_a_streamed_part_is_counted_whole_and_only_a_first_part_has_a_shape(caplog):
    """The limit counted a part's buffer and metadata only: parts with an empty buffer and a
    shape of 4 M numbers counted nothing, and were kept at 8x their size (600 MiB sent against
    an 8 MiB limit grew the joiner to 5 GB; a review, 2026-12-06)."""

    class Joiner(StateSharing):
        def __init__(self, parts: list) -> None:
            self._state_limit, self.download = 8 << 20, [0.0, 0.0, 0.0]
            self.next_chunk_timeout, self.request_timeout = 5.0, 5.0
            self._p2p, self.prefix, self.sent = None, "run", 0
            self.serializer = SimpleNamespace(loads=lambda raw: {"bytes": 1})
            self.parts = parts

        def get_stub(self, *args, **kwargs):
            async def rpc_download_state(request):
                async def stream():
                    first = runtime_pb2.Tensor(buffer=bytes(4), size=[4], dtype="float32")  # of 16
                    yield averaging_pb2.DownloadData(tensor_part=first, metadata=b"m")
                    for part in self.parts:
                        self.sent += 1
                        yield averaging_pb2.DownloadData(tensor_part=part)

                return stream()

            return SimpleNamespace(rpc_download_state=rpc_download_state)

    shaped = runtime_pb2.Tensor(size=[1] * 1000)  # a later part naming a shape
    joiner = Joiner([shaped] * 3)
    with caplog.at_level("WARNING", logger="swarm.state_sharing"):
        assert asyncio.run(joiner._download_from(_Id("donor"))) == (None, False)
    assert joiner.sent == 1 and "a tensor part with a shape of 1000 dimensions" in caplog.text
    deep = runtime_pb2.Tensor(buffer=bytes(4), size=[1] * 65, dtype="float32")
    assert asyncio.run(Joiner([deep])._download_from(_Id("donor"))) == (None, False)
    # Bytes in a field the joiner does not read count too: three parts of 3 MiB of them each.
    from google.protobuf.internal.encoder import _VarintBytes

    unknown = b"\x7a" + _VarintBytes(3 << 20) + bytes(3 << 20)  # field 15, length-delimited
    part = runtime_pb2.Tensor.FromString(runtime_pb2.Tensor(buffer=bytes(4)).SerializeToString() + unknown)
    padded = Joiner([part] * 3)
    assert asyncio.run(padded._download_from(_Id("donor"))) == (None, False)
    assert "it sent over 8 MiB" in caplog.text
    small = Joiner([runtime_pb2.Tensor(buffer=bytes(4))] * 3)  # an honest stream's later parts
    (_, tensors), _ = asyncio.run(small._download_from(_Id("donor")))
    assert [t.numel() for t in tensors] == [4]


def test_streamings_state_limit_counts_the_whole_model_not_fragment_0(monkeypatch):
    """Fragment 0's averager serves the whole model's state (θ, momentum and AdamW of every
    parameter), but its limit was 8 copies of its own fragment: with 4 fragments, every download
    of a model past 8.4 M parameters was refused as too large."""
    import torch

    from swarm import averaging
    from swarm.records import RunKeys
    from workbench.config import AveragingConfig

    made: dict = {}

    class Made(Exception):
        pass

    def capture(*args, **kwargs):
        made.update(kwargs)
        raise Made

    monkeypatch.setattr(averaging, "GroupAverager", capture)
    dht = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "QmMe"))
    with pytest.raises(Made):
        averaging.SwarmAverager(
            dht, keys=RunKeys("limit"), tensors_like=[torch.empty(1000, device="meta")], board=None,
            beat=lambda stage: None, state_provider=lambda: None, config=AveragingConfig(), group="fragment0",
            state_shapes=[(1000,), (3000,)],
        )  # fmt: skip
    assert made["state_numel"] == 4000


def test_the_stream_downloads_record_names_stallers_of_this_download_only():
    """The record of a stream download named every donor it asked (one that refused at once, or
    could not be dialed, too), and an abandoned download running on wrote into the next one's."""
    import multiprocessing as mp

    donor = StateSharing.__new__(StateSharing)
    donor._streamed, donor._stream_tag = mp.Array("c", 1024), 3
    donor._note_streamed(3, ["QmSlow", "QmNow"])
    donor._note_streamed(2, ["QmOld"])  # an abandoned download: a later one was asked for
    assert donor.streamed_from(3) == ["QmSlow", "QmNow"] and donor.streamed_from(2) == []
    donor._note_streamed(3, [])
    assert donor.streamed_from(3) == []


def test_the_first_ranked_donors_offer_is_waited_for_past_the_others_grace():
    """On a busy machine the freshest donor's offer came in past the others' grace (0.25 s after
    the first): the joiner took an older state, and which donor came first (and so who witnessed
    whom) was the machine's load's (`make faults`, stop 58). It is waited for up to TOP_WAIT s."""

    class Donors(StateSharing):
        def __init__(self, delays: dict[str, float]) -> None:
            self.delays = delays

        async def _offer_from(self, donor):  # type: ignore[no-untyped-def]
            await asyncio.sleep(self.delays[donor])
            return (SimpleNamespace(peer=str(donor)), 0, b"", None)

    fresh, stale = _Id("fresh"), _Id("stale")
    got = asyncio.run(Donors({"fresh": 0.8, "stale": 0.01})._first_offers([fresh, stale]))
    assert [o[0].peer for o in got] == ["fresh", "stale"]
    silent = asyncio.run(Donors({"fresh": 30.0, "stale": 0.01})._first_offers([fresh, stale]))
    assert [o[0].peer for o in silent] == ["stale"]  # a silent first-ranked donor costs TOP_WAIT only


def test_a_donor_that_makes_no_offer_gives_its_place_to_the_next():
    """Six fresh keys declaring the freshest step, with no process behind them, took the four
    places a joiner asked for offers: it got none and fell back to hivemind's stream (stop 59).
    A donor that makes no offer gives its place to the next; at most MAX_DONORS are taken."""

    class Donors(StateSharing):
        def __init__(self, honest: set[str]) -> None:
            self.honest, self.asked = honest, []

        async def _offer_from(self, donor):  # type: ignore[no-untyped-def]
            self.asked.append(str(donor))
            await asyncio.sleep(0.01)
            return (SimpleNamespace(peer=str(donor)), 0, b"", None) if donor in self.honest else None

    ranked = [_Id(f"fake{i}") for i in range(6)] + [_Id("a"), _Id("b")]
    got = asyncio.run(Donors({"a", "b"})._first_offers(ranked))
    assert [o[0].peer for o in got] == ["a", "b"]
    every = Donors({f"h{i}" for i in range(6)})
    got = asyncio.run(every._first_offers([_Id(f"h{i}") for i in range(6)]))
    assert len(got) == state_sharing.MAX_DONORS and every.asked == [f"h{i}" for i in range(4)]


def test_fresh_keys_take_half_the_places_a_joiner_asks_for_offers_at_most():
    """A declaration costs a fresh key nothing; a donor this peer met through the DHT runs a
    process. The donors asked for offers alternate: the best declared not asked yet, and the best
    connected one. A fresher donor not connected to is still asked first (a review: connected
    donors first made a joiner take a stale state while a fresher one was on offer)."""
    from swarm.state_sharing import half_connected

    fakes = [_Id(f"fake{i}") for i in range(6)]
    honest, stale = _Id("honest"), _Id("stale")
    assert half_connected([*fakes, honest, stale], {honest, stale})[:4] == [fakes[0], honest, fakes[1], stale]
    fresh = _Id("fresh")  # declares the freshest step, not connected (yet)
    assert half_connected([fresh, honest, stale], {honest, stale}) == [fresh, honest, stale]
    assert half_connected([honest, *fakes], {honest}) == [honest, *fakes]
    assert half_connected([], set()) == []


def test_the_offers_take_at_most_offer_seconds(monkeypatch):
    """Donors whose dials hang (10 s each), four at a time, would hold a joiner's offers for 16
    waves: nothing is asked or waited for past OFFER_SECONDS (a review, stop 59)."""
    monkeypatch.setattr(state_sharing, "OFFER_SECONDS", 0.3)

    class Hanging(StateSharing):
        def __init__(self) -> None:
            self.asked = 0

        async def _offer_from(self, donor):  # type: ignore[no-untyped-def]
            self.asked += 1
            await asyncio.sleep(0.1)
            return None

    donors = Hanging()
    began = asyncio.run(_timed(donors._first_offers([_Id(f"d{i}") for i in range(64)])))
    assert began < 1.0 and donors.asked <= 16, (began, donors.asked)


async def _timed(awaitable) -> float:  # type: ignore[no-untyped-def]
    import time

    started = time.monotonic()
    await awaitable
    return time.monotonic() - started


def test_a_joiner_asks_for_offers_in_the_half_connected_order():
    """The test above checks the order; this one that a joiner asks in it: with the donors asked
    in their declared order instead (one line), fresh keys took the places again and no test
    failed (a review, 2026-12-06)."""
    fakes = [_Id(f"fake{i}") for i in range(6)]
    honest, stale = _Id("honest"), _Id("stale")

    class Joiner(StateSharing):
        def __init__(self) -> None:
            self._state_direct, self._witnesses, self.asked = True, {}, None
            self._p2p = SimpleNamespace(list_peers=self._list_peers)

        async def _list_peers(self):  # type: ignore[no-untyped-def]
            return [SimpleNamespace(peer_id=honest), SimpleNamespace(peer_id=stale)]

        async def _donors(self, exclude):  # type: ignore[no-untyped-def]
            return [*fakes, honest, stale]

        async def _first_offers(self, donors):  # type: ignore[no-untyped-def]
            self.asked = list(donors)
            return []

    joiner = Joiner()
    from hivemind.utils.mpfuture import MPFuture

    future = MPFuture()
    asyncio.run(joiner._state_offers(future, (), {}))
    assert joiner.asked[:4] == [fakes[0], honest, fakes[1], stale], joiner.asked


# A review of the state download (2026-12-06): four ways a donor, or a slow stream, got past
# the joiner's bounds.


def _stream_joiner(limit: int):  # type: ignore[no-untyped-def]
    from hivemind.utils.serializer import MSGPackSerializer

    from swarm.state_sharing import StateSharing

    class Joiner(StateSharing):
        serializer = MSGPackSerializer
        next_chunk_timeout = request_timeout = 5.0
        prefix, _p2p = "run", None

    joiner = Joiner()
    joiner._init_state_sharing(fault_file=None, direct=False, state_host=None, limit=limit)
    return joiner


DONOR = "QmTBdzW9rC9Qb7TuFJ6ePChaQQ5iUSmMBXwMzRfK8KfCMS"


def test_a_stream_of_countless_empty_tensors_is_refused():
    """14 bytes on the wire each, 1.5 KB in the joiner: 400,000 empty tensors grew it by 600 MB
    within a 6 MB byte count. A stream of more tensors than any state holds is refused."""
    import asyncio

    from hivemind.p2p import PeerID
    from hivemind.proto import averaging_pb2, runtime_pb2
    from hivemind.utils.serializer import MSGPackSerializer

    from swarm.state_transfer import MAX_TENSORS

    sent = []

    class Stub:
        async def rpc_download_state(self, request):  # type: ignore[no-untyped-def]
            async def parts():  # type: ignore[no-untyped-def]
                yield averaging_pb2.DownloadData(
                    metadata=MSGPackSerializer.dumps({"outer_step": 1}),
                    tensor_part=runtime_pb2.Tensor(dtype="float32", size=[0]),
                )
                for _ in range(MAX_TENSORS + 10):
                    sent.append(1)
                    yield averaging_pb2.DownloadData(
                        tensor_part=runtime_pb2.Tensor(dtype="float32", size=[0])
                    )

            return parts()

    joiner = _stream_joiner(64 << 20)
    joiner.get_stub = lambda p2p, peer, namespace: Stub()
    got, stalled = asyncio.run(joiner._download_from(PeerID.from_base58(DONOR)))
    assert got is None and not stalled and len(sent) <= MAX_TENSORS + 1  # (refused at the next)


def test_a_stream_download_stops_at_the_joiners_deadline_and_ends_quietly():
    """The joiner gave up at its deadline (its future cancelled) and the averager's stream went
    on through every donor, then raised InvalidStateError into a task nobody awaited."""
    import asyncio

    from hivemind.p2p import PeerID
    from hivemind.utils import MPFuture

    joiner, streamed = _stream_joiner(1 << 30), []

    async def donors(exclude):  # type: ignore[no-untyped-def]
        return [PeerID.from_base58(DONOR)] * 3

    async def download_from(peer):  # type: ignore[no-untyped-def]
        streamed.append(peer)
        await asyncio.sleep(3)  # a stream longer than the joiner's deadline
        return ({"outer_step": 1}, []), False

    async def sketches(peers, seed, timeout, token=None):  # type: ignore[no-untyped-def]
        return {}

    joiner._donors, joiner._download_from, joiner._sketches_from = donors, download_from, sketches

    async def main() -> None:
        future = MPFuture()
        task = asyncio.ensure_future(joiner._load_state_from_peers(future, timeout=0.5, tag=1))
        await asyncio.sleep(0.3)
        future.cancel()  # the joiner's deadline
        await asyncio.wait_for(task, 5)  # (raised InvalidStateError, after 3 s)
        assert task.exception() is None and len(streamed) == 1  # (not on through every donor)

    asyncio.run(main())


def test_a_layout_with_slices_larger_than_its_state_cuts_is_refused():
    """One slice of a whole state: its timeout, from its size, ran to hours, and a donor that
    sent all of it but a byte held the download's thread, socket and buffer past its end."""
    import pytest
    import torch

    from swarm.state_transfer import SLICE_BYTES, Layout

    tensors = [torch.zeros(4 << 20), torch.zeros(4 << 20)]  # 32 MiB
    honest = Layout.of(tensors, 1)
    assert Layout.from_wire(honest.to_wire(), 1 << 30) == honest
    with pytest.raises(ValueError, match="slices larger"):
        Layout.from_wire(dict(honest.to_wire(), slice=honest.total), 1 << 30)
    assert honest.slice_bytes == SLICE_BYTES


def test_the_offer_of_a_model_of_many_tensors_is_read():
    """An offer's metadata holds about 35 bytes a trained tensor (AdamW's keys): past 3,700
    tensors it was over the board's 128 KiB bound on bytes, dropped unsaid, and every join took
    hivemind's stream instead (about 10x slower)."""
    from swarm.rendezvous import pack, unpack
    from swarm.state_sharing import MAX_OFFER

    offer = pack({"ok": True, "metadata": b"k" * 35 * 20_000})
    assert unpack(offer) == {} and unpack(offer, max_bin=MAX_OFFER)["ok"] is True


def test_a_private_run_serves_its_state_to_its_peers_only(monkeypatch):
    """Anybody who connected to a peer of a private run downloaded its θ and optimizer state (its
    namespace is in its handlers' names, which libp2p lists to any caller: a review, stop 64).
    Now only a peer with a heartbeat under the run's key (which the secret's HMAC guards) is
    served: a joiner whose first heartbeat lands while it asks is; an outsider is not, and many
    outsiders asking at once cost one read of the run's heartbeats a pause, not one each, and
    none waits longer than one alone would (a review: queued one behind another, 40 of them held
    a late joiner 19.6 s, and a live peer held 100 outsiders' requests up to 56 s each)."""
    import time

    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from swarm.identity import public_key_text
    from swarm.signed_groups import peer_of

    monkeypatch.setattr(state_sharing, "MEMBERS_WAIT", 1.0)
    monkeypatch.setattr(state_sharing, "MEMBERS_PAUSE", 0.1)

    def subkey(key: RSAPrivateKey) -> bytes:
        return b"[owner:" + public_key_text(key).encode() + b"]"

    joiner_key, outsider_key = RSAPrivateKey(), RSAPrivateKey()
    joiner, outsider = peer_of(subkey(joiner_key)), peer_of(subkey(outsider_key))
    heartbeats: dict[bytes, str] = {b"[owner:not a key]": "beat"}
    reads = []

    class _DHT:
        def get(self, key, *, latest, return_future):
            reads.append(key)
            live = get_dht_time() + 10  # each heartbeat's expiration
            found = asyncio.get_running_loop().create_future()
            entries = {k: SimpleNamespace(value=v, expiration_time=live) for k, v in heartbeats.items()}
            found.set_result(SimpleNamespace(value=entries))
            return found

    donor = _Donor()
    donor._members_key, donor._members, donor._members_read = "run_peers", {}, 0.0
    donor._members_read_task, donor._members_waiting = None, 0
    donor.dht = _DHT()

    async def parts(peer) -> int:
        stream = donor.rpc_download_state(averaging_pb2.DownloadRequest(), SimpleNamespace(remote_id=peer))
        return len([message async for message in stream])

    async def main() -> list[int]:
        async def first_heartbeat() -> None:
            await asyncio.sleep(0.3)
            heartbeats[subkey(joiner_key)] = "beat"

        landing = asyncio.ensure_future(first_heartbeat())
        got = await asyncio.gather(
            *(parts(outsider) for _ in range(7)), parts(joiner), *(parts(outsider) for _ in range(40))
        )
        await landing
        return got

    started = time.monotonic()
    got = asyncio.run(main())
    took = time.monotonic() - started
    assert got[7] == 64 and got[:7] + got[8:] == [0] * 47
    assert took < 2 * state_sharing.MEMBERS_WAIT, took  # none waited past MEMBERS_WAIT
    assert set(reads) == {"run_peers"} and len(reads) <= took / 0.1 + 2, (len(reads), took)
    assert asyncio.run(parts(joiner)) == 64  # known now, until its heartbeat expires: no read
    assert len(reads) <= took / 0.1 + 2


def _aimed_at(theta: torch.Tensor, seed: bytes) -> torch.Tensor:
    """θ reflected across the rows of ``seed``'s R (R θ' = R θ, |θ'| = |θ|, θ' about -θ): what a
    donor that knows a witness's seed serves to fool that witness's sketch."""
    from swarm.sketch import CHUNK, ROWS, _matrices

    x = theta.reshape(-1).double()
    chunks = -(-x.numel() // CHUNK)
    outer, inner = _matrices(seed, chunks, False)
    padded = torch.zeros(chunks * CHUNK, dtype=torch.float64)
    padded[: x.numel()] = x
    rows = (outer.double()[:, :, None] * inner[:, None, :]).reshape(ROWS, -1)
    rows[:, x.numel() :] = 0
    projected = rows.T @ torch.linalg.solve(rows @ rows.T, rows @ padded)
    return (2 * projected - padded)[: x.numel()].float().view(theta.shape)


def test_a_witness_colluding_with_a_streaming_donor_cannot_lend_it_the_others_seeds():
    """hivemind's stream binds nothing before it ends, and every witness got the same seed while
    it ran: one witness colluding with the donor passed it on, the donor held its first chunk
    back and served a θ aimed at that seed (about -θ, with the same 8 projections and norm),
    and the honest witnesses, round mates of the joiner, confirmed it (a review, stop 72). Each
    witness now gets a seed of its own: the colluder's fools only its own vote."""
    import asyncio

    from hivemind.p2p import PeerID
    from hivemind.utils import MPFuture

    from swarm.claims import judge_state
    from swarm.download import _parse_state, _sketched
    from swarm.sketch import state_sketches

    torch.manual_seed(0)
    shapes = [(64, 80), (300,)]
    honest = [torch.randn(shape) * 0.02 for shape in shapes]
    joiner, leaked, seeds = _stream_joiner(1 << 30), asyncio.Event(), {}

    async def donors(exclude):  # type: ignore[no-untyped-def]
        return [PeerID.from_base58(DONOR)]

    async def sketches(peers, seed, timeout, token=None):  # type: ignore[no-untyped-def]
        (peer,) = peers
        seeds[peer] = seed
        if peer == "colluder":
            leaked.set()
        return {peer: (7, state_sketches(honest, seed))}  # the colluder's R sees no difference

    async def download_from(peer):  # type: ignore[no-untyped-def]
        await asyncio.wait_for(leaked.wait(), 5)  # the first chunk held back for the seed
        aimed = [_aimed_at(t, seeds["colluder"] + i.to_bytes(4, "little")) for i, t in enumerate(honest)]
        metadata = dict(outer_step=7, num_params=len(shapes), num_pending=0, inner_keys=[])
        return (metadata, [*aimed, *(torch.zeros(shape) for shape in shapes)]), False

    joiner._donors, joiner._sketches_from, joiner._download_from = donors, sketches, download_from

    async def main():  # type: ignore[no-untyped-def]
        future = MPFuture()
        await joiner._load_state_from_peers(future, timeout=10, verifiers=["colluder", "a", "b"], tag=1)
        return future.result()

    metadata, tensors, donor, served_seeds, answers = asyncio.run(main())
    assert len(set(served_seeds.values())) == 3 and served_seeds == seeds
    state = _parse_state(metadata, tensors, shapes)
    cosine = torch.nn.functional.cosine_similarity(state.params[0].reshape(-1), honest[0].reshape(-1), dim=0)
    assert cosine < -0.9  # the attack is real: θ' is about -θ
    mine = _sketched(state.params, served_seeds)
    verdict = judge_state(7, mine, answers, donor=donor, vouched={"a", "b"})
    assert not verdict.accept and verdict.contradicted, verdict.why
    # What one seed for all did: every witness's sketch matched the aimed θ.
    shared = state_sketches(state.params, served_seeds["colluder"])
    fooled = {p: (7, state_sketches(honest, served_seeds["colluder"])) for p in answers}
    assert judge_state(7, shared, fooled, donor=donor, vouched={"a", "b"}).accept
