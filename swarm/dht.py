"""Starting a hivemind DHT node with errors a user can act on.

hivemind listens on 127.0.0.1 only unless told otherwise (``--host 0.0.0.0`` and
``--announce`` for real networks), and reports an unreachable bootstrap peer as a daemon
traceback; :func:`start_dht` turns both into :class:`~swarm.errors.SwarmError`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

from swarm.addresses import listen_address, parse_announce_addresses, parse_peer_addresses
from swarm.errors import SwarmError

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class NetworkConfig:
    """How this peer reaches the swarm and is reached by it."""

    initial_peers: list[str] = field(default_factory=list)
    """Multiaddrs of running peers (empty: start a new swarm)."""
    host: str = "127.0.0.1"
    """IP to listen on; 0.0.0.0 for every interface (needed beyond this machine)."""
    port: int = 0
    """TCP port to listen on; 0 picks a free one."""
    announce: list[str] = field(default_factory=list)
    """Public multiaddrs others should dial (e.g. behind NAT with a forwarded port)."""
    client_mode: bool = False
    """A DHT client (for peers behind NAT): it stores no records for others and holds no
    averaging group, and cannot serve state. Its p2p daemon still listens on --host:--port
    (hivemind's client mode is the DHT's and the averager's, not the daemon's)."""
    identity_path: str | None = None
    """File holding this peer's private key, so its peer id survives restarts."""
    connect_timeout: float = 20.0
    """Seconds to wait for the bootstrap peers before giving up."""

    def __post_init__(self) -> None:
        parse_peer_addresses(self.initial_peers) if self.initial_peers else None
        listen_address(self.host, self.port)
        parse_announce_addresses(self.announce)
        if self.client_mode and self.announce:
            raise SwarmError(
                "--announce has no use with --client-mode: a client-mode peer serves nobody (no DHT "
                "requests, averaging or state), so no one would dial that address; drop --client-mode "
                "if the port is forwarded, else drop --announce"
            )
        if self.announce and self.port == 0:
            # The port is picked at start: no announced one can lead to it (taken without a
            # word, the peer was undialable at the address it printed; a review, stop 72).
            raise SwarmError(
                f"--announce {self.announce[0]} needs a fixed --port: with --port 0 this peer listens on "
                "a port picked at start, which the announced address cannot lead to; give --port P (the "
                "port your router forwards to this machine, usually the one you announce)"
            )
        if not 1 <= self.connect_timeout <= 600:
            raise SwarmError(f"connect timeout must be within 1..600 s (got {self.connect_timeout})")


def _in_resource_sharer(trace) -> bool:
    while trace is not None:
        if trace.tb_frame.f_code.co_filename.endswith(os.path.join("multiprocessing", "resource_sharer.py")):
            return True
        trace = trace.tb_next
    return False


def quiet_handle_sharing() -> None:
    """Keep a receiver's death out of the sender's stderr when a tensor crosses processes.

    hivemind passes shared-memory tensors between a peer and its DHT and averager processes
    (every ``MPFuture`` and ``StepControl`` carries one, so every round does); torch sends their
    file descriptors through multiprocessing's resource sharer, a thread in the sending process
    that the receiver connects to. When a whole process group is terminated, a child that was
    connecting dies mid-handshake and that thread hands the ``ConnectionResetError`` to
    ``sys.excepthook``: a traceback in the log of a peer that is stopping cleanly. Such an error
    only says the receiver is gone, so it is logged at debug level; every other exception
    reaches the previous hook unchanged. Idempotent."""
    previous = sys.excepthook
    if getattr(previous, "quiets_handle_sharing", False):
        return

    def hook(kind, error, trace) -> None:
        if issubclass(kind, (ConnectionError, EOFError)) and _in_resource_sharer(trace):
            logger.debug("a process ended before it took a shared tensor: %s", error)
            return
        previous(kind, error, trace)

    hook.quiets_handle_sharing = True
    sys.excepthook = hook


