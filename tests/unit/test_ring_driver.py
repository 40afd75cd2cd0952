"""The direct plane's ring in the peer's process (swarm.ring_driver): the step the caller
holds, the board requests forwarded to the averager process, and the driver's bookkeeping;
hivemind's side is a stand-in here (the real one: tests/integration)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager

import pytest
import torch

from swarm import gathered, ring_driver
from swarm.dataplane import PROTOCOL, RingUnreachable
from swarm.rendezvous import DECLINED, RendezvousError
from swarm.ring_driver import (
    AllreduceFailed,
    DirectStep,
    ForwardedBoard,
    Outcome,
    RingDriver,
    Ticket,
    serve_board,
)


class Control(Future):
    """hivemind's StepControl as far as DirectStep uses it."""

    def __init__(self) -> None:
        super().__init__()
        self.triggers = 0
        self.weight = 2.0
        self.began_allreduce = False

    @property
    def triggered(self) -> bool:
        return self.triggers > 0

    def allow_allreduce(self) -> None:
        self.triggers += 1


def _ticket(nonce: bytes = b"n", **fields) -> Ticket:
    defaults = dict(
        nonce=nonce,
        group_id=b"group",
        members=("a", "b"),
        rank=0,
        seed=b"seed",
        weight=1.0,
        total=4.0,
        reusable=frozenset(),
        codec="none",
        timeout=5.0,
        arrival=1.0,
        mask_scale=1.0,
        gathered={"a": {"x": 1}, "b": {"x": 2}},
    )
    return Ticket(**{**defaults, **fields})


def test_a_claimed_step_returns_the_rings_result_and_triggers_hivemind_after_the_ring():
    step, control = DirectStep(), Control()
    step.attach(control)
    claimed = []
    claimer = threading.Thread(target=lambda: claimed.append(step.claim(_ticket(), wait=5)))
    claimer.start()
    deadline = time.monotonic() + 10
    while step._ticket is None and time.monotonic() < deadline:  # the ring has claimed the step
        time.sleep(0.001)
    step.allow_allreduce()
    claimer.join(timeout=5)
    assert claimed == [True] and step.began_allreduce and not step.done()
    # The averager process hears of the trigger only once the ring is done: told at once, it
    # (and its p2p daemon) would wake beside the ring on the same cores.
    assert control.triggers == 0
    step.settle({"a": 1}, None)
    assert step.done() and step.result(timeout=1) == {"a": 1} and control.triggers == 1
    assert step.wait(0.0)
    assert not control.done()  # hivemind's own result is not waited for


def test_a_failed_ring_raises_from_result_and_hivemind_still_hears_the_trigger():
    step, control = DirectStep(), Control()
    step.attach(control)
    step.allow_allreduce()  # before any ticket: hivemind's path may take the round, told at once
    assert control.triggers == 1
    assert step.claim(_ticket(), wait=1)
    step.settle(None, AllreduceFailed("direct data plane: RingTampered: the sum is off"))
    with pytest.raises(AllreduceFailed, match="off"):
        step.result(timeout=1)
    assert control.triggers == 1  # not twice


def test_a_failed_ring_ends_a_step_that_allows_retries_on_hivemind_s_side_too():
    """A retry would average the buffers the failed ring left garbage, under a ticket for a step
    this process no longer waits for (seen: "no step of this peer's is waiting for this group",
    and the other member waiting out the arrival timeout)."""
    driver, tickets_out, outcomes_in, _, _, _ = _driver(Plane(RuntimeError("MemberMissing: b did not come")))
    step, control = driver.expect(b"n"), Control()
    control.allow_retries = True
    step.attach(control)
    step.allow_allreduce()
    tickets_out.send(_ticket(b"n"))
    assert outcomes_in.poll(10) and not outcomes_in.recv().ok
    assert control.cancelled() and control.triggers == 1  # triggered after the ring, then ended
    with pytest.raises(AllreduceFailed, match="MemberMissing"):
        step.result(timeout=1)  # the ring's error, not hivemind's cancellation
    plain = Control()  # without retries hivemind ends the step itself: left alone
    once = DirectStep()
    once.attach(plain)
    once.end_retries()
    assert not plain.cancelled()


