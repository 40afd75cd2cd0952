"""`Experiment`: one object for a run on the simulator, on local peers, or on a real swarm.

Built from the same config tree as the CLI (keyword arguments are the CLI's flags)::

    from workbench import Experiment, compare

    dp = Experiment(backend="sim", method="dp", peers=4, steps=200, model="tiny").run()
    diloco = Experiment(backend="sim", method="diloco", inner_steps=20, peers=4, steps=200, model="tiny")
    diloco.run()          # returns at once: training runs in a background thread
    diloco.widget()       # live view in the notebook (works while the run goes on)
    diloco.wait()
    diloco.history()      # a pandas DataFrame: step, tokens, bytes_per_peer, loss, eval_loss, ...
    compare([dp, diloco], x="bytes")

Backends:

- ``"sim"``: N virtual peers in this process (``optim.sim``), deterministic for a seed;
- ``"local"``: N real peers as processes on 127.0.0.1 (what ``workbench demo`` runs); steerable;
- ``"swarm"``: one real peer of a run on the network: ``initial_peers=[...]`` joins one, none
  starts one (then you are its owner and can steer it).

Your own model (sim backend): ``Experiment(model=MyNet(), loss_fn=my_loss, ...)``; ``MyNet()(x)``
gets (B, T) token ids, ``my_loss(output, y)`` returns the loss (without ``loss_fn``, the
module's ``forward(x, y)`` must return ``(output, loss)`` itself). A callable that builds the
module works too; it is called with the run's seed set, once per virtual peer.
"""

from __future__ import annotations

import atexit
import copy
import logging
import math
import numbers
import os
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from swarm.errors import SwarmError
from workbench.config import RunConfig

logger = logging.getLogger(__name__)

BACKENDS = ("sim", "local", "swarm")


class Stopped(SwarmError):
    """The run was ended by :meth:`Experiment.stop` (what ``wait()`` raises then)."""


SIM_IGNORES = (
    "aggregate",
    "averaging_timeout",
    "data_plane",
    "device",
    "matchmaking_time",
    "shard",
)
"""Settings of real peers that the simulator has no use for: refused on ``backend="sim"``."""
DEMO_DISPLAY = ("headless", "json", "no_tui", "timeout")
"""`workbench demo`'s ways to show and bound its run: an Experiment has its own (refused)."""


class WithLoss(torch.nn.Module):
    """Your module and a loss function as the workbench's model: ``forward(x, y)`` returns
    ``(module(x), loss_fn(module(x), y))``; ``x``, ``y`` are (B, T) token ids, ``y`` shifted by one."""

    def __init__(self, module: torch.nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.module, self.loss_fn = module, loss_fn

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> tuple[Any, torch.Tensor | None]:
        out = self.module(x)
        return out, (None if y is None else self.loss_fn(out, y))


def _custom_model(flags: dict[str, Any], backend: str) -> Callable[[], torch.nn.Module] | None:
    """Take ``model=<nn.Module or a callable making one>`` and ``loss_fn`` out of ``flags``; a
    factory giving each virtual peer its own copy of the same initial θ."""
    model, loss_fn = flags.get("model"), flags.pop("loss_fn", None)
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be a function of (output, y) (got {type(loss_fn).__name__})")
    if model is None or isinstance(model, str):
        if loss_fn is not None:
            raise ValueError("loss_fn goes with model=<your nn.Module>; presets bring their own loss")
        return None
    del flags["model"]
    if backend != "sim":
        raise ValueError(
            "a Python module trains on backend='sim'; real peers load a preset or a Hugging Face folder "
            "(model='./my-llama'), or wrap your module with optim.DiLoCo directly"
        )
    seed = flags.get("seed")
    if seed is not None:  # checked as the keyword is (int(None), int("abc"): a review)
        from workbench.settings.commands import command_settings

        seed = command_settings("simulate")["seed"].check(seed, "seed")
    seed = seed or 0
    if isinstance(model, torch.nn.Module):
        template = copy.deepcopy(model)
        make = lambda: copy.deepcopy(template)  # noqa: E731
    elif callable(model):

        def make() -> torch.nn.Module:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)  # every peer's call draws the same initial θ
                return model()
    else:
        raise ValueError(
            f"model must be a preset name, a folder, an nn.Module or a callable (got {type(model).__name__})"
        )
    built = make()  # now, not in the run's thread: a broken factory fails here, where it is called
    if not isinstance(built, torch.nn.Module):
        raise ValueError(f"model() must return a torch.nn.Module (got {type(built).__name__})")
    if loss_fn is None and not _takes_two(built):
        raise ValueError(
            f"{type(built).__name__}.forward takes only x: give loss_fn=<function of (output, y)>, or "
            "make forward(x, y) return (output, loss)"
        )
    return (lambda: WithLoss(make(), loss_fn)) if loss_fn is not None else make