class _CancelledStepNoise(logging.Filter):
    """asyncio's reports of hivemind's own clean-up when a step is cancelled: mid-matchmaking
    (this peer gave up on a round, or was suspended past it), an async generator closed twice
    raises in a task nobody awaits; mid-all-reduce (hivemind's path), the all-reduce's future is
    given the cancellation as its exception (``AllReduceRunner.finalize``) and nobody reads it
    ("Future exception was never retrieved ... CancelledError" with a traceback, in a peer's log
    in ``make faults``). Nothing is lost (the round already fell back); they go to the debug
    log, not the user's.

    "Task was destroyed but it is pending!" from hivemind's averaging was filtered here too,
    as noise. It was not: the destroyed clean-up left matchmaking's locks held and the peer out
    of every later group. The averager process's loop now keeps its tasks
    (:func:`swarm.hivemind_fixes.keep_tasks_alive`), and the message, should it come back,
    reaches the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        noise = (
            text.startswith("Task exception was never retrieved")
            and "asynchronous generator is already running" in text
        ) or (
            text.startswith("Future exception was never retrieved") and "exception=CancelledError()" in text
        )
        if noise:
            logger.debug("hivemind, after a cancelled step: %s", text.splitlines()[0])
        return not noise


_CANCELLED_STEP_NOISE = _CancelledStepNoise()
_STOP_SIGNALS = tuple(s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


_SHM_MANAGER_STARTED = False

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_ORPHAN_WATCH_PARENT: tuple[int, int] = (0, 0)
"""While :func:`quiet_children` forks: the pid of the forking process and the id of its thread
that forks ((0, 0): not armed). Read by :func:`_end_with_parent` in the child, right after the
fork: only a child of that thread is armed (another thread's fork meanwhile is not ours)."""
_PRCTL = None
"""libc's ``prctl``, looked up in the parent (a child of a threaded process should not load
libraries: another thread may have held the loader's lock at the fork)."""


def _prctl():
    global _PRCTL
    if _PRCTL is None and sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
    return _PRCTL


def _end_with_parent() -> None:
    """In a child forked inside :func:`quiet_children`: ask Linux to send it SIGTERM (whose
    default action it has) when the thread that forked it ends, i.e. when the peer does, however
    it ends. A peer killed with SIGKILL (or by the kernel's OOM killer) left its DHT process
    with its p2p daemon, and its averager process, running for good: orphans that used CPU,
    held the peer's port and could still declare the peer's old state to joiners. The p2p
    daemon ends with the process that started it. If the parent is already gone, end now."""
    global _ORPHAN_WATCH_PARENT
    (parent, thread), _ORPHAN_WATCH_PARENT = _ORPHAN_WATCH_PARENT, (0, 0)
    # The child's one thread is the one that forked (pthread_self is kept across fork).
    if not parent or _PRCTL is None or thread != threading.get_ident():
        return
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # it died between the fork and the line above
        os._exit(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_end_with_parent)


SHM_MANAGER_DEADLINE = 60.0
"""Seconds torch's shared-memory manager may take to answer its first call
(:func:`start_shm_manager`) before the process ends, saying where it waited."""


def start_shm_manager() -> None:
    """Start torch's shared-memory manager now, with Ctrl+C, SIGTERM and SIGHUP held back in
    this thread (delivered right after). hivemind shares tensors by file name, and torch starts
    its manager (``torch_shm_manager``) at the first such tensor, then waits for its handle in a
    ``read()`` that a signal handled by Python interrupts: libshm's check then re-tests the failed
    result for ever, at 100% CPU (a Ctrl+C about 2 s into a peer's start hung it in 2 of 7 tries).
    A blocked signal interrupts nothing. Idempotent; a no-op unless tensors are shared by file name.

    The wait is bounded: the manager answers in 0.15 s here (0.8 s beside eight busy loops on two
    cores), but once (a ``workbench status`` beside a busy test suite, 2026-12-07) it had not
    answered 60 s later, and with these signals held nothing could end that process short of
    SIGKILL. Past :data:`SHM_MANAGER_DEADLINE` seconds every thread's stack goes to stderr (this
    function's name in it) and the process exits with status 1. torch holds the GIL while it
    waits, so only faulthandler's own thread can keep that time."""
    global _SHM_MANAGER_STARTED
    import faulthandler

    import torch.multiprocessing

    if _SHM_MANAGER_STARTED or torch.multiprocessing.get_sharing_strategy() != "file_system":
        return
    held = {signal.SIGINT, *_STOP_SIGNALS}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    # To the process's own stderr (a notebook kernel's sys.stderr has no file descriptor); with
    # no stderr at all the wait is unbounded.
    with contextlib.suppress(AttributeError, OSError, RuntimeError, TypeError, ValueError):
        faulthandler.dump_traceback_later(SHM_MANAGER_DEADLINE, exit=True, file=sys.__stderr__ or sys.stderr)
    try:
        # The first tensor shared by file name starts torch_shm_manager. Stuck here past the
        # deadline: torch's shared-memory manager never answered (see the docstring).
        torch.empty(1).share_memory_()
        _SHM_MANAGER_STARTED = True
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def quiet_children() -> Iterator[None]:
    """Processes forked inside (hivemind's DHT and averager) get the default SIGTERM and SIGHUP,
    not this process's handlers: a peer turns them into KeyboardInterrupt, and a child inheriting that
    printed a KeyboardInterrupt traceback when a whole process group was terminated (a service
    manager, a closed terminal). With the default, a child just ends; the parent still shuts the
    others down in order. Only the main thread can touch signal handlers. Those children also end
    when the peer does, even killed with SIGKILL (:func:`_end_with_parent`), from any thread:
    a notebook's run forks its view's DHT in the run's thread (a kernel killed with SIGKILL, as
    the OOM killer does, left that DHT and its p2p daemon running, holding their port); Linux
    then ends them when that thread ends, and the run closes them before it does.

    Also installs :func:`quiet_handle_sharing` and a filter for asyncio's reports of hivemind's
    clean-up after a cancelled step (both inherited by the children forked here)."""
    quiet_handle_sharing()
    start_shm_manager()
    if _CANCELLED_STEP_NOISE not in logging.getLogger("asyncio").filters:
        logging.getLogger("asyncio").addFilter(_CANCELLED_STEP_NOISE)
    global _ORPHAN_WATCH_PARENT
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, signal.SIG_DFL) for s in _STOP_SIGNALS} if main else {}
    # forked here: ends with this process's forking thread (the peer's main thread)
    _ORPHAN_WATCH_PARENT = (os.getpid(), threading.get_ident()) if _prctl() else (0, 0)
    try:
        yield
    finally:
        _ORPHAN_WATCH_PARENT = (0, 0)
        for s, handler in previous.items():
            signal.signal(s, handler)


