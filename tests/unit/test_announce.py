"""A peer's start: the join command is out before the "started" event that tools wait for."""

from __future__ import annotations

import types

from workbench.run import peer as peer_module


def test_the_join_command_is_printed_before_the_started_event(monkeypatch):
    """Tools (tests, the demo, a notebook) wait for "started" and then read the printed join
    command: under load they read an empty stdout when the command came after the event."""
    order: list[str] = []
    monkeypatch.setattr(peer_module, "visible_addresses", lambda dht: ["/ip4/127.0.0.1/tcp/1/p2p/Qm"])
    stub = types.SimpleNamespace(
        config=types.SimpleNamespace(network=types.SimpleNamespace(initial_peers=[])),
        beat=lambda stage: order.append(f"beat {stage.value}"),
        dht=None,
        on_started=lambda addresses, key, kept: order.append(f"printed {addresses[0]} {key} {kept}"),
        session=types.SimpleNamespace(identity_path="/tmp/k.key", key_kept=False),
        emit=lambda kind, **fields: order.append(kind),
        peer_id="Qm",
        device="cpu",
        manifest=None,
        fingerprint=lambda: ("f", "summary"),
        model=types.SimpleNamespace(num_params=lambda: 1),
        corpus=types.SimpleNamespace(source="bytes"),
    )
    peer_module.Peer._announce(stub)
    assert order[1:] == ["printed /ip4/127.0.0.1/tcp/1/p2p/Qm /tmp/k.key False", "started"], order
