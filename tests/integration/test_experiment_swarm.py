"""`Experiment(backend="swarm")`: one real peer of a run on the network, started from Python
with `workbench start`'s settings, that a peer from the command line joins."""

from __future__ import annotations

import json
import time

import psutil
import pytest

from swarm.errors import SwarmError
from tests.integration.conftest import FAST
from workbench import Experiment

pytestmark = pytest.mark.integration

NOTEBOOK_FAST = dict(model="tiny", inner_steps=5, batch_size=8, threads=1, matchmaking_time=1.0)


def _started(experiment: Experiment, timeout: float = 120) -> dict:
    """The notebook peer's "started" event (its addresses), from its metrics."""
    metrics = experiment.run_dir / "peer" / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert experiment.running, experiment.error
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                if line.endswith("}") and (event := json.loads(line))["event"] == "started":
                    return event
        time.sleep(0.2)
    pytest.fail(f"the notebook's peer did not start within {timeout} s")


def test_a_notebook_peer_starts_a_private_run_that_a_cli_peer_joins(spawn, tmp_path):
    """The run id, the secret and --min-peers reach the notebook's peer (before, only the demo's
    settings were taken: a swarm peer could not name its run); the secret by the environment,
    never on a command line; a CLI peer with the secret joins, and both average every round."""
    secret = "a notebook's secret"
    owner = Experiment(
        backend="swarm",
        run_id="nb-private",
        secret=secret,
        min_peers=2,
        rounds=3,
        run_dir=tmp_path / "nb",
        **NOTEBOOK_FAST,
    ).run()
    try:
        address = _started(owner)["addresses"][0]
        notebook_peer = next(
            p for p in psutil.process_iter(["cmdline"]) if "nb-private" in " ".join(p.info["cmdline"] or [])
        )
        assert secret not in " ".join(notebook_peer.info["cmdline"])
        joiner = spawn(
            "b", "join", address, *FAST, "--run-id", "nb-private", "--secret", secret, "--rounds", "3"
        )
        owner.wait(timeout=180)
        assert joiner.wait() == 0, joiner.stderr()[-3000:]
    finally:
        owner.stop()
    history = owner.history()
    assert history["round"].tolist() == [0, 1, 2, 3] and history["step"].tolist() == [0, 5, 10, 15], history
    assert secret not in (tmp_path / "nb" / "commands.txt").read_text()
    rounds = [r for r in joiner.events("round")]
    assert [(r["outer_step"], r["group_size"]) for r in rounds] == [(1, 2), (2, 2), (3, 2)], rounds
    assert "hivemind's encrypted path" in joiner.stderr()  # a private run's rounds


def test_a_short_swarm_run_that_ends_before_its_view_connects_is_reported_whole(tmp_path):
    """A run of a few rounds alone can end before the live view reaches its peer: it was
    reported failed ("could not reach any bootstrap peer"), its history empty, although the peer
    had finished every round. Its rows come from the peer's events, timed from its start."""
    run = Experiment(backend="swarm", run_id="nb-short", rounds=2, run_dir=tmp_path / "nb", **NOTEBOOK_FAST)
    run.run().wait(timeout=180)
    assert run.error is None, run.error
    history = run.history()
    assert history["round"].tolist() == [0, 1, 2], history
    seconds = history["seconds"].tolist()
    assert seconds == sorted(seconds) and seconds[-1] > 0.1, seconds  # from the peer's start
    # Its view: the last reading if it connected; if not, said at once (it waited 120 s for a
    # view that could no longer come, then raised TimeoutError).
    asked = time.monotonic()
    try:
        run.widget()
    except SwarmError as error:
        assert "ended before its live view connected" in str(error), error
    assert time.monotonic() - asked < 60