def test_a_step_without_a_ticket_is_hivemind_s():
    step, control = DirectStep(), Control()
    step.attach(control)
    step.allow_allreduce()
    assert not step.done() and not step.wait(0.01)
    threading.Timer(0.05, lambda: control.set_result({"hivemind": True})).start()
    started = time.monotonic()
    assert step.wait(5.0) and time.monotonic() - started < 2  # woken by hivemind's result
    assert step.result(timeout=5) == {"hivemind": True}
    with pytest.raises(TimeoutError):
        other = DirectStep()
        other.attach(Control())
        other.result(timeout=0.05)


def test_a_cancelled_or_untriggered_step_runs_no_ring():
    cancelled, control = DirectStep(), Control()
    cancelled.attach(control)
    threading.Timer(0.05, cancelled.cancel).start()
    assert not cancelled.claim(_ticket(), wait=5)
    assert cancelled.done()
    with pytest.raises(AllreduceFailed):
        cancelled.result(timeout=1)
    idle = DirectStep()
    idle.attach(Control())
    started = time.monotonic()
    assert not idle.claim(_ticket(), wait=0.2)  # never triggered: given up after ``wait``
    assert time.monotonic() - started < 2


class Board:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key, value):
        self.values[key] = value

    def get(self, key, timeout):
        if key not in self.values:
            raise RendezvousError(f"no member posted {key!r} within {timeout:.0f} s")
        return self.values[key]

    def exchange(self, key, value, want, timeout, abort=None):
        self.set(key, value)
        return [self.get(k, timeout) for k in want]


def test_board_requests_cross_to_the_averager_process_and_errors_come_back_as_one_line():
    here, there = mp.Pipe()
    boards, failed = {b"g": Board()}, []
    server = threading.Thread(
        target=serve_board, args=(there, boards.get, lambda *told: failed.append(told)), daemon=True
    )
    server.start()
    lock = threading.Lock()
    board = ForwardedBoard(here, lock, b"g")
    board.set("ring/0", b"address")
    assert board.get("ring/0", 1.0) == b"address"
    assert board.exchange("here/1", b"", ["ring/0"], 1.0) == [b"address"]
    with pytest.raises(RendezvousError, match="no member posted 'ring/9'"):
        board.get("ring/9", 1.0)
    with pytest.raises(RendezvousError, match="no such group"):
        ForwardedBoard(here, lock, b"gone").get("ring/0", 1.0)
    assert failed == []  # (gloo's waits: not the members' meeting)
    with pytest.raises(RendezvousError):  # a meeting that failed: told first (who missed it)
        board.exchange("here/1", b"", ["here/5"], 0.05)
    assert failed == [(b"g", "exchange", "here/1")]
    board.set("here/2", DECLINED)
    assert board.exchange("here/0", b"k", ["here/2"], 1.0) == [DECLINED]  # and one declined there
    assert failed[1:] == [(b"g", "declined", "here/0")]
    here.close()  # the peer's side goes: the server ends
    server.join(timeout=5)
    assert not server.is_alive()


