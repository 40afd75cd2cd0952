"""The direct plane's ring in the peer's process (swarm.ring_driver), with real GroupAverager
processes: two peers, each making one averager after another in the same process, as
benchmarks.allreduce and a notebook do. The second averager's process is forked from a process
that holds the first's gloo ring (whose threads are not forked); it must neither die nor
disturb the rounds (it aborted with std::system_error when it garbage-collected that ring)."""

from __future__ import annotations

import socket

from benchmarks import allreduce

SIZE_MB = 0.05
PHASES = [
    "wake",
    "start",
    "scale",
    "arrival",
    "connect, send, own sketch",
    "seal",
    "ring, result sketch",
    "sketch exchange",
    "check",
    "copy out, unlock",
    "result",
]


def test_averagers_made_one_after_another_in_a_process_keep_averaging():
    configs = [(SIZE_MB, "none", "direct"), (SIZE_MB, "fp16", "direct"), (SIZE_MB, "none", "direct")]
    with socket.socket() as probe:  # a free port for gloo's baseline group
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = allreduce._run(allreduce._averager_worker, 2, port, configs, {SIZE_MB: 2}, True)
    for member in results:
        for config in configs:
            times, baseline, timelines = member[config]
            assert len(times) == len(baseline) == 2, (config, member[config])  # every attempt averaged
            # --phases: each attempt's time, phase by phase, in the order they ran on a kept ring
            for seconds, timeline in zip(times, timelines):
                names = [name for name, _ in timeline]
                assert names == PHASES, names
                assert all(spent >= 0 for _, spent in timeline)
                assert abs(sum(spent for _, spent in timeline) - seconds) < 1e-6