def _try_on_a_batch(make: Callable[[], torch.nn.Module], config: RunConfig) -> None:
    """Call a custom model once as the run will, ``model(x, y)`` on token ids of the run's block
    size, and say what is wrong with what comes back: logits alone, a loss that is not one
    number, a vocabulary under the 256 byte ids, arguments that do not fit each other all failed
    after ``run()``, deep in torch ("too many values to unpack", "index out of range in self")."""
    block = config.model.block_size
    vocab = 256 if config.data.tokenizer is None else 2  # a tokenizer's size is known when it is loaded
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        x = torch.randint(0, vocab, (2, block))
        y = torch.randint(0, vocab, (2, block))
        model = make()
        what = f"model(x, y) on token ids x, y of shape (2, {block})" + (
            " (ids 0..255: the data is bytes unless tokenizer= is given)" if vocab == 256 else ""
        )
        try:
            out = model(x, y)
        except Exception as error:  # noqa: BLE001 - said with what it was called on
            raise ValueError(f"{what} failed: {type(error).__name__}: {str(error).splitlines()[0]}") from None
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ValueError(f"{what} must return (output, loss), got {type(out).__name__}")
    loss = out[1]
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"{what} must return a loss of one number (a 0-d float tensor), got {shape}")
    if not loss.requires_grad:
        raise ValueError(f"{what} returned a loss with no gradient: compute it from the model's output")


_RUNNING: weakref.WeakSet[Experiment] = weakref.WeakSet()
"""Experiments started in this process (see :func:`_stop_at_exit`)."""
AT_EXIT_SECONDS = 10.0


@atexit.register
def _stop_at_exit() -> None:
    """A script (or a kernel run by papermill or nbconvert) ending while a run goes on: its
    daemon thread was cut inside torch, and the process aborted (``terminate called without an
    active exception``, SIGABRT, a review). Each run is asked to stop (a simulation at the end
    of its round, real peers leaving), and waited for up to :data:`AT_EXIT_SECONDS` in all."""
    running = [e for e in list(_RUNNING) if e.running]
    for experiment in running:
        experiment.stop()
    deadline = time.monotonic() + AT_EXIT_SECONDS
    for experiment in running:
        experiment._done.wait(max(0.0, deadline - time.monotonic()))  # noqa: SLF001


_THREADS_LOCK = threading.Lock()
_THREADS: dict[str, int] = {"runs": 0, "before": 0}


def _threads_in(threads: int) -> None:
    """A simulation starts: torch's thread count (process-wide) is ``threads`` while it runs;
    the count from before the first of the simulations running at once is put back after the
    last (each putting back its own, two runs at once left the notebook at the other's)."""
    with _THREADS_LOCK:
        if _THREADS["runs"] == 0:
            _THREADS["before"] = torch.get_num_threads()
        _THREADS["runs"] += 1
        if threads:
            torch.set_num_threads(threads)


def _threads_out() -> None:
    with _THREADS_LOCK:
        _THREADS["runs"] -= 1
        if _THREADS["runs"] == 0:
            torch.set_num_threads(_THREADS["before"])


def _takes_two(module: torch.nn.Module) -> bool:
    """Whether ``module(x, y)`` can be called (its forward takes a second positional argument)."""
    import inspect

    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: let the run say
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


def config_from_flags(
    command: str = "demo", *, initial_peers: list[str] | None = None, simulated: bool = False, **flags: Any
) -> tuple[RunConfig, Any]:
    """A RunConfig from settings given as keyword arguments, named as the CLI's flags
    (``inner_steps=20`` is ``--inner-steps 20``, ``eager=False`` is ``--no-eager``), checked
    as the flags are (:mod:`workbench.settings`) and built directly, without argv
    (``initial_peers``: the addresses of ``join``)."""
    from workbench.cli.options import build_config
    from workbench.settings.commands import values_of

    args = values_of(command, flags)
    if command == "join":
        args.peers = list(initial_peers or [])
    return build_config(args, simulated=simulated), args


SWARM_SETTINGS = ("host", "port", "announce", "client_mode", "identity", "owner", "connect_timeout")
SWARM_REFUSES = ("checkpoint_every", "fault_file", "resume")
"""`start`'s settings a notebook's swarm peer is not given (its folder is the Experiment's): refused."""
"""The network settings a ``backend="swarm"`` peer is started with (beside the demo peers'
:data:`workbench.local.launch.PEER_SETTINGS`; the secret goes by its environment variable, never
on a command line)."""


