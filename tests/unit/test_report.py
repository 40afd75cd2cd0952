"""benchmarks.report: docs/performance.md's generated tables, and the notes kept below them."""

from __future__ import annotations

import json

from benchmarks import report


def test_every_results_file_has_its_section_and_the_notes_survive(tmp_path, monkeypatch) -> None:
    doc = tmp_path / "performance.md"
    doc.write_text("old tables\n<!-- notes -->\n\n## What the figures say\nkept by hand\n")
    monkeypatch.setattr(report, "DOC", doc)
    report.main()
    text = doc.read_text()
    assert text.endswith("\n## What the figures say\nkept by hand\n") and "old tables" not in text
    for path in sorted(report.RESULTS.glob("*.json")):
        if path.stem in ("allreduce", "trust", "utilization", "heterogeneity", "train_step"):
            assert f"`benchmarks/{path.stem}.py`" in text, path.stem


def test_a_gpu_check_s_figures_get_their_own_table_beside_the_cpu_s(tmp_path, monkeypatch) -> None:
    row = dict(preset="medium", params=10_844_160, device="cuda", batch_size=32, tokens_per_second=725_414.0,
               outer_step_seconds=0.0385, outer_step_vs_inner_step=3.4, round_share_off_device_h50=0.0637)  # fmt: skip
    cuda = dict(torch="2.11.0+cu130", threads=16, cuda="NVIDIA H200", date="2026-12-04", results=[row])
    cpu = dict(cuda, torch="2.13.0+cpu", threads=2, cuda=None, results=[dict(row, device="cpu")])
    (tmp_path / "train_step_cuda.json").write_text(json.dumps(cuda))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    lines = report.train_step()
    assert "torch 2.11.0+cu130, 16 threads, CUDA: NVIDIA H200 (bf16 autocast; 2026-12-04)." in lines
    assert "| medium | 10.84 M | cuda | 32 | 725414 | 38.5 ms | 3.400 | 6.37% |" in lines
    (tmp_path / "train_step.json").write_text(json.dumps(cpu))
    lines = report.train_step()
    assert lines.index("torch 2.13.0+cpu, 2 threads, CUDA: none.") < lines.index(
        "torch 2.11.0+cu130, 16 threads, CUDA: NVIDIA H200 (bf16 autocast; 2026-12-04)."
    )


def test_heterogeneity_rows_say_how_far_each_mode_got(tmp_path, monkeypatch) -> None:
    rows = [
        dict(mode="fixed", seconds=100.0, rounds=4, final_eval_loss=2.5, fast_peer_utilization=0.5,
             steps_per_round={"p0": [20] * 4, "p1": [20] * 4}),
        dict(mode="timeboxed", round_seconds=8.0, seconds_to_fixed_final_loss=60.0, seconds=100.0, rounds=6,
             final_eval_loss=2.3, fast_peer_utilization=0.8,
             steps_per_round={"p0": [19, 21, 20, 20, 20, 20], "p1": [10, 11, 10, 10, 10, 12]}),
    ]  # fmt: skip
    data = dict(
        date="d", machine="m", peers=2, slow_peers=1, model="tiny", inner_steps=20, step_ms=10.0, rows=rows
    )
    (tmp_path / "heterogeneity.json").write_text(json.dumps(data))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    lines = report.heterogeneity()
    assert "| fixed | 100.0 | 4 | 20 / 20 | 2.5000 | 0.50 | — |" in lines
    assert "| timeboxed (8.00 s) | 100.0 | 6 | 19-21 / 10-12 | 2.3000 | 0.80 | at 60.0 s (0.60x) |" in lines
    # One slow peer of four: the fast ones are the first three, not the first half (a review, stop 72)
    steps = {"p0": [40] * 2, "p1": [40] * 2, "p2": [40, 39], "p3": [21, 22]}
    data.update(peers=4, rows=[rows[0], dict(rows[1], steps_per_round=steps)])
    (tmp_path / "heterogeneity.json").write_text(json.dumps(data))
    assert (
        "| timeboxed (8.00 s) | 100.0 | 6 | 39-40 / 21-22 | 2.3000 | 0.80 | at 60.0 s (0.60x) |"
        in report.heterogeneity()
    )


def test_allreduce_rows_show_the_middle_half_of_the_attempts_ratios(tmp_path, monkeypatch) -> None:
    from benchmarks.allreduce import _middle_half

    ratios = [0.38, 0.44, 0.46, 0.52, 0.61]  # a row whose median misses 0.5x while a quarter meets it
    assert _middle_half(ratios) == [0.44, 0.52] and _middle_half([0.7]) == [0.7, 0.7]
    rows = [
        dict(peers=4, mb=10.0, path="gloo", codec="none", seconds=0.018, bus_mb_s=833.0, ratio=1.0),
        dict(peers=4, mb=10.0, path="direct", codec="none", seconds=0.036, bus_mb_s=417.0, ratio=0.46,
             ratio_middle_half=_middle_half(ratios), baseline_seconds=0.017),
        dict(peers=4, mb=10.0, path="direct", codec="fp16", seconds=0.041, bus_mb_s=366.0, ratio=0.52,
             baseline_seconds=0.021),  # a file from before the spread was recorded
    ]  # fmt: skip
    (tmp_path / "allreduce.json").write_text(json.dumps(dict(rows=rows)))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    lines = report.allreduce()
    assert "| 4 | 10 | direct | none | 36.0 | 17.0 | 417 | 0.46x (0.44-0.52) | missed by 0.04 |" in lines
    assert "| 4 | 10 | direct | fp16 | 41.0 | 21.0 | 366 | 0.52x | met |" in lines


def test_join_rows_show_the_floor_of_a_download_on_this_machine(tmp_path, monkeypatch) -> None:
    run = dict(
        params=25e6, state_mb=400.0, join_seconds=1.9, connect_seconds=1.1, download_seconds=0.8,
        download_mb_s=500.0, tcp_baseline_seconds=0.12, ratio_to_tcp=0.15, tcp_fresh_seconds=0.3,
        second_download_seconds=0.45, second_ratio_to_tcp=0.27, donors=3, transport="direct",
    )  # fmt: skip
    older = dict(run, donors=1)  # a file from before the state's copy was measured
    floor = dict(run, tcp_state_seconds=0.44, ratio_to_state_copy=0.55)
    heartbeats = dict(
        step_seconds_on=0.1, step_seconds_off=0.1, ratio_on_off=1.0, heartbeat_share_of_step=0.001
    )
    cli = dict(help_seconds=0.2, python_seconds=0.02, ratio_to_python=10.0)
    data = dict(heartbeats=heartbeats, join=dict(floor, runs=[older, floor]), cli=cli)
    (tmp_path / "overheads.json").write_text(json.dumps(data))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    older_row, floor_row = [line for line in report.overheads() if line.startswith("| joining")]
    assert "another process" not in older_row and "the state's copy" not in older_row
    assert "a state from another process into fresh memory 0.44 s" in floor_row
    assert "0.15x (second: 0.27x); 0.55x the state's copy | < 2 s and >= 0.25x: missed |" in floor_row