class SlowBoard(Board):
    """A board whose holder answers a set only after ``delay`` s (a leader that has not opened
    the board yet: its member retries for 10 s, then is refused)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def set(self, key, value):
        time.sleep(self.delay)
        raise RendezvousError("the group's board refused 'here/1': unknown group")


def test_a_board_request_given_up_on_does_not_answer_the_next_one(monkeypatch):
    """Stop 57, a review: a request that took longer than its wait was answered later, and that
    answer was read as the next request's, and so on for good: every later ring got the keys
    of the round before and failed, until the plane turned itself off."""
    monkeypatch.setattr(ring_driver, "BOARD_SLACK", 0.3)
    here, there = mp.Pipe()
    boards = {b"slow": SlowBoard(1.0), b"g": Board()}
    threading.Thread(target=serve_board, args=(there, boards.get), daemon=True).start()
    lock = threading.Lock()
    with pytest.raises(RendezvousError, match="did not answer a board set"):
        ForwardedBoard(here, lock, b"slow").set("here/1", b"declined")  # given up on after 0.3 s
    board = ForwardedBoard(here, lock, b"g")
    board.set("ring/0", b"address")  # answered while the slow one still runs: not held up by it
    time.sleep(1.0)  # the slow request's answer arrives now, unread
    assert board.get("ring/0", 1.0) == b"address"
    assert board.exchange("here/1", b"", ["ring/0"], 1.0) == [b"address"]
    here.close()


def test_only_members_that_speak_this_planes_version_take_direct_rings():
    ours = gathered.own(True, 1.0, b"", {"x": 1})
    assert ours[gathered.PLANE] == PROTOCOL and gathered.takes_direct_rings(ours)
    older = dict(ours, **{gathered.PLANE: True})  # a peer from before the version was sent
    assert not gathered.takes_direct_rings(older)
    assert not gathered.takes_direct_rings(dict(ours, **{gathered.PLANE: PROTOCOL + 1}))
    assert not gathered.takes_direct_rings(gathered.own(False, 1.0, b"", None))


def test_a_group_takes_the_mean_on_hiveminds_path_only_if_every_member_says_so():
    """swarm.butterfly: replies with the mean where every member copies them; a group with a
    member that adds hivemind's differences (an older peer, or a malformed claim) runs hivemind's."""
    ours = [gathered.own(plane, 1.0, b"", None) for plane in (True, False)]  # on either plane
    assert gathered.all_take_the_mean(ours)
    older = {k: v for k, v in ours[0].items() if k != gathered.BUTTERFLY}
    for odd in (
        older,
        dict(ours[0], butterfly=True),
        dict(ours[0], butterfly=2),
        dict(ours[0], butterfly="1"),
        1,
    ):
        assert not gathered.all_take_the_mean([ours[0], odd]), odd


class Plane:
    """DirectPlane's stand-in: fails with ``error`` or scales every tensor by 0.5."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.calls, self.declined = error, [], []

    def mark(self, phase: str) -> None:  # the phases benchmarks.allreduce --phases times
        pass

    def draw(self, seed: bytes, count: int) -> None:  # the round's R, drawn ahead
        self.drawn = (seed, count)

    def all_reduce(self, tensors, **options):
        self.calls.append(options)
        if self.error is not None:
            raise self.error
        for tensor in tensors:
            tensor.mul_(0.5)

    def ring_ids(self):
        return []

    def decline(self, **options):
        self.declined.append(options)


def _driver(plane, masks: int = 0):
    tickets_in, tickets_out = mp.Pipe(duplex=False)
    outcomes_in, outcomes_out = mp.Pipe(duplex=False)
    board_here, _ = mp.Pipe()
    buffers = [torch.ones(4), torch.ones(2)]
    lock = threading.Lock()

    @contextmanager
    def tensors():
        with lock:
            yield buffers

    enabled, rounds = mp.Value("b", 1), mp.Value("q", 0)
    driver = RingDriver(
        plane,
        tickets=tickets_in,
        outcomes=outcomes_out,
        board=board_here,
        tensors=tensors,
        count=sum(t.numel() for t in buffers),
        masks=masks,
        enabled=enabled,
        rounds=rounds,
    )
    return driver, tickets_out, outcomes_in, buffers, enabled, rounds


def _round(driver, tickets_out, outcomes_in, nonce: bytes, **fields):
    step, control = driver.expect(nonce), Control()
    step.attach(control)
    tickets_out.send(_ticket(nonce, **fields))
    step.allow_allreduce()
    assert outcomes_in.poll(10)
    return step, outcomes_in.recv()


def test_the_driver_runs_each_ticket_on_the_shared_buffers_with_the_weight_the_group_counts():
    plane = Plane()
    driver, tickets_out, outcomes_in, buffers, _, rounds = _driver(plane, masks=1)
    # The step claimed 2.0 (Control); the group counts 1.5 (optim.robust.counted_weights).
    step, outcome = _round(driver, tickets_out, outcomes_in, b"one", mask_scale=4.0, weight=1.5)
    assert outcome == Outcome(b"group", True) and rounds.value == 1
    assert step.result(timeout=1) == {"a": {"x": 1}, "b": {"x": 2}}
    assert plane.calls[0]["weight"] == 1.5 and plane.calls[0]["total"] == 4.0
    # The mask went round scaled by 4 (the stand-in halves it) and came back unscaled.
    assert buffers[0].tolist() == [0.5] * 4 and buffers[1].tolist() == [0.5, 0.5]
    tickets_out.send(_ticket(b"nobody's"))  # no step of this peer's: told, nothing runs
    assert outcomes_in.poll(10) and not outcomes_in.recv().ok and len(plane.calls) == 1
    assert [d["seed"] for d in plane.declined] == [b"seed"]  # and the others need not wait for it


