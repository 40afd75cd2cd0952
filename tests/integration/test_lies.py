"""Lying heartbeats against real peers (docs/security.md): a process with nothing but its own
fresh key publishes schema-valid, signed heartbeats that claim to be far ahead, to be training
forever, or absurd metrics. Honest peers keep averaging in pairs, never download the state
because of it, end on the same θ, and `workbench status` shows the liar as ignored."""

from __future__ import annotations

import contextlib
import json
import math
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from swarm.faults import FaultPlan
from tests.integration.conftest import (
    FAST,
    JOIN_ROUNDS,
    NETNS,
    helper,
    interrupt_all,
    kill_group,
    lab_peer,
    max_abs_diff,
    readme_flags,
    steady,
    workbench,
)
from workbench.local import netlab

LIAR = """
import sys, time
from hivemind.utils import get_dht_time
from swarm.dht import NetworkConfig
from swarm.records import PeerHeartbeat, RunKeys, Stage, mate_tag
from swarm.session import connect

mode, address, run_id = sys.argv[1:4]
keys = int(sys.argv[4]) if len(sys.argv) > 4 else 1  # each a session of its own: a fresh key
sessions = [connect(NetworkConfig(initial_peers=[address]), RunKeys(run_id)) for _ in range(keys)]
print("ready", flush=True)
while True:
    honest = [p for p in sessions[0].board.fetch().values() if p.name != "liar"]
    top = max((p.outer_step for p in honest), default=0)
    named = [p.peer_id for p in honest]
    claim = {
        "ahead": dict(stage=Stage.WAITING, outer_step=10**6),
        "busy": dict(stage=Stage.TRAINING, outer_step=top),  # always "still training this round"
        "absurd": dict(stage=Stage.WAITING, outer_step=top, loss=-1e30, samples_per_second=1e12),
        # one step past the honest peers: within what a download may lag a claim (CLAIM_LAG)
        "one-ahead": dict(stage=Stage.WAITING, outer_step=top + 1),
        "waiting": dict(stage=Stage.WAITING, outer_step=top),
        # every honest peer flagged as a liar, and named (with the other keys) as a round mate
        "flagging": dict(stage=Stage.JOINING, outer_step=top, ignored={p: "made up" for p in named}),
    }[mode]
    for session in sessions:
        if mode == "flagging":
            claim["averaged_with"] = [mate_tag(p) for p in named + [s.peer_id for s in sessions if s is not session]]
        beat = PeerHeartbeat(peer_id=session.peer_id, name="liar", inner_step=0, inner_steps=5, time=get_dht_time(), **claim)
        session.store.store(session.keys.peers, beat, ttl=10)
    time.sleep(0.5)
"""


@pytest.mark.parametrize(
    "mode",
    [
        # `make test` plays one lie; `make faults` all three (each is a 14-round run).
        pytest.param("ahead", marks=pytest.mark.faults),
        pytest.param("busy", marks=pytest.mark.faults),
        "absurd",
    ],
)
def test_a_lying_heartbeat_moves_nothing(spawn, tmp_path, mode):
    # No --rounds: a fixed-length run (14 rounds take ~15 s) could end on a loaded machine
    # before the liar and then `status` (two more processes importing torch and joining the
    # DHT) were up, leaving nothing to observe. The peers train until the test has seen the
    # lie ignored and them averaging past it, and are then stopped together with Ctrl+C.
    run_id = f"lies-{mode}"
    common = [*FAST, "--run-id", run_id, *steady(tmp_path)]
    first = spawn("a", "start", *common, "--min-peers", "2")
    second = spawn("b", "join", first.address(), *common)
    first.wait_event("round", lambda e: e["outer_step"] >= 1)
    liar = helper(LIAR, mode, first.address(), run_id)
    try:
        assert liar.stdout.readline().strip() == "ready"
        # `status` from a third process: the liar shows as ignored (its own reading for absurd
        # values, the honest peers' flags for lies about rounds), and not among the peers.
        ignored, snapshot, deadline = [], {}, time.monotonic() + 180
        while not ignored and time.monotonic() < deadline:
            status = workbench("status", first.address(), "--run-id", run_id, "--json", timeout=60)
            if status.returncode == 0:
                snapshot = json.loads(status.stdout.splitlines()[-1])
                ignored = [i["peer_id"] for i in snapshot["ignored"]]
        assert ignored and "liar" not in [p["name"] for p in snapshot["peers"]], snapshot
        # Five more rounds with the liar still publishing, then stop both.
        step = max(e["outer_step"] for e in first.events("round")) + 5
        for peer in (first, second):
            peer.wait_event("round", lambda e: e["outer_step"] >= step, timeout=120)
    finally:
        kill_group(liar)
    interrupt_all((first, second))
    for peer in (first, second):
        # Up to `step` (the last round may be cut by Ctrl+C): every round a pair, no resync.
        rounds = [r for r in peer.events("round") if r["outer_step"] <= step]
        assert [r["outer_step"] for r in rounds] == list(range(1, step + 1))
        assert all(r["group_size"] == 2 and not r["resync"] for r in rounds), [
            (r["outer_step"], r["group_size"], r["alone_reason"], r["resync"]) for r in rounds
        ]
        assert "ignoring peer" in peer.stderr()
    assert len(second.events("state_downloaded")) == 1  # when it joined, and never again
    assert not first.events("state_downloaded")
    norms = [{r["outer_step"]: r["global_norm"] for r in p.events("round")} for p in (first, second)]
    assert math.isclose(norms[0][step], norms[1][step], rel_tol=1e-6), (step, norms)


@pytest.mark.faults
@pytest.mark.parametrize("honest", [2, 1])
def test_fresh_keys_outnumbering_the_honest_peers_one_step_ahead_do_not_keep_a_joiner_downloading(
    spawn, tmp_path, honest
):
    """Stop 59's red-team review, end to end: a joiner that has averaged with nobody believed
    "the swarm is past this round" from most heartbeats, so one fresh key more than the honest
    peers, each claiming their step + 1 (within what a download may lag a claim, so no download
    disproved it), sent it to download instead of averaging, round after round. At the step of
    the state it took, the peers whose θ confirmed it now outweigh them: it downloads once,
    averages with the honest peers, and strikes the keys out. With one honest peer its state
    has no other witness than its donor, which is the witness there."""
    run_id = "lies-one-ahead"
    common = [*FAST, "--run-id", run_id, *steady(tmp_path)]
    first = spawn("a", "start", *common, "--min-peers", str(honest))
    peers = [first, *(spawn("b", "join", first.address(), *common) for _ in range(honest - 1))]
    first.wait_event("round", lambda e: e["outer_step"] >= 2 and e["group_size"] == honest)
    keys = helper(LIAR, "one-ahead", first.address(), run_id, str(honest + 1))  # one more than the honest
    try:
        assert keys.stdout.readline().strip() == "ready"
        time.sleep(2.0)  # their first heartbeats stored: the joiner finds them on the board
        third = spawn("c", "join", first.address(), *common)
        joined = third.wait_event("state_downloaded", timeout=120)["outer_step"]
        third.wait_event("round", lambda e: e["outer_step"] >= joined + 8, timeout=180)
    finally:
        kill_group(keys)
    interrupt_all((*peers, third))
    rounds = [r for r in third.events("round") if joined < r["outer_step"] <= joined + 8]
    summary = [(r["outer_step"], r["group_size"], r["alone_reason"], r["resync"]) for r in rounds]
    downloads = [(e["outer_step"], e.get("reason")) for e in third.events("state_downloaded")]
    # When it joined, and never again; with one honest peer, once more at most: the lone owner
    # is itself sent away by the keys' majority (the run's first peers: not defended), steps
    # alone, and may be past the state the joiner took when the joiner's first round begins.
    assert len(downloads) <= (1 + _behind_at_once(third, peers, joined) if honest > 1 else 2), (
        downloads,
        summary,
    )
    assert sum(r["group_size"] == honest + 1 for r in rounds) >= 6, summary
    assert "ignoring peer" in third.stderr()  # the keys, struck out