@functools.cache
def _quiet_dht_class():
    """hivemind's DHT, whose process ends quietly when a request's pipe is lost in transit,
    and whose event loop holds its tasks (:func:`swarm.hivemind_fixes.keep_tasks_alive`).

    A request from the peer can carry a connection (a future's pipe), which the DHT process
    fetches from the sender through multiprocessing's resource sharer. When the peer is
    stopping at that very moment, the fetch fails (EOFError) and hivemind's loop dies with a
    traceback in the log of a peer that stopped cleanly. Only that failure is quieted."""
    import hivemind

    class QuietDHT(hivemind.DHT):
        def run(self) -> None:
            from swarm.hivemind_fixes import install_task_keeper

            # Its loop holds its tasks: hivemind runs each request as a task it keeps no
            # reference to, and the collector destroyed one now and then mid-request.
            install_task_keeper("hivemind.dht.dht")
            try:
                super().run()
            except (EOFError, ConnectionError) as error:
                if not _in_resource_sharer(error.__traceback__):
                    raise
                logger.debug("the DHT process stops: a request's pipe was lost with its sender (%s)", error)

    return QuietDHT


def start_dht(
    config: NetworkConfig, validators: Sequence[object] = (), *, fresh_identity: bool = False
):  # -> hivemind.DHT
    """Start a DHT node in a child process; returns once it is connected to the swarm.
    ``validators``: the run's record validators (see :func:`swarm.validators.record_validators`).
    ``fresh_identity``: ``config.identity_path`` was made just now, so hivemind's check that no
    other peer uses it is skipped: that check starts a second p2p daemon, bootstraps it and dials
    the key's peer id (0.5-1 s of every join), and a new random key is nobody else's. A key
    kept across restarts is still checked (two processes started with one ``--identity``)."""
    import hivemind  # noqa: F401 - heavy (~2 s, kept out of `workbench --help`); before its log level is set

    import swarm.hivemind_fixes  # its locks, in this process and the ones it forks

    swarm.hivemind_fixes.stopping(False)  # a session after one that closed (a notebook's next)

    if "HIVEMIND_LOGLEVEL" not in os.environ:
        # Used as a library (a notebook, the monitor): hivemind's INFO lines ("Checking that
        # identity ... is not used") are noise there; the CLI sets its level with -v.
        logging.getLogger("hivemind").setLevel(logging.WARNING)

    # Signal handlers can only be read and set from the main thread (a notebook's Experiment
    # starts its observer from a background thread, where there is nothing to restore).
    in_main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if in_main else None
    kwargs = dict(
        initial_peers=[str(a) for a in parse_peer_addresses(config.initial_peers)]
        if config.initial_peers
        else [],
        host_maddrs=[listen_address(config.host, config.port)],
        announce_maddrs=parse_announce_addresses(config.announce) or None,
        client_mode=config.client_mode,
        record_validators=list(validators),
        check_if_identity_free=not fresh_identity,
        # hivemind asks the router to forward a public port to the daemon (UPnP / NAT-PMP) by
        # default: a peer meant for a LAN (--host 192.168.x.y) would be opened to the internet
        # on routers that allow it. Reachability from outside is the user's choice (--announce).
        nat_port_map=False,
        start=False,
    )
    if config.identity_path:
        kwargs["identity_path"] = config.identity_path
    if (
        config.port
    ):  # a client's p2p daemon listens on --host:--port too (hivemind's client mode is the DHT's)
        _check_port_free(config.host, config.port)
    deadline = time.monotonic() + config.connect_timeout
    while True:
        started = time.monotonic()
        left = max(deadline - started, 1.0)
        dht = None
        try:
            # Built inside too: a SIGTERM that raised KeyboardInterrupt in the middle of hivemind
            # putting a future in shared memory once left the process spinning in torch's
            # sharing code for good (seen once, in a retry); with the default action it just ends.
            with quiet_children():
                dht = _quiet_dht_class()(**kwargs, startup_timeout=left)
                dht.run_in_background(await_ready=True, timeout=left + 5)
            return dht
        except Exception as error:
            dht.shutdown() if dht is not None and dht.is_alive() else None
            # p2pd gives up on the bootstrap peers after its own dial timeout (3-8 s), not
            # --connect-timeout: a peer still starting (a script that launches start and join
            # together) is tried again while another try fits in the timeout.
            took = time.monotonic() - started
            if not (
                _bootstrap_unreachable(error, config) and time.monotonic() + RETRY_PAUSE + took < deadline
            ):
                raise SwarmError(_explain_start_failure(error, config)) from None
        finally:
            if in_main:
                signal.signal(signal.SIGINT, handler)  # hivemind sets SIG_IGN; keep Ctrl+C working
        logger.info(
            "no bootstrap peer answered yet; trying again for %.0f s more (see --connect-timeout)",
            deadline - time.monotonic(),
        )
        time.sleep(RETRY_PAUSE)