def test_a_ticket_for_a_step_given_up_on_is_declined_at_once():
    """hivemind formed the group before the averager process heard the step was cancelled."""
    plane = Plane()
    driver, tickets_out, outcomes_in, _, _, _ = _driver(plane)
    step, control = driver.expect(b"late"), Control()
    step.attach(control)
    step.cancel()
    tickets_out.send(_ticket(b"late", arrival=6.0, reusable=frozenset({b"ring"})))
    assert outcomes_in.poll(10) and not outcomes_in.recv().ok and plane.calls == []
    assert plane.declined == [
        dict(board=plane.declined[0]["board"], seed=b"seed", members=("a", "b"), rank=0,
             reusable=frozenset({b"ring"}), arrival=6.0)
    ]  # fmt: skip
    idle = driver.expect(b"idle")  # never triggered: by then the others gave up on it anyway
    idle.attach(Control())
    tickets_out.send(_ticket(b"idle", timeout=0.2))
    assert outcomes_in.poll(10) and not outcomes_in.recv().ok and len(plane.declined) == 1


def test_three_unreachable_rings_in_a_row_turn_the_plane_off():
    driver, tickets_out, outcomes_in, _, enabled, rounds = _driver(
        Plane(RingUnreachable("connect timed out"))
    )
    now = [1000.0]
    driver.clock = lambda: now[0]
    for attempt in range(3):
        step, outcome = _round(driver, tickets_out, outcomes_in, bytes([attempt]))
        assert not outcome.ok and "could not set up the ring" in outcome.why
        with pytest.raises(AllreduceFailed, match="direct data plane: could not set up the ring"):
            step.result(timeout=1)
        assert enabled.value == (1 if attempt < 2 else 0)
    assert rounds.value == 0
    # Not for good: one ring mate that posts no address three times running (its own to post)
    # sent this peer to hivemind's path for the rest of its run. Tried again after a while,
    # twice as long each time.
    driver.retry()
    assert enabled.value == 0
    now[0] += 299
    driver.retry()
    assert enabled.value == 0
    now[0] += 1
    driver.retry()
    assert enabled.value == 1
    for attempt in range(3):
        _round(driver, tickets_out, outcomes_in, bytes([10 + attempt]))
    assert enabled.value == 0 and driver._retry_at == now[0] + 600


def test_the_leader_names_the_members_a_new_ring_could_not_reach_before_the_step_fails():
    """The members a new ring named (never posted an address; could not be connected to or
    never answered: swarm.dataplane.DirectPlane._connect) are told by the group's leader, each
    once, before its step fails (the retry leaves them out); a follower tells only its leader:
    the others' addresses it read are on the leader's board. A ring made unreachable by a member does not
    switch the plane off when the retry without it sets one up."""
    error = RingUnreachable("member 2 could not be connected to", unreachable=(2,), absent=(0, 9))
    driver, tickets_out, outcomes_in, _, enabled, _ = _driver(Plane(error))
    members = ("a", "b", "c")
    step, control = driver.expect(b"led"), Control()
    step.attach(control)
    settle, named = step.settle, []

    def settled(value, error) -> None:  # what the step's caller may read the moment it fails
        named.append({kind: set(ids) for kind, ids in driver._spoilers.items()})
        settle(value, error)

    step.settle = settled
    tickets_out.send(_ticket(b"led", members=members, rank=1, holder="b"))
    step.allow_allreduce()
    assert outcomes_in.poll(10) and not outcomes_in.recv().ok
    with pytest.raises(AllreduceFailed):
        step.result(timeout=1)
    assert named == [{"absent": {"a"}, "unreachable": {"c"}}]
    assert driver.spoilers("absent") == ["a"] and driver.spoilers("unreachable") == ["c"]  # (rank 9: none)
    assert driver.spoilers("absent") == driver.spoilers("unreachable") == []  # told once
    for holder in ("d", ""):  # a follower of a leader not named; one that does not know its leader
        _round(
            driver,
            tickets_out,
            outcomes_in,
            b"followed" + holder.encode(),
            members=(*members, "d"),
            rank=1,
            holder=holder,
        )
        assert driver.spoilers("absent") == driver.spoilers("unreachable") == []
        driver.plane.error = None  # the retry, without them, sets up its ring
        _round(
            driver,
            tickets_out,
            outcomes_in,
            b"retry" + holder.encode(),
            members=("a", "b"),
            rank=1,
            holder="b",
        )
        driver.plane.error = error
    _round(driver, tickets_out, outcomes_in, b"followed c", members=members, rank=1, holder="c")
    assert driver.spoilers("absent") == [] and driver.spoilers("unreachable") == ["c"]  # its leader
    _round(driver, tickets_out, outcomes_in, b"again", members=members, rank=1, holder="b")
    assert enabled.value == 1  # two in a row since the last ring set up


