"""What `workbench demo` shows without its TUI: a live per-peer table (`--no-tui`, `--json`),
or one line per peer event (`--headless`, or when the output is not a terminal)."""

from __future__ import annotations

import time
from typing import Any


class DemoTable:
    """A live per-peer table for `workbench demo --no-tui` in a terminal."""

    def __init__(self, *, peers: int, rounds: int, syncs_per_round: int = 1) -> None:
        self.rounds = rounds
        self.syncs = syncs_per_round  # streaming's events count fragment syncs: F per round
        self.rows: dict[str, dict[str, Any]] = {f"peer-{i}": {"stage": "starting"} for i in range(peers)}
        self.started = time.monotonic()

    def update(self, event: dict[str, Any]) -> None:
        row = self.rows.setdefault(event["peer"], {})
        kind = event["event"]
        if kind == "started":
            row.update(stage="joining", device=event["device"])
        elif kind == "state_downloaded":
            row.update(stage=f"synced @ {event['outer_step']}")
        elif kind == "initial_eval":
            row.update(stage="training", eval=event["eval_loss"])
        elif kind == "round":
            row.update(
                stage="training",
                round=event["outer_step"] // self.syncs,
                loss=event["loss"],
                eval=event["eval_loss"],
                group=event["group_size"],
                speed=event["samples_per_second"],
                sent=row.get("sent", 0) + event["bytes_sent"],
            )
        elif kind == "done":
            row.update(stage="done")

    def render(self):
        from rich.table import Table

        done = min((row.get("round", 0) for row in self.rows.values()), default=0)
        title = f"round {done}/{self.rounds}   {time.monotonic() - self.started:.0f} s"
        table = Table(title=title, title_justify="left", expand=False)
        for column in ("peer", "stage", "round", "loss", "eval loss", "group", "samples/s", "MB sent"):
            table.add_column(column, justify="left" if column in ("peer", "stage") else "right")
        for name, row in self.rows.items():
            table.add_row(
                name,
                row.get("stage", ""),
                str(row.get("round", "")),
                f"{row['loss']:.3f}" if "loss" in row else "",
                f"{row['eval']:.3f}" if "eval" in row else "",
                str(row.get("group", "")),
                f"{row['speed']:.0f}" if "speed" in row else "",
                f"{row.get('sent', 0) / 1e6:.1f}",
            )
        return table


def describe(event: dict[str, Any], syncs: int = 1) -> str | None:
    """One line for a peer event in `workbench demo --headless`'s log, or None to skip it
    (``syncs``: per round: streaming's events count fragment syncs, F per round)."""
    if event["event"] == "round":
        alone = f"  alone: {event['alone_reason']}" if event.get("alone_reason") else ""
        step = event["outer_step"]
        where = (
            f"{-(-step // syncs):>3} (sync {(step - 1) % syncs + 1}/{syncs})" if syncs > 1 else f"{step:>3}"
        )
        return (
            f"{event['peer']:>8}  round {where}  loss {event['loss']:.3f}  "
            f"eval {event['eval_loss']:.3f}  group {event['group_size']}  "
            f"{event['samples_per_second']:.0f} samples/s{alone}"
        )
    if event["event"] == "started":
        return f"{event['peer']:>8}  started on {event['device']} ({event['params']:,} params)"
    if event["event"] == "state_downloaded":
        return f"{event['peer']:>8}  downloaded the global state at outer step {event['outer_step']}"
    if event["event"] == "initial_eval":
        return f"{event['peer']:>8}  initial eval loss {event['eval_loss']:.3f}"
    if event["event"] == "done":
        return f"{event['peer']:>8}  done: eval loss {event['initial_eval_loss']:.3f} -> {event['final_eval_loss']:.3f}"
    return None
