"""Fuzzing the decoders of untrusted input (hypothesis): records from other peers, steering
records, averaging group info, addresses, run ids, shards and recordings. Each either returns
a valid value or raises its own documented error, never anything else."""

from __future__ import annotations

import contextlib
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.addresses import AddressError, parse_peer_address
from swarm.errors import SwarmError
from swarm.gathered import _parse_info, diverged_from_group
from swarm.monitor import Reading
from swarm.records import ControlState, PeerHeartbeat, RunManifest, check_run_id, parse_record
from workbench.cli.options import parse_shard

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=6)
    ),
    max_leaves=20,
)
FIELDS = sorted(PeerHeartbeat.model_fields)
heartbeat_like = st.dictionaries(st.sampled_from(FIELDS + ["extra"]), json_values, max_size=len(FIELDS) + 1)


@settings(max_examples=300, deadline=None)
@given(st.one_of(json_values, heartbeat_like))
def test_records_from_the_dht_parse_or_are_dropped(value) -> None:
    for model in (PeerHeartbeat, RunManifest, ControlState):
        record = parse_record(model, value)
        assert record is None or isinstance(record, model)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(json_values, heartbeat_like), max_size=5), json_values)
def test_group_info_from_other_peers_never_raises(group, mine) -> None:
    info = mine if isinstance(mine, dict) else {"peer": "me", "outer_step": 1, "fingerprint": [1.0]}
    _parse_info(info)
    verdict = diverged_from_group(info, group)
    assert verdict is None or isinstance(verdict, str)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_addresses_parse_or_raise_address_error(text) -> None:
    try:
        parse_peer_address(text)
    except AddressError as error:
        assert "\n" not in str(error)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_run_ids_and_shards(text) -> None:
    with contextlib.suppress(SwarmError):
        check_run_id(text)
    try:
        index, count = parse_shard(text)
        assert isinstance(index, int) and isinstance(count, int)
    except ValueError as error:
        assert "--shard" in str(error)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_recorded_readings_parse_or_raise_value_errors(value) -> None:
    with contextlib.suppress(KeyError, TypeError, ValueError):
        Reading.from_json(value if isinstance(value, dict) else {"time": value, "run_id": "x"})
    json.dumps(value, default=str)