def _notebook_extra(module: str, what: str) -> Any:
    """``module`` (of the notebook extra), or an ImportError saying how to get it: a plain
    `pip install .` has none of them, and ``widget()`` raised a bare "No module named
    'anywidget'" (a review, stop 60)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise ImportError(
            f"{what} needs the '{package}' package: pip install 'swarm-workbench[notebook]' "
            f"(or pip install {package}; `make bootstrap` installs it)"
        ) from None


def _check_counts(**counts: Any) -> dict[str, Any]:
    """peers, steps and rounds: whole numbers in their flags' bounds (text too: "4"); steps or
    rounds, not both. Returns them as numbers."""
    from swarm import bounds

    if counts["steps"] is not None and counts["rounds"] is not None:
        raise ValueError("give steps= or rounds=, not both (steps = rounds x inner_steps)")
    for key, value in list(counts.items()):
        if value is None:
            continue
        if isinstance(value, str) and value.strip().isdigit():  # numbers may be given as text
            value = counts[key] = int(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # NumPy's too
            raise ValueError(f"{key} must be a whole number (got {value!r})")
        value = counts[key] = int(value)
        low = 1 if key == "rounds" else bounds.BOUNDS[key].low  # 0 rounds (until stopped) is the CLI's
        if value < low:
            raise ValueError(f"{key} must be at least {low:g} (got {value})")
        bounds.check(key, value)
    return counts


class Experiment:
    """A training run you start, watch and steer from Python (see the module docstring)."""

    def __init__(
        self,
        *,
        backend: str = "sim",
        peers: int | None = None,
        steps: int | None = None,
        rounds: int | None = None,
        name: str | None = None,
        initial_peers: list[str] | None = None,
        run_dir: str | Path | None = None,
        speeds: list[float] | None = None,
        **flags: Any,
    ) -> None:
        """``speeds`` (sim only): each virtual peer's speed on the simulator's virtual clock, with
        ``round_seconds`` then in virtual seconds (a speed-1 step takes one); on real peers
        ``round_seconds`` is wall time and each peer's speed is its own."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
        if backend == "swarm" and peers is not None:
            raise ValueError(
                "backend='swarm' runs one peer on this machine, of a run others join from theirs: "
                "peers= is for backend='sim' or 'local'"
            )
        peers = 1 if backend == "swarm" else 4 if peers is None else peers
        dropped = [key for key in SWARM_REFUSES if flags.get(key) not in (None, 0, "")]
        if backend == "swarm" and dropped:
            raise ValueError(
                f"{', '.join(f'{key}=' for key in dropped)}: not passed to a notebook's swarm peer; run "
                "`workbench start` or `join` in a terminal for checkpoints, a resume or a fault file"
            )
        counted = _check_counts(peers=peers, steps=steps, rounds=rounds)
        peers, steps, rounds = counted["peers"], counted["steps"], counted["rounds"]
        if backend == "local":
            from workbench.local.launch import MAX_LOCAL_PEERS

            if peers > MAX_LOCAL_PEERS:
                raise ValueError(
                    f"backend='local' starts at most {MAX_LOCAL_PEERS} peers on this machine (got {peers})"
                )
        if isinstance(initial_peers, (str, bytes)):
            raise ValueError(
                f"initial_peers is a list of multiaddrs: initial_peers=[{initial_peers!r}] (got a string)"
            )
        if initial_peers and backend != "swarm":
            raise ValueError("initial_peers= joins a running swarm: use it with backend='swarm'")
        if initial_peers:
            from swarm.addresses import parse_peer_addresses

            if not all(isinstance(a, str) for a in initial_peers):  # ([123]: an AttributeError, a review)
                raise ValueError(f"initial_peers is a list of multiaddrs (strings), got {initial_peers!r}")
            parse_peer_addresses(initial_peers)  # a bad address is an error here, not in the run
        if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
            raise ValueError(f"run_dir is a folder's path, got {type(run_dir).__name__} {run_dir!r}")
        if hasattr(speeds, "tolist"):  # a NumPy array (np.arange, np.linspace)
            speeds = speeds.tolist()
        if speeds is not None and (
            not isinstance(speeds, (list, tuple))
            or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in speeds)
        ):
            raise ValueError(f"speeds is a list of numbers, one per peer, e.g. [1, 1, 0.5] (got {speeds!r})")
        if speeds is not None:
            speeds = [float(v) for v in speeds]  # (np.float32 too)
        if speeds is not None and backend != "sim":
            raise ValueError("speeds= sets the simulator's virtual clock: use it with backend='sim'")
        if backend == "sim" and flags.get("codec") not in (None, "none"):  # (None: not given, as elsewhere)
            raise ValueError(
                f"codec={flags['codec']!r} is the wire codec of real peers' all-reduce, and the simulator "
                f"has no wire: use update_codec={flags['codec']!r} to compress the updates it averages"
            )
        shown = [key for key in DEMO_DISPLAY if flags.get(key) not in (None, False)]
        if shown:
            raise ValueError(
                f"{', '.join(f'{key}=' for key in shown)}: `workbench demo`'s display settings; an "
                "Experiment shows its run with .widget() and .history(), and .wait(timeout) bounds the wait"
            )
        ignored = [key for key in SIM_IGNORES if flags.get(key) not in (None, False)]
        if backend == "sim" and ignored:
            raise ValueError(
                f"{', '.join(f'{key}=' for key in ignored)} set{'s' if len(ignored) == 1 else ''} "
                "real peers (backend='local' or 'swarm'); the simulator would ignore "
                f"{'it' if len(ignored) == 1 else 'them'}"
            )
        self.speeds = list(speeds or [])
        self.backend = backend
        self.peers = peers
        self.make_model = _custom_model(flags, backend)  # your own nn.Module (sim), else None
        self.flags = dict(flags)
        self.method = flags.get("method", "diloco")
        # A swarm peer takes `workbench start`'s or `join`'s settings (--run-id, --host,
        # --announce, --secret...); the others the demo's.
        command = "demo" if backend != "swarm" else "join" if initial_peers else "start"
        self.config, self.args = config_from_flags(
            command, initial_peers=initial_peers, simulated=backend == "sim", **flags
        )
        if self.make_model is not None:  # one step's forward now, not a torch error after run()
            _try_on_a_batch(self.make_model, self.config)
        if backend == "sim" and self.config.peer.round_seconds and self.config.outer_method.fragmented:
            raise ValueError(  # as `workbench simulate` says it: it was accepted and did nothing
                f"round_seconds= boxes a round's inner steps, and the simulator syncs {self.method}'s "
                "fragments one inner step at a time: drop it (real peers, backend='local', take it)"
            )
        H = self.config.diloco.inner_steps
        if steps is None and rounds is None and backend != "swarm" and self.config.outer_method.every_step:
            # dp averages every step (its round is one step): the others' budget in steps, not
            # 8 steps against their 160, which made every default comparison 20x unfair.
            from workbench.settings.run import DEMO_DEFAULTS

            steps = 8 * DEMO_DEFAULTS["inner_steps"]
        if steps is None and rounds is None:
            rounds = 0 if backend == "swarm" else 8  # a swarm peer: until stop(), as the CLI's
        if steps is not None and backend != "sim" and steps % H:
            # Real peers run whole rounds (they have no step budget): steps=30 with H=20 ran 40
            # steps a peer while the Experiment said 30, against a simulator that ran 30.
            whole = max(1, -(-steps // H))
            raise ValueError(
                f"backend={backend!r} runs whole rounds of inner_steps={H}: steps={steps} is not a multiple "
                f"of it; give steps={whole * H} (or rounds={whole})"
            )
        self.rounds = rounds if rounds is not None else max(1, -(-steps // H))  # type: ignore[operator]
        self.steps = steps if steps is not None else self.rounds * H
        if backend == "sim":  # its settings, checked now rather than in the run's thread
            from optim.sim import SimConfig

            SimConfig(
                peers=peers,
                steps=self.steps,
                speeds=self.speeds,
                round_seconds=self.config.peer.round_seconds,
            )
        self.name = name or f"{self.method} ({backend})"
        self.initial_peers = list(initial_peers or [])
        self._run_dir = Path(run_dir) if run_dir else None
        self.error: BaseException | None = None
        self.result: Any = None
        self._rows: list[dict[str, Any]] = []
        self._thread: threading.Thread | None = None
        self._source = None
        self._sim_readings = None
        self._stop = threading.Event()
        self._done = threading.Event()  # set when the run's thread has finished, whatever the way
        self._lock = threading.Lock()

    @property
    def run_dir(self) -> Path:
        """Where real peers keep their logs and metrics (a new temporary folder unless given;
        made on first use: a simulated run writes nothing)."""
        if self._run_dir is None:
            self._run_dir = Path(tempfile.mkdtemp(prefix="workbench-experiment-"))
        return self._run_dir

    def __repr__(self) -> str:
        state = (
            "running"
            if self.running
            else "stopped"
            if isinstance(self.error, Stopped)
            else "failed"
            if self.error is not None
            else "done"
            if self.result is not None
            else "ready"
        )
        return f"Experiment({self.name!r}, backend={self.backend!r}, peers={self.peers}, {state})"

    # --- running ---------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._done.is_set()

    def run(self) -> Experiment:
        """Start in a background thread (the notebook stays responsive); returns self."""
        if self._thread is not None:
            raise RuntimeError("this experiment already ran; make a new Experiment to run again")
        target = {"sim": self._run_sim, "local": self._run_local, "swarm": self._run_swarm}[self.backend]

        def guarded() -> None:
            try:
                target()
            except BaseException as error:  # shown by wait() and repr, never lost in the thread
                self.error = error
                if isinstance(error, Stopped):  # asked for (stop()): no failure
                    logger.info("%s: %s", self.name, error)
                else:
                    logger.error("%s failed: %s", self.name, error)
            finally:
                self._done.set()

        self._thread = threading.Thread(target=guarded, name=f"experiment-{self.name}", daemon=True)
        _RUNNING.add(self)
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> Experiment:
        """Block until the run ends; re-raises its error."""
        if self._thread is None:
            raise RuntimeError("call run() first")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0
        ):  # (wait("5"): a TypeError from the comparison, a review)
            raise ValueError(
                f"timeout is seconds to wait, >= 0, or None to wait for the end (got {timeout!r})"
            )
        if timeout == math.inf:  # (Event.wait raised OverflowError on it)
            timeout = None
        try:
            # An Event, not Thread.join: Ctrl+C in a join can leave the thread looking finished
            # while it runs on (CPython's join lock), and then stop() and repr lie.
            finished = self._done.wait(timeout)
        except KeyboardInterrupt:
            raise KeyboardInterrupt(
                f"{self.name} goes on in the background: .stop() ends it, .wait() waits again"
            ) from None
        if not finished:
            raise TimeoutError(f"{self.name} still running after {timeout} s")
        if self.error is not None:
            raise self.error
        return self

    def stop(self) -> None:
        """Stop the run early: a simulation at the end of the round in progress (its history
        keeps the rounds done), real peers leave cleanly. ``wait()`` then raises "was stopped".
        Before ``run()`` (or after the run ended) there is nothing to stop: a no-op."""
        if self.running:
            self._stop.set()

    # --- results --------------------------------------------------------------------------------

    def history(self):
        """One row per outer round (pandas DataFrame): round, step, tokens, bytes_per_peer,
        loss (mean inner loss), eval_loss (where evaluated), seconds, experiment."""
        pd = _notebook_extra("pandas", "history()")

        with self._lock:
            rows = [dict(r, experiment=self.name) for r in self._rows]
        columns = ["experiment", "round", "step", "tokens", "bytes_per_peer", "loss", "eval_loss", "seconds"]
        return pd.DataFrame(rows, columns=columns)

    def _add(self, **row: Any) -> None:
        """Append a history row (the dict itself: a simulation fills in its eval loss later)."""
        with self._lock:
            self._rows.append(row)

    # --- live view --------------------------------------------------------------------------------

    def source(self):
        """The :class:`~workbench.sources.SnapshotSource` the widget and the TUI read."""
        deadline = time.monotonic() + 120
        while self._source is None:
            if self.error is not None:
                raise self.error
            if self._thread is None:
                raise RuntimeError("call run() first")
            if self._done.is_set() and self._source is None:  # it waited 120 s for nothing
                raise SwarmError(
                    f"{self.name} ended before its live view connected (a short run): history() has its rows"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} has no live view yet")
            time.sleep(0.1)
        return self._source

    def widget(self, **options: Any):
        """A live Jupyter widget over this run (summary, peers, loss chart, steering)."""
        _notebook_extra("anywidget", "widget()")
        from workbench.notebook.widget import SwarmWidget

        return SwarmWidget(self.source(), **options)

    # --- backends ----------------------------------------------------------------------------------

    def _tokens(self, step: int) -> int:
        return step * self.peers * self.config.data.batch_size * self.config.model.block_size

    def _run_sim(self) -> None:
        from workbench.simulate import MethodSpec
        from workbench.sources import SimSource

        spec = MethodSpec(
            method=self.method,
            diloco=self.config.diloco,
            fragments=self.config.fragments,
            sync_delay=self.config.sync_delay,  # checked values: "0.5" from a notebook is a number here
            alpha=self.config.alpha,
        )
        H = spec.loop_steps()  # inner steps per simulator round: 1 for streaming's fragments
        per_row = max(1, self.config.diloco.inner_steps // H)  # simulator rounds per outer round
        source = SimSource(
            self.name, self.peers, inner_steps=self.config.diloco.inner_steps, per_round=per_row
        )
        self._source = source
        every = per_row * (
            self.args.eval_every  # checked as the flag is
            if self.flags.get("eval_every") is not None
            else max(1, self.rounds // min(self.rounds, 24))  # ~24 evaluations whatever H is
        )
        rows = _SimRows(self, H, per_row, time.monotonic())
        # The run's threads (the demo's default: 1), for this run only: applied only when given,
        # the default ran on all of torch's threads, and a value given once stayed for every
        # later cell, so the same cell's numbers depended on the cells before and the machine.
        _threads_in(self.config.train.threads)

        def on_round(info: dict[str, float]) -> None:
            source.update(info)
            rows.reported(info)
            if self._stop.is_set():
                raise Stopped(f"{self.name} was stopped at round {rows.outer_round(int(info['round']))}")

        try:
            result = self._simulate(spec, every, on_round, rows.evaluated)
        finally:
            source.finish()
            _threads_out()
        self.result = result
        rows.finish(result)

    def _simulate(
        self,
        spec,
        every: int,
        on_round: Callable[[dict[str, float]], None],
        on_eval: Callable[[dict[str, float]], None],
    ):
        from optim.sim import SimConfig
        from workbench.simulate import run_simulation

        return run_simulation(
            spec,
            make_model=self.make_model,
            model=self.config.model,
            hf_model=self.config.hf_model,
            data=self.config.data,
            train=self.config.train,
            sim=SimConfig(
                peers=self.peers,
                steps=self.steps,
                seed=self.config.peer.seed,
                eval_every=every,
                on_round=on_round,
                on_eval=on_eval,
                speeds=self.speeds,
                round_seconds=self.config.peer.round_seconds,
            ),
        )

    def _local_config(self) -> RunConfig:
        run_id = f"nb-{uuid.uuid4().hex[:8]}"
        return replace(
            self.config,
            peer=replace(self.config.peer, run_id=run_id, rounds=self.rounds, min_peers=self.peers),
        )

    def _run_local(self) -> None:
        from workbench.local.launch import LocalSwarm
        from workbench.sources import DemoSource

        config = self._local_config()
        swarm = LocalSwarm(config, peers=self.peers, run_dir=self.run_dir)
        try:
            swarm.start()
            self._source = DemoSource.of(swarm)
            self._follow(swarm.peers[0], lambda: all(p.process.poll() is not None for p in swarm.peers))
            swarm.check_alive()
        finally:
            swarm.stop()
            if self._source is not None:
                self._source.close()

    def _run_swarm(self) -> None:
        """One real peer: joins ``initial_peers`` (or starts a run), as `workbench join/start`."""
        from workbench.cli.argv import setting_arguments
        from workbench.local.launch import LaunchError, LocalSwarm
        from workbench.sources import LiveSource

        config = replace(self.config, peer=replace(self.config.peer, rounds=self.rounds))
        swarm = LocalSwarm(config, peers=1, run_dir=self.run_dir)
        swarm.run_dir.mkdir(parents=True, exist_ok=True)
        command = "join" if self.initial_peers else "start"
        extra = [*self.initial_peers, *setting_arguments(config, SWARM_SETTINGS, changed_only=True)]
        secret = {"WORKBENCH_RUN_SECRET": config.peer.secret} if config.peer.secret else {}
        peer = swarm._spawn(command, "peer", extra, env=secret)  # noqa: SLF001 - one peer, no shard
        try:
            deadline = time.monotonic() + 120
            while (started := peer.last("started")) is None:
                peer.poll_events()
                if self._stop.is_set():
                    raise Stopped(f"{self.name} was stopped before its peer started")
                if peer.process.poll() is not None:
                    raise LaunchError(f"the peer exited before starting; {peer.log_end()}")
                if time.monotonic() > deadline:
                    raise LaunchError(f"the peer did not start within 120 s; {peer.log_end()}")
                time.sleep(0.2)
            owner_key = config.network.identity_path or self.run_dir / "peer" / "identity.key"
            own = list(started["addresses"])  # only the announced ones, with --announce
            if config.network.host in ("0.0.0.0", "127.0.0.1") and config.network.port:
                # Its own peer through loopback first: a router may not loop the public address back.
                own.insert(0, f"/ip4/127.0.0.1/tcp/{config.network.port}/p2p/{started['peer_id']}")
            try:
                self._source = LiveSource.connect(
                    self.initial_peers or own,
                    run_id=config.peer.run_id,
                    secret=config.peer.secret,
                    owner=config.peer.owner,
                    key=owner_key if not self.initial_peers else None,
                    connect_timeout=config.network.connect_timeout,
                    anchors=[started["peer_id"]],  # its own peer first: this machine runs it
                )
            except SwarmError:
                # A short run can end before the view connects: its rows are in the peer's
                # events all the same (this reported a finished run as failed, history empty).
                # A peer that failed is still a failure, said with its log.
                if not _exits(peer.process, within=15.0):
                    raise
                if peer.process.returncode != 0:
                    raise LaunchError(
                        f"the peer exited with code {peer.process.returncode}; {peer.log_end()}"
                    ) from None
                logger.info("%s: the run ended before its live view connected", self.name)
            self._follow(peer, lambda: peer.process.poll() is not None)
        finally:
            swarm.stop()
            if self._source is not None:
                self._source.close()

    def _follow(self, peer, finished) -> None:
        """Turn a real peer's round events into history rows until the run ends; ``seconds``
        from the peer's start (its events' clock), not from when this began to follow. One row
        per outer round: streaming's peers send an event per fragment sync (F a round), which
        made F rows a round, numbered by syncs. The run's end (``final_sync``, ``done``) goes
        into the last row: the bytes of the mean a delayed or overlapped run still had in
        flight, and the final θ's eval loss (as the simulator's rows have them)."""
        started = (peer.last("started") or {}).get("time", time.time())
        per = self.config.outer_method.syncs_per_round(self.config.fragments)
        sent = step = seen = 0
        losses: list[float] = []
        read = getattr(self._source, "read_once", None)
        last_read = 0.0
        final = self.rounds * per  # the run's last outer step (syncs)
        ended: float | None = None  # when the followed peer finished its last round
        view = None
        while True:
            over = finished()  # before the read: the events it then gets include the last ones
            if read is not None and not over and ended is None and time.monotonic() - last_read >= 1.0:
                read(again=True)  # the view follows the run to its end, a widget open or not
                last_read = time.monotonic()
            peer.poll_events()
            # Every event, from the first: those read while waiting for "started" too (a lone
            # peer's initial eval often came in the same read, and its row was lost).
            events, seen = peer.events[seen:], len(peer.events)
            for event in events:
                if event["event"] == "initial_eval":
                    self._add(
                        round=event["outer_step"] // per,
                        step=0,
                        tokens=0,
                        bytes_per_peer=0,
                        loss=None,
                        eval_loss=event["eval_loss"],
                        seconds=0.0,
                    )
                if event["event"] == "round":
                    sent += event["bytes_sent"]
                    # Its own H this round: steered or time-boxed rounds change it.
                    step += event.get("inner_steps") or self.config.diloco.inner_steps // per
                    losses.append(event["loss"])
                    if event["outer_step"] >= final and ended is None:
                        ended = time.monotonic()
                    if event["outer_step"] % per:
                        continue  # a fragment's sync inside an outer round
                    self._add(
                        round=event["outer_step"] // per,
                        step=step,
                        tokens=self._tokens(step),
                        bytes_per_peer=sent,
                        loss=sum(losses) / len(losses),
                        eval_loss=event["eval_loss"] if event.get("evaluated", True) else None,
                        seconds=max(0.0, event["time"] - started),
                    )
                    losses = []
                if event["event"] == "final_sync":
                    sent += event.get("bytes_sent") or 0
                    self._end(bytes_per_peer=sent)
                if event["event"] == "done":
                    self.result = event
                    # Its view's last readings (below), while the run is still there to read
                    # (after, a lone peer's view found nobody left and showed an empty run).
                    ended = ended if ended is not None else time.monotonic()
                    if event.get("final_eval_loss") is not None:
                        self._end(eval_loss=event["final_eval_loss"])
            reading_the_end = (
                read is not None
                and not over
                and ended is not None
                and time.monotonic() - ended < END_READS
                and not _shows_the_end(view, final)
            )
            if reading_the_end:
                # The end as the peers publish it, while they agree on the final θ and before they
                # leave (a short run's whole end can take less than a second): read at once and
                # until every peer shows it (read once at "done", the view held the followed
                # peer's heartbeat of a round before, or the peers as they left). Once shown, it
                # is not read again: as the peers leave, a read finds fewer, then none.
                view = read(again=True)
            if over:
                return
            if self._stop.is_set():
                raise Stopped(f"{self.name} was stopped")
            time.sleep(0.1 if reading_the_end else 0.3)

    def _end(self, **fields: Any) -> None:
        """The run's end, into its last round's row (not the start's)."""
        with self._lock:
            if self._rows and self._rows[-1]["round"] > 0:
                self._rows[-1].update(fields)


END_READS = 10.0
"""Seconds a real run's view is read again after its followed peer's last round, until it shows
every peer at the run's last outer step."""


def _shows_the_end(view: Any, final: int) -> bool:
    """Whether ``view`` (a snapshot, or None: not read) shows the run's end: every live peer at
    outer step ``final`` or later (those that left are shown as they left)."""
    peers = getattr(view, "peers", None)
    return bool(peers) and all(p.outer_step >= final for p in peers.values())


class _SimRows:
    """A simulation's history rows, made as it runs: one per outer round once every virtual peer
    has reported it (a round cut short by stop() leaves no row), its eval loss added when rank 0
    evaluates it. Streaming's simulator rounds are single inner steps: ``per_row`` of them make
    an outer round (H inner steps)."""

    def __init__(self, experiment: Experiment, loop_steps: int, per_row: int, started: float) -> None:
        self.experiment, self.started = experiment, started
        self.loop_steps, self.per_row = loop_steps, per_row
        self.lock = threading.Lock()
        self.reports: dict[int, dict[int, dict[str, float]]] = {}  # simulator round -> rank -> info
        self.trained = [0] * experiment.peers  # inner steps each peer ran so far
        self.rows: dict[int, dict[str, Any]] = {}  # outer round -> its row (also in the history)
        self.evals: dict[int, float] = {}  # outer round -> eval loss, when it came first

    def outer_round(self, sim_round: int) -> int:
        return -(-sim_round // self.per_row)

    def reported(self, info: dict[str, float]) -> None:
        sim_round, rank = int(info["round"]), int(info["rank"])
        experiment = self.experiment
        with self.lock:
            self.trained[rank] += int(info["step"]) - (sim_round - 1) * self.loop_steps  # this round's
            at = self.reports.setdefault(sim_round, {})
            # What this peer had run by this round: a fast peer (streaming, overlap) reports later
            # rounds before a slow one reports this, and its running count then went in this row.
            at[rank] = dict(info, trained=self.trained[rank])
            if len(at) < experiment.peers:
                return
            del self.reports[sim_round]
            step = max(int(i["step"]) for i in at.values())  # the schedule's (H steps a round)
            if sim_round % self.per_row and step < experiment.steps:
                return  # inside an outer round (streaming)
            outer = self.outer_round(sim_round)
            config = experiment.config
            row = dict(
                round=outer,
                step=max(i["trained"] for i in at.values()),  # what was run: time boxes cut rounds short
                tokens=sum(i["trained"] for i in at.values())
                * config.data.batch_size
                * config.model.block_size,
                bytes_per_peer=int(at[0]["bytes"]),
                loss=sum(i["loss"] for i in at.values()) / len(at),
                eval_loss=self.evals.pop(outer, None),
                seconds=time.monotonic() - self.started,
            )
            self.rows[outer] = row
        with experiment._lock:  # noqa: SLF001 - the experiment's own rows, this very dict
            experiment._rows.append(row)  # noqa: SLF001

    def evaluated(self, entry: dict[str, float]) -> None:
        outer = self.outer_round(int(entry["round"]))
        with self.lock:
            if outer == 0:
                row = dict(round=0, step=0, tokens=0, bytes_per_peer=0, loss=None,
                           eval_loss=entry["eval_loss"], seconds=0.0)  # fmt: skip
                self.rows[0] = row
            elif outer in self.rows:  # rank 0 evaluates after every peer reported: usually here
                with self.experiment._lock:  # noqa: SLF001
                    self.rows[outer]["eval_loss"] = entry["eval_loss"]
                return
            else:
                self.evals[outer] = entry["eval_loss"]
                return
        with self.experiment._lock:  # noqa: SLF001
            self.experiment._rows.append(row)  # noqa: SLF001

    def finish(self, result: Any) -> None:
        """The last row takes the run's end: the means a delayed or overlapped run still had in
        flight applied, and the final θ's eval loss."""
        with self.lock, self.experiment._lock:  # noqa: SLF001
            last = self.rows.get(max(self.rows, default=0))
            if last is not None and last["round"] > 0:
                last["bytes_per_peer"] = int(result.bytes_per_peer)
                last["eval_loss"] = result.final_eval_loss


def compare(experiments: list[Experiment], *, x: str = "tokens", ax=None):
    """Eval loss of several runs against tokens trained (``x="tokens"``) or bytes each peer sent
    (``x="bytes"``), on one matplotlib axis; returns the axis."""
    plt = _notebook_extra("matplotlib.pyplot", "compare()")

    if x not in ("tokens", "bytes"):
        raise ValueError("x must be 'tokens' or 'bytes'")
    if isinstance(experiments, Experiment):
        experiments = [experiments]
    experiments = list(experiments)  # a generator was read by the check below: nothing plotted (a review)
    if not experiments:
        raise ValueError("compare takes a list of experiments (got none)")
    strangers = [e for e in experiments if not isinstance(e, Experiment)]
    if strangers:  # an AttributeError on .history() said nothing of what to pass
        raise ValueError(f"compare takes Experiments, got {type(strangers[0]).__name__} {strangers[0]!r}")
    column = "tokens" if x == "tokens" else "bytes_per_peer"
    frames = []
    for experiment in experiments:
        frame = experiment.history().dropna(subset=["eval_loss"])
        if frame.empty:  # nothing to draw: say why rather than draw an empty line
            why = (
                "has not run (call .run() first)"
                if experiment._thread is None  # noqa: SLF001
                else f"ended with no evaluation ({experiment.error})"
                if experiment.error is not None
                else "has no evaluation yet (.wait() for it)"
                if experiment.running or experiment.history().empty
                # done, every eval NaN: it diverged (it said to .wait() for a run that had ended)
                else "diverged: every evaluation is NaN (try a lower outer or inner lr)"
            )
            raise ValueError(f"{experiment.name} {why}: nothing to compare")
        if x == "bytes":
            frame = frame[frame[column] > 0]
            if frame.empty:
                raise ValueError(
                    f"{experiment.name} sent no bytes (a single peer averages with nobody): compare it "
                    "with x='tokens'"
                )
        frames.append(frame)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for experiment, frame in zip(experiments, frames, strict=True):
        ax.plot(frame[column], frame["eval_loss"], marker="o", markersize=3, label=experiment.name)
    if x == "bytes":
        ax.set_xscale("log")
    ax.set_xlabel("tokens trained (all peers)" if x == "tokens" else "bytes sent per peer (log)")
    ax.set_ylabel("eval loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def _exits(process, *, within: float) -> bool:
    """Whether ``process`` has exited, or does within ``within`` seconds."""
    import subprocess

    try:
        process.wait(timeout=within)
    except subprocess.TimeoutExpired:
        return False
    return True