RETRY_PAUSE = 1.0
"""Seconds between two tries to reach the bootstrap peers."""


def _bootstrap_unreachable(error: BaseException, config: NetworkConfig) -> bool:
    """Whether ``error`` (from starting hivemind's DHT) says no bootstrap peer could be reached."""
    text = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    if any(local in text.lower() for local in LOCAL_BIND_FAILURES):
        # The daemon could not listen here ("Daemon failed to start: ... bind: ..."): this
        # machine's --host or --port, said at once (it was retried for --connect-timeout and
        # said as an unreachable bootstrap peer on `join`, a review, stop 72).
        return False
    # A bootstrap peer that never answers (a firewall dropping packets) keeps hivemind's daemon
    # from starting: "Daemon failed to start in N seconds" is about the peer, not this machine.
    unreachable = "bootstrap" in text or "connect" in text or "failed to start" in text.lower()
    return bool(config.initial_peers) and (unreachable or isinstance(error, TimeoutError))


LOCAL_BIND_FAILURES = ("address already in use", "cannot assign requested address")
"""What p2pd says when it cannot listen on this machine's ``--host``/``--port``."""


def _check_port_free(host: str, port: int) -> None:
    """SwarmError if something listens on ``host:port`` already. hivemind's p2p daemon binds with
    SO_REUSEPORT, so a second peer given a taken ``--port`` would start and share the port with
    the first (each connection going to either), with no error anywhere."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed peer's TIME_WAIT is no owner
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise SwarmError(
                    f"port {port} on {host} is already in use (another peer?): pick another --port or use 0"
                ) from None
            # Anything else (an address this machine does not have...): the daemon says it below.


def _unresolved(addresses: list[str]) -> list[str]:
    """The bootstrap peers' host names, when every bootstrap peer is a /dns/ name and none of
    them resolves (else []): after hivemind gave up on them, the reason to say. Not checked
    before it tries: a service name (docker compose, Kubernetes) may resolve only once its
    container is up, and a try is repeated within --connect-timeout."""
    names = []
    for address in parse_peer_addresses(addresses):
        protocols = [p.name for p in address.protocols()]
        if not protocols[0].startswith("dns"):
            return []  # an IP address: hivemind dialed it
        names.append(address.value_for_protocol(protocols[0]))
    for name in names:
        try:
            socket.getaddrinfo(name, None)
            return []
        except (socket.gaierror, UnicodeError):
            continue
    return names


def _explain_start_failure(error: BaseException, config: NetworkConfig) -> str:
    text = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    if _bootstrap_unreachable(error, config):
        unresolved = _unresolved(config.initial_peers)
        if unresolved:
            return (
                f"the bootstrap peers' host names do not resolve ({', '.join(unresolved)}): check the "
                "spelling, or use the /ip4/ address the first peer printed"
            )
        peers = " ".join(config.initial_peers)
        return (
            f"could not reach any bootstrap peer ({peers}) within {config.connect_timeout:.0f} s: check that "
            "the peer is running, the address and peer id are exactly what it printed, and its port is open"
        )
    if LOCAL_BIND_FAILURES[0] in text.lower():
        return f"port {config.port} on {config.host} is already in use: pick another --port or use 0"
    if LOCAL_BIND_FAILURES[1] in text.lower():  # (p2pd's raw line before, a review)
        return (
            f"--host {config.host} is not an address of this machine, so nothing can listen on it: use "
            "one of its own (`ip -4 addr`), or 0.0.0.0 for every interface (with --announce for the "
            "address others dial)"
        )
    if skew := _clock_skew(text):
        return (
            f"this machine's clock is {abs(skew):.0f} s {'behind' if skew > 0 else 'ahead of'} the peer it "
            "dialed, and hivemind's DHT needs every clock within 3 s of the others' (records expire by "
            "them): set the clock (`sudo timedatectl set-ntp true`, or `sudo chronyc makestep`) and start "
            "again"
        )
    return f"could not start the DHT node: {text}"


def _clock_skew(text: str) -> float | None:
    """The peer's clock minus this one's, from hivemind's refusal ("local time must be within 3
    seconds of others(local: 1796556116.6, peer: 1796556146.6)"), or None."""
    import re

    found = re.search(r"local time must be within.*local: ([0-9.]+), peer: ([0-9.]+)", text)
    return float(found[2]) - float(found[1]) if found else None


