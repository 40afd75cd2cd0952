"""An outsider's client for a peer's state handlers (tests of who a peer serves its state to):
in a test's own process, or in a helper process on a lab's machine."""

from __future__ import annotations

from swarm.records import RunKeys


def asks_for_the_state(session, address: str, keys: RunKeys) -> tuple[int, bool]:
    """Call the peer at ``address``'s state handlers as ``session``'s node: the parts of the
    state it streams, and whether it sketched θ."""
    import asyncio
    import os

    from hivemind.p2p import PeerID
    from hivemind.proto import averaging_pb2

    from swarm.rendezvous import pack, unpack

    donor = PeerID.from_base58(address.rsplit("/p2p/", 1)[1])
    handlers = f"{keys.group('diloco')}::GroupAverager"

    async def ask() -> tuple[int, bool]:
        p2p = await session.dht.replicate_p2p()

        async def parts() -> int:
            stream = await p2p.iterate_protobuf_handler(
                donor,
                f"{handlers}.rpc_download_state",
                averaging_pb2.DownloadRequest(),
                averaging_pb2.DownloadData,
            )
            return len([message async for message in stream])

        async def sketched() -> bool:
            answer = await p2p.call_protobuf_handler(
                donor,
                f"{handlers}.rpc_theta_sketch",
                averaging_pb2.DownloadData(metadata=pack({"seed": os.urandom(16)})),
                averaging_pb2.DownloadData,
            )
            return bool(unpack(answer.metadata).get("ok"))

        counted, ok = await asyncio.gather(parts(), sketched())  # (an outsider waits on both at once)
        return counted, ok

    return asyncio.run(asyncio.wait_for(ask(), 60))
