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