def wait_for(future, timeout: float, what: str):
    """The result of a hivemind MPFuture, or SwarmError after ``timeout`` seconds.

    hivemind 1.1.12's DHT process runs each call as an asyncio task it keeps no reference to;
    now and then one is garbage-collected while pending ("Task was destroyed but it is
    pending!") and a plain ``result()`` would wait forever. Every DHT call here has a deadline.
    """
    try:
        return future.result(timeout=timeout)
    except (TimeoutError, concurrent.futures.TimeoutError):  # distinct classes before Python 3.11
        future.cancel()
        raise SwarmError(f"the DHT did not answer {what} within {timeout:.0f} s") from None


def visible_addresses(dht, *, timeout: float = 10.0, attempts: int = 3) -> list[str]:
    """The multiaddrs (with /p2p/ id) others can paste to join, public ones first."""
    from hivemind import DHT

    for attempt in range(attempts):
        future = dht.run_coroutine(partial(DHT._get_visible_maddrs, latest=attempt > 0), return_future=True)
        try:
            addresses = [str(a) for a in wait_for(future, timeout, "with this peer's addresses")]
            return sorted(set(addresses), key=lambda a: ("/127." in a or "/::1/" in a, a))
        except SwarmError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


REDIAL_PEERS = 8  # addresses of peers seen, dialed again when the DHT lost them all