def test_the_drivers_thread_ends_with_the_averager_process():
    # The averager process holds the only writing end of the tickets' pipe (GroupAverager.start
    # closes the peer's copy): once it exits, the ring's thread reads the end and stops, rather
    # than one thread per averager lingering in a notebook that makes many.
    driver, tickets_out, _, _, _, _ = _driver(Plane())
    driver.expect(b"n")
    assert driver._thread.is_alive()
    tickets_out.close()
    driver._thread.join(timeout=5)
    assert not driver._thread.is_alive()


def test_a_members_malformed_gathered_bytes_leave_the_group_to_hivemind_not_an_error():
    """Stop 57, a review: hivemind passes each member's gathered bytes through unchecked, and
    parsing them for the direct ring raised (b"\\xc1": a FormatError; dumps(5): TypeError;
    dumps([1.0, 0]): IndexError) past every handler: every member's step failed, unretried."""
    from types import SimpleNamespace

    from hivemind.utils import MSGPackSerializer

    from swarm.group_averager import GroupAverager

    averager = SimpleNamespace(serializer=MSGPackSerializer)
    good = MSGPackSerializer.dumps([1.0, 0, MSGPackSerializer.dumps(gathered.own(True, 1.0, b"", {"x": 1}))])
    assert GroupAverager._gathered(averager, SimpleNamespace(gathered=[good, good]))
    for bad in (
        b"\xc1",
        MSGPackSerializer.dumps(5),
        MSGPackSerializer.dumps([1.0, 0]),
        MSGPackSerializer.dumps([1, 2, 3]),
    ):
        assert GroupAverager._gathered(averager, SimpleNamespace(gathered=[good, bad])) is None


def test_every_averaging_step_first_asks_the_driver_to_try_rings_again():
    """The test above drives ``retry`` itself; this one checks the averager calls it before each
    step: without that call (one line) the plane stayed off for the rest of the run after three
    unreachable rings, and no test failed (a review, 2026-12-06)."""
    from types import SimpleNamespace

    from swarm.group_averager import GroupAverager

    class Asked(Exception):
        pass

    def retry() -> None:
        raise Asked

    class Probe(GroupAverager):  # the step's first lines, without the averager's processes
        _driver = SimpleNamespace(retry=retry)
        _expected = mp.Array("c", 64)
        _allowed = mp.Array("c", 64)

        def __del__(self) -> None:
            pass

    with pytest.raises(Asked):
        object.__new__(Probe).step(gather=None, weight=1.0)