@pytest.mark.faults
def test_fresh_keys_one_step_ahead_from_the_start_cost_the_runs_first_peers_a_few_rounds(spawn, tmp_path):
    """The run's first peers, before their first round together, have no witness to outweigh
    one fresh key more than them each claiming their step + 1 (docs/security.md, Sybils): the
    keys send them to look for a state to download, which no key can serve. Measured
    (2026-12-07, two runs): the owner stepped alone 2-4 rounds (the keys also count towards its
    --min-peers) and downloaded once or twice, the joiner lost at most its first round, and from
    the round after that both averaged in pairs every round, the keys struck out. This holds
    that bound: a few rounds at the start, then pairs for good."""
    run_id = "lies-one-ahead-first"
    common = [*FAST, "--run-id", run_id, *steady(tmp_path)]
    first = spawn("a", "start", *common, "--min-peers", "2")
    keys = helper(LIAR, "one-ahead", first.address(), run_id, "3")  # one more than the pair
    try:
        assert keys.stdout.readline().strip() == "ready"
        time.sleep(2.0)  # their first heartbeats stored before the second peer comes
        second = spawn("b", "join", first.address(), *common)
        joined = second.wait_event("state_downloaded", timeout=120)["outer_step"]
        second.wait_event("round", lambda e: e["outer_step"] >= joined + 10, timeout=240)
    finally:
        kill_group(keys)
    interrupt_all((first, second))
    for peer, most in ((first, 3), (second, 2)):
        summary = [(r["outer_step"], r["group_size"], r["alone_reason"]) for r in peer.events("round")]
        downloads = [(e["outer_step"], e.get("reason")) for e in peer.events("state_downloaded")]
        assert len(downloads) <= most, (peer.name, downloads, summary)
        later = [r for r in peer.events("round") if joined + 3 < r["outer_step"] <= joined + 10]
        assert len(later) >= 6 and all(r["group_size"] == 2 for r in later), (peer.name, downloads, summary)
        assert "ignoring peer" in peer.stderr()  # the keys, struck out


@pytest.mark.faults
@NETNS
@pytest.mark.skipif(bool(netlab.unavailable()), reason=f"netlab: {netlab.unavailable()}")
def test_fresh_keys_one_step_ahead_on_another_machine_do_not_keep_a_joiner_downloading(spawn, tmp_path):
    """The test above as users deploy: the honest pair and the joiner each on its own machine
    with the README's flags (``--host 0.0.0.0 --announce ...``), the keys' process on a fourth."""
    common = [*FAST, "--run-id", "lies-one-ahead-netns", *steady(tmp_path)]
    with contextlib.ExitStack() as stack:
        peers, first, second, address, wrap, _ = _a_pair(stack, spawn, tmp_path, "netns", common, size=4)
        keys = helper(LIAR, "one-ahead", address, "lies-one-ahead-netns", "3", wrap=wrap)
        try:
            assert keys.stdout.readline().strip() == "ready"
            time.sleep(2.0)
            third = peers.start(3, "join", address, *common)
            joined = third.wait_event("state_downloaded", timeout=120)["outer_step"]
            third.wait_event("round", lambda e: e["outer_step"] >= joined + 8, timeout=180)
        finally:
            kill_group(keys)
        interrupt_all((first, second, third))
    rounds = [r for r in third.events("round") if joined < r["outer_step"] <= joined + 8]
    summary = [(r["outer_step"], r["group_size"], r["alone_reason"], r["resync"]) for r in rounds]
    downloads = [(e["outer_step"], e.get("reason")) for e in third.events("state_downloaded")]
    assert len(downloads) == 1 + _behind_at_once(third, (first, second), joined), (downloads, summary)
    assert sum(r["group_size"] == 3 for r in rounds) >= 6, summary


def _behind_at_once(joiner, honest, joined: int) -> bool:
    """Whether ``joiner`` took the state at step ``joined`` after the honest peers' group for
    the next round had begun: it could not be in that round, the honest peers were past its
    step when its own began, and a second download is what an honest joiner does then, keys
    or not (`make faults`, stop 69: the joiner's download landed 0.26 s after the pair began
    averaging, 30 ms before they stepped). A download that the keys' claims caused comes
    earlier, while the pair still trains."""
    took = joiner.events("state_downloaded")[0]["time"]
    began = [
        r["time"] - r["averaging_seconds"]
        for peer in honest
        for r in peer.events("round")
        if r["outer_step"] == joined + 1
    ]
    return bool(began) and took > min(began)


SQUATTER = """
import sys, time
from swarm.dht import NetworkConfig
from swarm.identity import key_hash
from swarm.manifest import publish_manifest
from swarm.records import RunKeys, RunManifest
from swarm.session import connect

address, run_id = sys.argv[1:3]
session = connect(NetworkConfig(initial_peers=[address]), RunKeys(run_id))
owner = key_hash(session.store.public_key)
publish_manifest(session.store, session.keys, RunManifest(
    run_id=run_id, owner=owner, fingerprint="f" * 16, summary="a squatter's model", created=time.time()))
print(owner, flush=True)
time.sleep(600)
"""