def redial(dht, addresses: Sequence[str]) -> concurrent.futures.Future:
    """Dial and ping each peer at ``addresses`` that the DHT's routing table does not hold
    (fire and forget; the future: how many answered).

    hivemind drops a peer from its routing table after one request it did not answer, and only
    a request to or from a peer puts it back. A peer frozen past its connections' keepalive (a
    laptop asleep, SIGSTOP) drops its round mates at its first request after waking, while they
    dropped it during its sleep; with no third node to introduce them again, neither ever
    contacts the other: each trained alone for good (make faults' frozen straggler, when the
    freeze fell between two rounds). Malformed addresses are skipped."""
    bounded = list(addresses)[: 2 * REDIAL_PEERS]  # two addresses a peer: what the board passes
    return dht.run_coroutine(partial(_redial, addresses=bounded), return_future=True)


async def _redial(_dht, node, addresses: list[str]) -> int:
    """In the DHT's process: see :func:`redial`."""
    import asyncio

    from hivemind.p2p import PeerID
    from multiaddr import Multiaddr

    async def ping(address: str) -> bool:
        try:
            maddr = Multiaddr(address)
            peer = PeerID.from_base58(maddr.value_for_protocol("p2p"))
            if peer == node.peer_id or node.protocol.routing_table.get(peer_id=peer) is not None:
                return False
            await asyncio.wait_for(node.p2p._client.connect(peer, [maddr.decapsulate(f"/p2p/{peer}")]), 10)
            return await node.protocol.call_ping(peer) is not None  # puts it back in the table
        except Exception as error:  # noqa: BLE001 - gone, unreachable, malformed: the next one
            logger.debug("redialing %s: %s", address, error)
            return False

    return sum(await asyncio.gather(*map(ping, addresses)))


def dht_time() -> float:
    from hivemind.utils import get_dht_time

    return get_dht_time()


def release_interrupted_locks(*averagers: object) -> list[str]:
    """Release the process-shared locks of hivemind that this thread holds: after a
    KeyboardInterrupt (Ctrl+C, or SIGTERM/SIGHUP turned into one), every one it holds is one it
    will never release. ``multiprocessing``'s ``Lock.__enter__`` is Python code that calls the C
    acquire and then returns, and Python runs a pending signal handler between the two: the
    interrupt leaves the ``with`` before it began, holding the lock (2,000 interrupts of a loop
    making MPFutures left ``SharedBytes._lock`` held 584 times here). The next MPFuture, in
    this process or in any child forked from it, then waits for ever: a peer's leaving
    announcement hung until the close deadline killed it (exit 1). The names released."""
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    from swarm.hivemind_fixes import stopping

    stopping()  # a child ended by the same signal may hold one of them: waits are bounded now
    locks = {
        "SharedBytes._lock": SharedBytes._lock,
        "MPFuture._initialization_lock": MPFuture._initialization_lock,
        "MPFuture._update_lock": MPFuture._update_lock,
    }
    for i, averager in enumerate(averagers):
        if getattr(averager, "lock_averaged_tensors", None) is not None:
            locks[f"averager {i}'s lock_averaged_tensors"] = averager.lock_averaged_tensors
    released = []
    for name, lock in locks.items():
        semlock = getattr(lock, "_semlock", None)
        if semlock is not None and semlock._is_mine():
            lock.release()
            released.append(name)
    if released:
        logger.debug("released %s, held since an interrupt", ", ".join(released))
    return released


def shutdown_quietly(*nodes: Sequence[object]) -> None:
    """Shut down averagers, then DHTs (the other order prints connection-reset tracebacks);
    first, the hivemind locks an interrupt left held (:func:`release_interrupted_locks`)."""
    release_interrupted_locks(*nodes)
    for node in nodes:
        if node is None:
            continue
        try:
            node.shutdown()
        except Exception as error:  # shutting down must never raise over the real error
            logger.debug("shutdown of %s failed: %s", type(node).__name__, error)