async def test_the_groups_leader_holds_its_board_and_blames_only_what_it_saw_itself():
    """A fresh key with a heartbeat joined each group and never came to its ring: every attempt
    of a round failed (a red-team review, 2026-12-06). The board is now its group's matchmaking
    leader's, as each member knows for itself; when the members' meeting fails, the leader tells
    who never came or declined, a follower tells a leader that answered it never opened its
    board, and nobody repeats what another's board says (a leader can name a peer that never
    joined its group), whatever a member says of itself (one that said it was of an earlier
    release made the group meet at the first member's board, and was never blamed: a review)."""
    import multiprocessing as mp
    from collections import OrderedDict
    from types import SimpleNamespace

    from hivemind.averaging.averager import AveragingMode
    from hivemind.p2p import PeerID
    from hivemind.utils import MSGPackSerializer

    from swarm.group_averager import EXPECTED_BYTES, GroupAverager
    from swarm.rendezvous import BoardClient, RendezvousBoards

    ids = [
        PeerID.from_base58(text)
        for text in (
            "QmWv9Ww7znzgLFyCzf21SR6tUKXrmHCZH9KhebeH4gyE9f",
            "QmRGYVtBtZW8BhNqAKDF9WZDgQPqsy7WwTfVfop3SXyTiC",
            "QmRF4GWpGqB8Z1PXpBRsnPynE7AyzRuhWsPBhy1CdcDmT3",
        )
    ]
    leader, follower, sybil = ids
    modes = [MSGPackSerializer.dumps([1.0, AveragingMode.NODE.value, b""])] * 3
    group = SimpleNamespace(group_id=b"group", peer_ids=(sybil, follower, leader), gathered=modes)
    members = [gathered.own(True, 1.0, b"", {}) for _ in ids]
    ranks = sorted(group.peer_ids, key=lambda p: p.to_bytes())

    class Member(GroupAverager):  # no process, no DHT: the board's parts only
        peer_id = None

        def __del__(self) -> None:
            pass

    def member(peer: PeerID, led_by: PeerID | None, holder_answers=None) -> GroupAverager:
        averager = Member.__new__(Member)
        averager.peer_id, averager.serializer, averager._driver = peer, MSGPackSerializer, None
        averager._leaders, averager._posted, averager._boards = (
            OrderedDict(),
            OrderedDict(),
            RendezvousBoards(),
        )
        averager._no_shows, averager._decliners = mp.Array("c", EXPECTED_BYTES), mp.Array("c", EXPECTED_BYTES)
        averager._board_caller = lambda holder, loop: holder_answers
        if led_by is not None:
            averager._note_leader(group, led_by)
        return averager

    def meet(averager: GroupAverager, members: list = members) -> BoardClient:
        board, _, _ = averager._group_board(group, members)
        averager._posted[group.group_id] = (None, board, {})
        return board

    def post(averager: GroupAverager, peer: PeerID, value: bytes = b"key") -> None:
        request = {"g": b"group", "op": "set", "k": f"here/{ranks.index(peer)}", "v": value}
        assert averager._boards.handle(peer.to_bytes(), request)["ok"]

    # The leader (last in hivemind's order) holds the board; the sybil never posts there.
    led = member(leader, leader)
    board = meet(led)
    assert board.held_here and board.holder == leader
    post(led, follower)
    led._meeting_failed(b"group", "exchange", f"here/{ranks.index(leader)}")
    assert led.no_shows() == [sybil.to_base58()] and led.no_shows() == []  # told once
    # A sybil that declines, every time, instead: told as well (never the leader itself).
    led._boards = RendezvousBoards()
    meet(led)
    post(led, sybil, DECLINED)
    post(led, leader, DECLINED)
    led._meeting_failed(b"group", "declined", f"here/{ranks.index(follower)}")
    assert led.decliners() == [sybil.to_base58()] and led.no_shows() == []
    # A follower: its leader holds the board; it blames that leader only if it answered that it
    # never opened it, not for a p2p error, nor for what an open board says.
    for answers, blamed in (
        (lambda request: {"ok": False, "why": "unknown group"}, [leader.to_base58()]),
        (lambda request: {"ok": False, "why": "not yet"}, []),
    ):
        following = member(follower, leader, answers)
        board = meet(following)
        assert not board.held_here and board.holder == leader
        board._call({"g": b"group", "op": "get", "k": "", "want": ["here/0"]})
        following._meeting_failed(b"group", "exchange", f"here/{ranks.index(follower)}")
        assert following.no_shows() == blamed
    following = member(follower, leader)
    meet(following)  # (it never got an answer)
    following._meeting_failed(b"group", "exchange", f"here/{ranks.index(follower)}")
    assert following.no_shows() == []
    # Whatever a member gathered (an earlier release's version), the leader holds the board.
    older = dict(members[0], **{gathered.PLANE: True})
    assert meet(member(follower, leader), [older, *members[1:]]).holder == leader
    # A leader not seen form the group (never, in this release): the first member's in
    # hivemind's order that accepts connections (the sybil's, here), nobody blamed.
    averager = member(follower, None)
    board = meet(averager)
    assert board.holder is None and not board.held_here
    averager._meeting_failed(b"group", "exchange", f"here/{ranks.index(follower)}")
    assert averager.no_shows() == []
    assert meet(member(sybil, None)).held_here