@pytest.mark.faults
def test_a_competing_manifest_neither_hides_the_run_nor_takes_its_steering(spawn, tmp_path):
    """A second manifest for the run id, from another key: `status` still shows the run's own
    (the oldest) and warns; the owner steers with its own key and no --owner; a joiner without
    --owner joins the real run; one that names the squatter's key is refused (its model)."""
    run_id = "contested"
    common = [*FAST, "--run-id", run_id]
    # Until Ctrl+C: status, steer and a refused join take several seconds each, longer than a
    # run of a fixed number of FAST rounds may last.
    owner = spawn("a", "start", *common, "--rounds", "0", "--min-peers", "2")
    address = owner.address()
    squatter = helper(SQUATTER, address, run_id)
    try:
        squatter_hash = squatter.stdout.readline().strip()
        joiner = spawn("b", "join", address, *common, "--rounds", "0")
        owner.wait_event("round", lambda e: e["outer_step"] >= 2 and e["group_size"] == 2)
        cli = [sys.executable, "-m", "workbench"]
        status = subprocess.run(
            [*cli, "status", address, "--run-id", run_id, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        manifest = json.loads(status.stdout.splitlines()[-1])["manifest"]
        assert manifest and manifest["owner"] != squatter_hash
        assert "several owners" in status.stderr and squatter_hash in status.stderr
        steer = subprocess.run(
            [*cli, "steer", address, "--run-id", run_id, "--key", str(tmp_path / "a" / "identity.key"),
             "--outer-lr", "0.5", "--wait", "0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert steer.returncode == 0, steer.stderr
        refused = subprocess.run(
            [*cli, "join", address, *common, "--owner", squatter_hash, "--rounds", "1"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert refused.returncode == 2 and "does not match" in refused.stderr, refused.stderr[-2000:]
    finally:
        kill_group(squatter)
    interrupt_all((owner, joiner), timeout=30)
    assert any(r["group_size"] == 2 for r in joiner.events("round")), joiner.events("round")  # the real run


@pytest.mark.faults
def test_a_donor_serving_a_made_up_state_is_refused(spawn, tmp_path):
    """A member declares itself the most advanced peer (so joiners download from it first) and
    serves θ with 5 % noise. The joiner sketches what it got under a seed the donor never saw,
    the two honest peers' sketches disagree, and it takes the state from one of them instead:
    it averages with them on their θ, never the made-up one."""
    first, third, [joiner] = _a_joiner_beside_a_lying_donor(
        spawn, tmp_path, FaultPlan(serve_noise=0.05, state_priority=1e6), "--run-id", "made-up-state"
    )
    log = joiner.stderr()
    # Refused by its θ ("most peers hold another θ"), or (when the liar finished the round first
    # and the witnesses were still a step behind) as a state nobody asked holds yet (`make faults`
    # at stop 60): either way the liar's state, and never taken.
    liar = third.events("started")[0]["peer_id"][-8:]
    refused = [line for line in log.splitlines() if "refused the state served by" in line]
    assert refused and all(liar in line for line in refused), log[-3000:]
    assert any("most peers hold another θ" in line or "no peer asked holds" in line for line in refused)
    assert "fault injection: serving θ" in third.stderr()
    downloaded = joiner.events("state_downloaded")
    assert downloaded, log[-3000:]
    rounds = [(r["outer_step"], r["group_size"], r["alone_reason"]) for r in joiner.events("round")]
    assert any(size >= 3 for _, size, _ in rounds), (rounds, downloaded)
    assert max_abs_diff(first.global_params(), joiner.global_params()) <= 1e-5


def machines(*netns_marks: pytest.MarkDecorator) -> pytest.MarkDecorator:
    """Each peer on 127.0.0.1, or on its own machine (``workbench.local.netlab``) started with the
    README's multi-machine flags (``--host 0.0.0.0 --announce ...``); ``netns_marks``: the
    latter's own marks."""
    unavailable = netlab.unavailable()
    skip = pytest.mark.skipif(bool(unavailable), reason=f"netlab: {unavailable}")
    return pytest.mark.parametrize(
        "machines", ["loopback", pytest.param("netns", marks=[NETNS, *netns_marks, skip])]
    )


MACHINES = machines()


class _Peers:
    """The peers of one test, on 127.0.0.1 or each on its own machine of ``lab`` (a
    ``workbench.local.netlab.NetLab``) with the README's flags; each killed when the block ends."""

    def __init__(self, spawn, tmp_path, lab=None) -> None:
        self.spawn, self.tmp_path, self.lab, self.started = spawn, tmp_path, lab, []
        self.machine: dict[int, int] = {}  # id(a started peer) -> its machine in the lab

    def __enter__(self) -> _Peers:
        return self

    def __exit__(self, *exc) -> None:
        for each in self.started:
            each.kill()

    def start(self, i: int, *args: str):
        name = "abcde"[i]
        if self.lab is None:
            self.started.append(self.spawn(name, *args))
        else:
            flags = [*args, *readme_flags(self.lab, i)]
            self.started.append(lab_peer(self.lab, i, name, flags, self.tmp_path))
        self.machine[id(self.started[-1])] = i
        return self.started[-1]

    def address(self, peer) -> str:
        """The address others join ``peer`` at (on its machine's network, in a lab)."""
        if self.lab is None:
            return peer.address()
        host = f"/ip4/{self.lab.address(self.machine[id(peer)])}/"
        return next(a for a in peer.wait_event("started")["addresses"] if a.startswith(host))

    def wait_all(self) -> None:
        """Until every peer ends its run (each as long as it keeps writing events)."""
        for each in self.started:
            assert each.wait(progressing=True) == 0, each.stderr()


def _a_pair(stack, spawn, tmp_path, machines: str, common: list[str], size: int = 3):
    """Two honest peers averaging as a pair, each on its own machine of a lab of ``size`` with
    the README's flags (``machines == "netns"``) or on 127.0.0.1; (peers, first, second, the
    address to join at, where an attacker runs: the lab's machine 2, and the README's flags for
    an attacker's own node there, which the peers must reach)."""
    lab = stack.enter_context(netlab.NetLab(size, rate=None)) if machines == "netns" else None
    peers = stack.enter_context(_Peers(spawn, tmp_path, lab))
    first = peers.start(0, "start", *common)
    address = peers.address(first)
    second = peers.start(1, "join", address, *common)
    first.wait_event("round", lambda e: e["group_size"] == 2, timeout=120)
    wrap = list if lab is None else (lambda argv: lab.command(2, argv))
    return peers, first, second, address, wrap, [] if lab is None else readme_flags(lab, 2)


@pytest.mark.faults
@MACHINES
def test_a_joiner_arriving_while_the_others_wait_for_min_peers_refuses_a_made_up_state(
    spawn, tmp_path, machines
):
    """The liar c joins a first; b joins while a and c wait for ``--min-peers``. A peer waiting
    was no witness: b took c's made-up θ on c's word, and at the first round c (a round mate
    now, lying as a witness too) tied with the honest donor a, and b took c's state again,
    round after round (``make faults``, stop 52). Now a, waiting, witnesses the state at its
    step: b refuses c's, and ends on a's θ."""
    liar = tmp_path / "liar.json"
    FaultPlan(serve_noise=0.05, state_priority=1e6).write(liar)
    common = [*FAST, "--rounds", "12", "--min-peers", "3", "--run-id", "made-up-state-at-the-start"]
    with contextlib.ExitStack() as stack:
        lab = stack.enter_context(netlab.NetLab(3, rate=None)) if machines == "netns" else None
        peers = stack.enter_context(_Peers(spawn, tmp_path, lab))
        first = peers.start(0, "start", *common)
        address = peers.address(first)
        third = peers.start(2, "join", address, "--fault-file", str(liar), *common)
        liar_id = third.wait_event("started")["peer_id"][-8:]
        third.wait_event("state_downloaded")  # c now waits for --min-peers beside a (and declares
        # its 10⁶ priority at once: b's first offers come from it)
        joiner = peers.start(1, "join", address, *common)
        peers.wait_all()
    log = joiner.stderr()
    assert f"refused the state served by {liar_id}: most peers hold another θ at outer step 0" in log, log[
        -3000:
    ]
    took = [line for line in log.splitlines() if "the state served by" in line and "refused" not in line]
    assert not any(liar_id in line for line in took), took
    assert max_abs_diff(first.global_params(), joiner.global_params()) <= 1e-5


@pytest.mark.faults
@MACHINES
def test_a_donor_serving_a_made_up_state_one_step_behind_is_refused(spawn, tmp_path, machines):
    """The same liar labels its made-up θ one outer step older than the swarm is: no honest
    peer holds that step any more, so none can contradict the sketch. The joiner's witnesses
    were past that step before the download began (their heartbeats said so when it chose
    them): the state was old when served, and it is refused rather than taken "unconfirmed"
    (which was taken, found stale at the next round, downloaded again from the same liar: for
    ever). The joiner takes an honest peer's state and averages on its θ.

    Two joiners, the second once the first has its state: a witness's heartbeat can lag its
    round (FAST rounds last about a second), and a download that begins then sees witnesses
    that are not past the liar's step yet; it is taken unconfirmed and found stale at the next
    round (the joiner then downloads from another donor), and the check had nothing to do (1 of
    about 14 runs of one joiner, netns, 2026-12-05). At least one of the two must meet it.

    On hivemind's state stream (``--data-plane hivemind``), where donors are tried in the order
    of the priority they declare, the liar's 10⁶ goes first. (The direct transport takes the
    latest step offered, so there an older offer loses to the honest ones anyway.)

    ``netns``: each peer on its own machine (``workbench.local.netlab``), started with the
    README's multi-machine flags (``--host 0.0.0.0 --announce ...``)."""
    plan = FaultPlan(serve_noise=0.05, serve_steps_back=1, state_priority=1e6)
    flags = ["--run-id", "old-made-up-state", "--data-plane", "hivemind"]
    if machines == "netns":
        with netlab.NetLab(5, rate=None) as lab:
            first, third, joiners = _a_joiner_beside_a_lying_donor(
                spawn, tmp_path, plan, *flags, lab=lab, joiners=2
            )
    else:
        first, third, joiners = _a_joiner_beside_a_lying_donor(spawn, tmp_path, plan, *flags, joiners=2)
    logs = [joiner.stderr() for joiner in joiners]
    # The old state refused as such, or the liar's stream refused by another check before the
    # step was looked at (`make faults` at stop 60: "served an incomplete or malformed state",
    # while the other joiner met the lagging-heartbeat case above); never kept (below).
    liar = third.events("started")[0]["peer_id"][-8:]
    refused = ("the donor served an old state", f"{liar} served an incomplete or malformed state")
    # Or both joiners met the lagging-heartbeat case (`make faults` at stop 63, under load: each
    # took the liar's state "unconfirmed: the others moved past ... during the download", found
    # itself out of step at once and downloaded from an honest donor). The check's work is then
    # the count below: without it the liar's state came back unconfirmed at every round.
    lagged = [
        f"served by {liar} at outer step" in line and "moved past" in line
        for log in logs
        for line in log.splitlines()
    ]
    assert any(why in log for log in logs for why in refused) or any(lagged), [log[-3000:] for log in logs]
    assert "fault injection: serving the state as 1 outer step(s) older" in third.stderr()
    for joiner, log in zip(joiners, logs):
        # Without the check a joiner took the liar's state again at every round, for the whole run.
        assert log.count("unconfirmed") <= 3, log[-3000:]
        rounds = [(r["outer_step"], r["group_size"], r["alone_reason"]) for r in joiner.events("round")]
        assert any(size >= 3 for _, size, _ in rounds), rounds
        assert max_abs_diff(first.global_params(), joiner.global_params()) <= 1e-5


def _a_joiner_beside_a_lying_donor(
    spawn, tmp_path, plan: FaultPlan, *flags: str, lab=None, joiners: int = 1
) -> tuple[Any, Any, list[Any]]:
    """Peers a and b, and c serving its state with ``plan``'s faults, train in threes; then d
    joins (and e once d has its state, with ``joiners=2``). All run to the end: (a, the liar c,
    the joiners). With ``lab`` (``workbench.local.netlab.NetLab``): each on its own machine,
    with the README's flags."""
    liar = tmp_path / "liar.json"
    plan.write(liar)
    common = [*FAST, "--rounds", str(JOIN_ROUNDS), *flags]
    with _Peers(spawn, tmp_path, lab) as peers:
        first = peers.start(0, "start", "--min-peers", "3", *common)
        address = peers.address(first)
        peers.start(1, "join", address, "--min-peers", "3", *common)
        third = peers.start(2, "join", address, "--min-peers", "3", "--fault-file", str(liar), *common)
        first.wait_event("round", lambda e: e["outer_step"] >= 3 and e["group_size"] == 3, timeout=120)
        late = [peers.start(3, "join", address, *common)]
        for i in range(4, 3 + joiners):
            late[-1].wait_event("state_downloaded", timeout=120)
            late.append(peers.start(i, "join", address, *common))
        peers.wait_all()
    return first, third, late


SYBIL_DONORS = """
import sys, time
import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from swarm.records import RunKeys

address, run_id, count, victims = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
signers = [RSASignatureValidator(RSAPrivateKey()) for _ in range(count)]  # fresh keys: free

class EachKeySignsItsOwn(RecordValidatorBase):
    def validate(self, record):
        return True
    def sign_value(self, record):
        for signer in signers:
            signed = signer.sign_value(record)
            if signed != record.value:
                return signed
        return record.value
    def strip_value(self, record):
        return signers[0].strip_value(record)

# One stock node in client mode: no process, no address behind any of the keys.
dht = hivemind.DHT(initial_peers=[address], client_mode=True, record_validators=[EachKeySignsItsOwn()], start=True)
# Stop 58's attack first: None, for a year, under each honest donor's entry (its [owner:...]
# subkey as read here, and hivemind's bare peer id), to withdraw it for good.
ours = {signer.local_public_key for signer in signers}
wiped = tried = 0
for key in RunKeys(run_id).donors:
    found = dht.get(key, latest=True)
    entries = [k for k in (found.value if found is not None else {}) if k not in ours]
    entries += [PeerID.from_base58(victim).to_bytes() for victim in victims]
    wiped += sum(bool(dht.store(key, None, get_dht_time() + 365 * 86400, subkey=k)) for k in entries)
    tried += len(entries)
print("wiped", wiped, "of", tried, flush=True)
while True:  # valid declarations (signed, small, 50 s), the freshest step there could be
    stored = sum(
        bool(dht.store(key, 1e9, get_dht_time() + 50, subkey=signer.local_public_key))
        for signer in signers
        for key in RunKeys(run_id).donors
    )
    print("stored", stored, flush=True)
    time.sleep(20)
"""


@machines(pytest.mark.faults)  # make test: on 127.0.0.1 only
def test_fresh_keys_declaring_the_freshest_state_leave_a_joiner_its_direct_download(
    spawn, tmp_path, machines
):
    """An outsider's stock hivemind node first tries stop 58's attack: None for a year under
    every honest donor's entry (refused: each is its writer's alone). Then six fresh keys, with
    no process behind them, declare that they serve the state at step 10⁹ (signed, small,
    short-lived: valid declarations). A joiner asked the four it ranked
    first for a direct offer, got none, and fell back to hivemind's stream (ten times slower),
    where it dialed each of them before an honest donor (stop 59). Donors this peer is
    connected to come first now, and a donor that makes no offer gives its place to the next:
    the joiner downloads over the direct transport."""
    common = [*FAST, "--rounds", "1000", "--run-id", "sybil-donors"]
    with contextlib.ExitStack() as stack:
        peers, first, second, address, wrap, _ = _a_pair(stack, spawn, tmp_path, machines, common, size=4)
        honest = [peer.wait_event("started")["peer_id"] for peer in (first, second)]
        attacker = helper(SYBIL_DONORS, address, "sybil-donors", "6", *honest, wrap=wrap)
        stack.callback(kill_group, attacker)
        wiped, _, tried = attacker.stdout.readline().split()[1:]
        assert wiped == "0" and int(tried) >= 6, (wiped, tried)  # 2 owner keys, 2 bare ids x 2 keys
        assert attacker.stdout.readline().split() == ["stored", "12"]  # valid: the run's nodes took them
        joiner = peers.start(3, "join", address, *common)
        joiner.wait_event("round", lambda e: e["group_size"] == 3, timeout=120)
        interrupt_all(peers.started)
    log = joiner.stderr()
    assert "downloaded the state at outer step" in log, log[-3000:]  # the direct transport's line
    assert "downloading the state from" not in log, log[-3000:]  # hivemind's stream's


MATCHMAKING_SQUAT = """
import sys
import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from swarm.records import RunKeys

address, run_id, victims = sys.argv[1], sys.argv[2], sys.argv[3:]
key = RunKeys(run_id).group("diloco") + ".0b"  # hivemind's matchmaking key of the run's group
signer = RSASignatureValidator()  # its own fresh key (a node without one cannot read signed keys)
dht = hivemind.DHT(initial_peers=[address], client_mode=True, record_validators=[signer], start=True)
found = dht.get(key, latest=True)
entries = list(found.value if found is not None else {})  # each peer's [owner:...] subkey, as read
entries += [PeerID.from_base58(victim).to_bytes() for victim in victims]  # hivemind's bare ids
# "Not looking for a group", for a year: the value that expires last is the one nodes keep.
stored = sum(bool(dht.store(key, False, get_dht_time() + 365 * 86400, subkey=k)) for k in entries)
print("stored", stored, "of", len(entries), flush=True)
dht.shutdown()
"""


@machines(pytest.mark.faults)  # make test: on 127.0.0.1 only
def test_an_outsider_cannot_withdraw_the_peers_from_matchmaking(spawn, tmp_path, machines):
    """A review (2026-12-06): a stock hivemind node stored "not looking for a group" for a year
    under each peer's bare id in hivemind's matchmaking key and left; the run's nodes kept it
    over the peers' own declarations (seconds long), and every round after was alone, for good.
    A run's peers declare under their signed [owner:...] keys, and its nodes refuse anything
    else there (swarm.signed_groups): the outsider stores nothing, and the pair keeps averaging.
    In network namespaces the peers run with the README's flags and the outsider on a third
    machine."""
    common = [*FAST, "--rounds", "1000", "--run-id", "squat", *steady(tmp_path)]
    with contextlib.ExitStack() as stack:
        peers, first, second, address, wrap, _ = _a_pair(stack, spawn, tmp_path, machines, common)
        paired = first.events("round")[-1]
        victims = [peer.wait_event("started")["peer_id"] for peer in (first, second)]
        attacker = helper(MATCHMAKING_SQUAT, address, "squat", *victims, wrap=wrap)
        try:
            out, _ = attacker.communicate(timeout=120)
        finally:
            kill_group(attacker)
        stored, of = out.split()[1:4:2]
        assert stored == "0" and int(of) >= 2, out  # the bare ids at least; the owner keys if read
        attacked = max(e["outer_step"] for e in first.events("round"))
        first.wait_event(
            "round", lambda e: e["outer_step"] > attacked + 2 and e["group_size"] == 2, timeout=120
        )
        assert paired["outer_step"] <= attacked
        interrupt_all(peers.started)


STATE_ASKER = """
import sys, time
from hivemind.utils import get_dht_time
from swarm.records import PeerHeartbeat, RunKeys, Stage
from swarm.session import connect
from tests.integration.outsider import asks_for_the_state
from workbench.cli.command import build_config, build_parser

# A node of its own on this machine (its flags: where it listens): an insider, with the run's
# secret, or an outsider who learned only the handlers' names (libp2p lists them to anyone).
address, run_id, secret, who, flags = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
config = build_config(build_parser().parse_args(["join", address, "--run-id", run_id, *flags]))
keys = RunKeys(run_id, secret)
session = connect(config.network, keys if who == "insider" else RunKeys(run_id))
if who == "insider":  # a member: a heartbeat under the run's key (one that leaves: nobody's round mate)
    beat = PeerHeartbeat(peer_id=session.peer_id, name="insider", stage=Stage.LEAVING, outer_step=0,
                         inner_step=0, inner_steps=5, time=get_dht_time())
    deadline = time.monotonic() + 30
    while not session.store.store(keys.peers, beat, ttl=10, wait=True):
        assert time.monotonic() < deadline, "the insider's heartbeat was not stored"
        time.sleep(0.5)
parts, sketched = asks_for_the_state(session, address, keys)
print("parts", parts, "sketched", sketched, flush=True)
session.close()
"""


@pytest.mark.faults
@MACHINES
def test_an_outsider_on_another_machine_reads_nothing_of_a_private_run_s_state(spawn, tmp_path, machines):
    """A private run's peers serve their state stream and θ's sketches only to a peer with a live
    heartbeat under the run's key (``swarm.state_sharing.StateSharing``; the handlers' names are
    listed to anyone who connects). tests/integration/test_swarm_records.py asks from pytest's
    own process on 127.0.0.1; here a node on a third machine asks the pair's first peer (both
    started with the README's flags) at its announced address: nothing without the secret, and
    the state and a sketch with it and a heartbeat."""
    secret, run_id = "three machines", "private-state"
    common = [*FAST, "--rounds", "1000", "--run-id", run_id, "--secret", secret, *steady(tmp_path)]
    asked = {}
    with contextlib.ExitStack() as stack:
        peers, _, _, address, wrap, own = _a_pair(stack, spawn, tmp_path, machines, common)
        for who in ("outsider", "insider"):
            asker = helper(STATE_ASKER, address, run_id, secret, who, *own, wrap=wrap)
            try:
                out, _ = asker.communicate(timeout=180)
            finally:
                kill_group(asker)
            assert asker.returncode == 0 and out.startswith("parts"), (who, out)
            asked[who] = out.split()
        interrupt_all(peers.started)
    assert asked["outsider"] == ["parts", "0", "sketched", "False"], asked
    assert int(asked["insider"][1]) > 0 and asked["insider"][3] == "True", asked


MATCHMAKING_SYBIL = """
import asyncio, sys, threading, time
import torch
from hivemind.averaging.averager import compute_schema_hash
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time
from swarm import gathered
from swarm.group_averager import GroupAverager
from swarm.records import RunKeys
from swarm.session import connect
from swarm.signed_groups import peer_of
from workbench.cli.command import build_config, build_parser
from workbench.run.training import load_data, trained_shapes

# One fresh key: a group leader that declares itself every 0.1 s just ahead of everyone, accepts
# every follower and never begins, and a follower that joins every honest peer's group (a
# well-formed request: the run's schema) and would never come to its ring. "beating": it also
# publishes a heartbeat "waiting" at the swarm's step (a round mate, as far as the barrier knows);
# "joining": that heartbeat, and it only joins the peers' groups; "hivemind": the same, saying
# it takes no direct rings (so its groups average on hivemind's path), where it sends nothing.
address, run_id, mode, flags = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
config = build_config(build_parser().parse_args(["join", address, "--run-id", run_id, *flags]))
shapes = [torch.zeros(t.shape) for t in trained_shapes(config, load_data(config)[1])]
keys = RunKeys(run_id)
session = connect(config.network, keys)  # (its flags: where it listens, in a lab)
prefix, me = keys.group("diloco"), session.dht.peer_id
counts = {"followed": 0, "joined": 0}

async def lead(request, context):
    counts["followed"] += 1
    yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)
    await asyncio.sleep(120)  # never begins, never disbands

async def join(p2p, leader, busy):
    own = gathered.own(mode != "hivemind", 1.0, b"", {"outer_step": 0})  # (this release's)
    request = averaging_pb2.JoinRequest(
        schema_hash=compute_schema_hash(shapes), expiration=get_dht_time() + 100, client_mode=False,
        gather=MSGPackSerializer.dumps([None, 0, MSGPackSerializer.dumps(own)]), group_key=prefix + ".0b")
    try:
        async for message in await GroupAverager.get_stub(p2p, leader, namespace=prefix).rpc_join_group(request):
            if message.code != averaging_pb2.ACCEPTED:
                break
            counts["joined"] += 1
    except Exception:
        pass
    finally:
        busy.discard(leader)

def beat():
    from hivemind.utils import get_dht_time
    from swarm.records import PROTOCOL, PeerHeartbeat, Stage
    while True:
        top = max((p.outer_step for p in session.board.fetch().values() if p.peer_id != session.peer_id), default=0)
        beat = PeerHeartbeat(peer_id=session.peer_id, name="sybil", stage=Stage.WAITING, outer_step=top,
                             inner_step=5, inner_steps=5, time=get_dht_time(), protocol=PROTOCOL)
        session.store.store(keys.peers, beat, ttl=10)
        time.sleep(0.3)

async def main():
    if mode != "silent":
        threading.Thread(target=beat, daemon=True).start()
    p2p = await session.dht.replicate_p2p()
    await p2p.add_protobuf_handler(
        f"{prefix}::GroupAverager.rpc_join_group", lead, averaging_pb2.JoinRequest, stream_output=True)
    print("ready", flush=True)
    busy = set()
    while True:
        if mode == "silent" or mode == "beating":
            session.dht.store(prefix + ".0b", True, get_dht_time() + 0.25, subkey=session.store.subkey, return_future=True)
        found = await asyncio.wrap_future(session.dht.get(prefix + ".0b", latest=True, return_future=True))
        for subkey, entry in (found.value.items() if found is not None and isinstance(found.value, dict) else ()):
            peer = peer_of(subkey)
            if peer is not None and peer != me and entry.value is True and peer not in busy:
                busy.add(peer)
                asyncio.create_task(join(p2p, peer, busy))
        print("followed", counts["followed"], "joined", counts["joined"], flush=True)
        await asyncio.sleep(0.1)

asyncio.run(main())
"""


@machines(pytest.mark.faults)  # make test: on 127.0.0.1 only
def test_a_fresh_key_in_matchmaking_neither_leads_nor_joins_the_peers_groups(spawn, tmp_path, machines):
    """A red-team review (2026-12-06): one fresh key, no heartbeat, declared itself a group leader
    every 0.1 s just ahead of everyone, accepted each follower and never began (a pair's rounds:
    1.0 s, then 19.6 s, every one alone), and joined every honest peer's group, never to come to
    its ring (4 of 5 rounds alone). A run's peers now lead, follow and take in only the peers whose
    heartbeats they read: nobody follows it, nobody lets it in, and the pair averages on. In
    network namespaces the peers run with the README's flags and the key on a third machine."""
    flags = [*FAST, *steady(tmp_path)]
    common = [*flags, "--rounds", "1000", "--run-id", "sybil"]
    with contextlib.ExitStack() as stack:
        peers, first, _, address, wrap, own = _a_pair(stack, spawn, tmp_path, machines, common)
        attacker = helper(MATCHMAKING_SYBIL, address, "sybil", "silent", *flags, *own, wrap=wrap)
        try:
            assert attacker.stdout.readline().strip() == "ready"
            attacked = max(e["outer_step"] for e in first.events("round"))
            first.wait_event("round", lambda e: e["outer_step"] >= attacked + 8, timeout=180)
        finally:
            kill_group(attacker)
        said = attacker.communicate()[0].split("\n")
        last = [line for line in said if line.startswith("followed")][-1]
        assert last == "followed 0 joined 0", last  # nobody followed it, nobody took it in
        sizes = [e["group_size"] for e in first.events("round") if e["outer_step"] > attacked]
        assert sizes.count(2) >= 5, sizes  # (on the old code: every round alone)
        interrupt_all(peers.started)


@machines(pytest.mark.faults)  # make test: on 127.0.0.1 only
def test_a_fresh_key_with_a_heartbeat_that_leads_and_never_begins_is_ignored(spawn, tmp_path, machines):
    """The same key, also publishing a heartbeat "waiting" at the swarm's step: a round mate for
    the barrier, so the peers follow it when it declares itself first. It accepts and never
    begins: each peer that followed it says so, leaves it out of the round's retry, and strikes
    it; three rounds and it is ignored for the run. The pair averages on (in network namespaces:
    the README's flags, the key on a third machine, where the peers dial it)."""
    _ignored_for_the_run(
        spawn, tmp_path, machines, "beating", "sybil accepted this peer into its group and never began it"
    )


@machines(pytest.mark.faults)  # make test: on 127.0.0.1 only
def test_a_fresh_key_with_a_heartbeat_that_joins_and_never_comes_is_ignored(spawn, tmp_path, machines):
    """The key with a heartbeat "waiting" only joins: every group it can, never to come to the
    ring. A round mate as far as the barrier knows, it was let in; the ring failed and it joined
    the retry's group too, until the averaging deadline: every round of the pair alone. The
    group's leader, which holds the ring's board and took the key's join request itself, sees it
    never came: from its second time it is left out of the round's retries and struck; three
    rounds and it is ignored for the run (in network namespaces: the README's flags, the key on
    a third machine)."""
    said = _ignored_for_the_run(
        spawn, tmp_path, machines, "joining", "sybil was in this peer's group and never came to its ring"
    )
    joined = [line for line in said if line.startswith("followed")][-1]
    assert joined != "followed 0 joined 0", joined  # (it was in groups: the attack happened)


@machines(pytest.mark.faults)  # make test: on 127.0.0.1 only
def test_a_fresh_key_that_sends_its_groups_to_hivemind_s_path_and_sends_nothing_is_ignored(
    spawn, tmp_path, machines
):
    """The joining key, saying it takes no direct rings: each group it joined averaged on
    hivemind's path, where it sent nothing and reduced nothing. Every round of the pair ended
    alone, 22-27 s each, the key in every retry (a review, 2026-12-07). A reducer sees for
    itself who sent it nothing within the senders' timeout (hivemind's channel proves each
    stream's sender): the group's leader names such a member, a follower only its leader; from
    the second time running the key is left out of the round's retries and struck, and three
    rounds later ignored for the run (in network namespaces: the README's flags, the key on a
    third machine)."""
    said = _ignored_for_the_run(
        spawn,
        tmp_path,
        machines,
        "hivemind",
        "sybil was in this peer's group and sent it nothing on hivemind's path",
    )
    joined = [line for line in said if line.startswith("followed")][-1]
    assert joined != "followed 0 joined 0", joined  # (it was in groups: the attack happened)


def _ignored_for_the_run(spawn, tmp_path, machines, mode: str, why: str) -> list[str]:
    """A pair, and :data:`MATCHMAKING_SYBIL` in ``mode`` beside it: a peer ignores the key for
    ``why`` (on the old code: never), then the pair averages three rounds. The key's output."""
    flags = [*FAST, *steady(tmp_path)]
    common = [*flags, "--rounds", "1000", "--run-id", "sybil"]
    with contextlib.ExitStack() as stack:
        peers, first, second, address, wrap, own = _a_pair(stack, spawn, tmp_path, machines, common)
        attacker = helper(MATCHMAKING_SYBIL, address, "sybil", mode, *flags, *own, wrap=wrap)
        ignored = f"{why}, 3 rounds running"
        try:
            assert attacker.stdout.readline().strip() == "ready"
            deadline = time.monotonic() + 240
            while ignored not in first.stderr() + second.stderr():
                assert time.monotonic() < deadline, (first.stderr() + second.stderr())[-3000:]
                time.sleep(0.5)
            since = max(e["outer_step"] for e in first.events("round"))
            for _ in range(3):  # ignored: not let in again (each round would wait it out)
                since = first.wait_event(
                    "round",
                    lambda e, after=since: e["outer_step"] > after and e["group_size"] == 2,
                    timeout=120,
                )["outer_step"]
        finally:
            kill_group(attacker)
        said = attacker.communicate()[0].split("\n")
        interrupt_all(peers.started)
    return said


FLOODER = """
import sys
from functools import partial
import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from swarm.records import RunKeys

address, run_id, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
key = RunKeys(run_id).peers

async def store_fat(dht, node, subkey):  # built in the DHT's process: 1 MB does not fit its pipe
    fat = dict(peer_id="x", name="fat", stage="paused", outer_step=0, inner_step=0, inner_steps=5,
               time=get_dht_time(), junk="A" * 1_000_000)
    return await node.store(key, fat, get_dht_time() + 365 * 86400, subkey=subkey)

stored = 0
for i in range(count):  # a fresh key each: one subkey per key; a stock node, no schema or bounds
    signer = RSASignatureValidator()
    dht = hivemind.DHT(initial_peers=[address], client_mode=True, record_validators=[signer], start=True)
    stored += bool(dht.run_coroutine(partial(store_fat, subkey=signer.local_public_key)))
    dht.shutdown()
print("stored", stored, flush=True)
"""


@pytest.mark.faults
def test_a_flood_of_huge_long_lived_records_leaves_the_board_readable():
    """Signed heartbeats of 1 MB each, with a year's expiration, from fresh keys on a stock
    hivemind node: the run's nodes stored all of them, to hold for a year with no process left
    running (12 of them: 12 MB on each node, and ghosts had they been well-formed). The run's
    nodes now refuse such records (swarm.validators.RecordBoundsValidator), and a reader still
    sees the honest peer."""
    from hivemind.utils import get_dht_time

    from swarm.dht import NetworkConfig, visible_addresses
    from swarm.records import PeerHeartbeat, RunKeys, Stage
    from swarm.session import connect

    keys = RunKeys("flood")
    honest = connect(NetworkConfig(), keys)
    reader = None
    try:
        beat = PeerHeartbeat(
            peer_id=honest.peer_id, name="honest", stage=Stage.TRAINING, outer_step=0, inner_step=0,
            inner_steps=5, time=get_dht_time(),
        )  # fmt: skip
        assert honest.store.store(keys.peers, beat, ttl=100, wait=True)
        address = visible_addresses(honest.dht)[0]
        flooder = helper(FLOODER, address, "flood", "5")
        try:
            out, _ = flooder.communicate(timeout=120)
        finally:
            kill_group(flooder)
        assert out.strip() == "stored 0", out  # refused by the run's node
        reader = connect(NetworkConfig(initial_peers=[address], client_mode=True), keys)
        assert [p.name for p in reader.board.fetch().values()] == ["honest"]
    finally:
        for session in (reader, honest):
            if session is not None:
                session.close()


@pytest.mark.faults
@MACHINES
def test_one_fresh_key_waiting_beside_a_lone_peer_costs_it_one_round_then_a_window_a_round(
    spawn, tmp_path, machines
):
    """docs/security.md's Sybil list: one fresh key whose heartbeat says "waiting" at a lone
    peer's step is a round mate for the barrier, and the peer's step waited for it to the
    averaging deadline, every round for good (measured, stop 67: rounds of 0.7 s took 30.7 s
    each; the peer never downloaded). After the key's first no-show the peer gives strangers
    that came to no group the matchmaking window, not the deadline (5.8 s a round here):
    an honest newcomer comes within the window. In network namespaces the peer runs with the
    README's flags and the key on another machine."""
    run_id = f"lies-waiting-{machines}"
    common = [*FAST, "--run-id", run_id, *steady(tmp_path)]
    with contextlib.ExitStack() as stack:
        lab = stack.enter_context(netlab.NetLab(2, rate=None)) if machines == "netns" else None
        peers = stack.enter_context(_Peers(spawn, tmp_path, lab))
        first = peers.start(0, "start", *common, "--min-peers", "1")
        address = peers.address(first)
        first.wait_event("round", lambda e: e["outer_step"] >= 3)
        wrap = list if lab is None else (lambda argv: lab.command(1, argv))
        keys = helper(LIAR, "waiting", address, run_id, "1", wrap=wrap)
        try:
            assert keys.stdout.readline().strip() == "ready"
            start = max(e["outer_step"] for e in first.events("round"))
            first.wait_event("round", lambda e: e["outer_step"] >= start + 8, timeout=300)
        finally:
            kill_group(keys)
        interrupt_all((first,))
    rounds = [r for r in first.events("round") if start < r["outer_step"] <= start + 8]
    summary = [(r["outer_step"], r["alone_reason"], round(r["averaging_seconds"], 1)) for r in rounds]
    held = [r for r in rounds if str(r["alone_reason"]).startswith("averaging failed")]  # to the deadline
    window = [r for r in rounds if "strangers that came to no group before" in str(r["alone_reason"])]
    assert len(held) <= 1 and len(window) >= 6, summary
    assert not first.events("state_downloaded"), summary


@machines(pytest.mark.faults)
def test_fresh_keys_flagging_the_honest_peers_do_not_hide_them(spawn, tmp_path, machines):
    """Three fresh keys, one more than the honest pair, each flagging both honest peers as liars
    and naming them (and each other) as round mates: every live peer's flags counted, and
    `workbench status` showed the keys alone, the pair "ignored for lying". Now only the owner's
    peer and its round mates (both sides saying so) vote. In network namespaces the peers run
    with the README's flags, and the keys and `status` on a third machine."""
    run_id = f"lies-flagging-{machines}"
    common = [*FAST, "--run-id", run_id, *steady(tmp_path)]
    with contextlib.ExitStack() as stack:
        peers, first, second, address, wrap, _ = _a_pair(stack, spawn, tmp_path, machines, common)
        second.wait_event("round", lambda e: e["group_size"] == 2, timeout=120)  # it names a too
        liar = helper(LIAR, "flagging", address, run_id, "3", wrap=wrap)
        try:
            assert liar.stdout.readline().strip() == "ready"
            snapshot, deadline = {}, time.monotonic() + 120
            while time.monotonic() < deadline:  # until the keys' flags are there to be counted
                status = workbench("status", address, "--run-id", run_id, "--json", timeout=60, wrap=wrap)
                if status.returncode == 0:
                    snapshot = json.loads(status.stdout.splitlines()[-1])
                    keys = [p for p in snapshot["peers"] if p["name"] == "liar" and p["ignored"]]
                    if len(keys) == 3 or snapshot["ignored"]:
                        break
            names = {p["peer_id"]: p["name"] for p in snapshot["peers"]}
            assert sorted(names.values()) == ["a", "b", "liar", "liar", "liar"], snapshot
            assert not snapshot["ignored"], snapshot["ignored"]
            assert sorted(names[p] for p in snapshot["flag_voters"]) == ["a", "b"], snapshot["flag_voters"]
            assert snapshot["flags_from"] == "owner"
            # The owner's peer gone, a one-shot `status` knows no owner's peer: every live peer
            # voted, and the keys hid b. Now b, which it joins through, and b's round mates do.
            first.process.send_signal(signal.SIGINT)
            assert first.wait(timeout=60) == 0, first.stderr()[-3000:]
            there, deadline = peers.address(second), time.monotonic() + 120
            while time.monotonic() < deadline:  # until a's heartbeat says it left
                status = workbench("status", there, "--run-id", run_id, "--json", timeout=60, wrap=wrap)
                if status.returncode == 0:
                    snapshot = json.loads(status.stdout.splitlines()[-1])
                    names = {p["peer_id"]: p["name"] for p in snapshot["peers"]}
                    if "a" not in names.values() and len(names) >= 3:
                        break
            assert sorted(names.values()) == ["b", "liar", "liar", "liar"], snapshot
            assert not snapshot["ignored"] and snapshot["flags_from"] == "joined", snapshot
            assert [names[p] for p in snapshot["flag_voters"]] == ["b"], snapshot["flag_voters"]
        finally:
            kill_group(liar)
        interrupt_all(peers.started)


RING_SPOILER = """
import os, sys
import swarm.dataplane as dataplane
import swarm.rendezvous as rendezvous
import swarm.ring_driver as ring_driver
from workbench.cli import main

# A peer like any other, except that the ring address it posts at every board is dead: port 1
# of 0.0.0.0 (the connecting machine), where nothing listens, lower than any member's address:
# gloo has the higher address connect to the lower, so the others must connect to it.
# It never turns its own plane off, and gives up its own side of a ring at once, back in time
# for the round's retry: every new ring with it keeps failing.
posted = rendezvous.RingStore.set

def dead(self, key, value):
    value = bytearray(value)
    assert value[18:20] == bytes([2, 0]), "not the IPv4 address gloo posts in torch 2.13: " + value.hex()
    value[20:26] = (1).to_bytes(2, "big") + bytes(4)  # port 1 of 0.0.0.0 (this machine)
    posted(self, key, bytes(value))

rendezvous.RingStore.set = dead
ring_driver.RingDriver._switch_off = lambda self, error: None
reduce = dataplane.DirectPlane.all_reduce

def quick(self, tensors, **options):  # its own side of a ring gives up at once
    reduce(self, tensors, **{**options, "timeout": 0.4, "arrival": 0.4})

dataplane.DirectPlane.all_reduce = quick
print("ready", flush=True)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # (nobody reads its stdout)
sys.exit(main(sys.argv[1:]))
"""


@machines(pytest.mark.faults)  # make test: on 127.0.0.1 only
def test_a_peer_posting_a_dead_ring_address_is_left_out_of_the_rounds_retries(spawn, tmp_path, machines):
    """docs/security.md (stop 58's red-team review, left open until stop 70): a peer with a
    heartbeat that comes to each ring's board and posts a dead address there. gloo's connection
    failed as a whole and named nobody, so the peer was in every retry of the round: each failed,
    and three in a row switched each honest peer's direct plane off (hivemind's path, about 10x
    slower) for 5 minutes, then again (measured on the old code: rounds of 29.8, 30.7 and 11.7 s,
    then every round on hivemind's path; here 2.0-2.8 s, every one direct). Each pair of a new
    ring now connects on its own: the group's leader (or a follower, of its leader) names the
    member it could not connect to and leaves it out of the round's retries; the pair averages
    on over the direct plane (in network namespaces: the README's flags, the spoiler on a third
    machine)."""
    flags = [*FAST, *steady(tmp_path)]
    common = [*flags, "--rounds", "1000", "--run-id", "spoiler"]
    with contextlib.ExitStack() as stack:
        peers, first, second, address, wrap, own = _a_pair(stack, spawn, tmp_path, machines, common)
        named = "could not be reached on this peer's ring"
        attacker = helper(
            RING_SPOILER, "join", address, *common, "--name", "spoiler", "--run-dir", str(tmp_path / "spoiler"),
            *own, wrap=wrap,
        )  # fmt: skip
        try:
            assert attacker.stdout.readline().strip() == "ready"
            deadline = time.monotonic() + 240
            while named not in first.stderr() + second.stderr():  # (the attack happened)
                assert time.monotonic() < deadline, (first.stderr() + second.stderr())[-3000:]
                time.sleep(0.5)
            since = max(e["outer_step"] for e in first.events("round"))
            first.wait_event("round", lambda e: e["outer_step"] >= since + 8, timeout=240)
        finally:
            kill_group(attacker)
        rounds = [(e["group_size"], e["plane"]) for e in first.events("round") if e["outer_step"] > since]
        assert rounds.count((2, "direct")) >= 5, rounds  # the pair, on the direct plane
        for peer in (first, second):
            assert "hivemind's all-reduce for the next" not in peer.stderr(), peer.stderr()[-3000:]
        interrupt_all(peers.started)
