"""Metrics out to TensorBoard and Weights & Biases, from a peer's events.

A peer's events (``metrics.jsonl``: ``round``, ``initial_eval``, ``done``, ...) are the source
of truth; an exporter turns each into scalars at the run's clock (the outer step). Both work
live (``workbench start --tensorboard DIR --wandb PROJECT``) and after the fact (``workbench
export RUN_DIR --tensorboard DIR``), from the same code.

- TensorBoard: ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package,
  the ``[tensorboard]`` extra), one sub-folder per peer.
- W&B: ``wandb`` (the ``[wandb]`` extra), offline by default: runs are written under the
  given folder and uploaded later with ``wandb sync``; ``--wandb-mode online`` logs live.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Protocol

from workbench.names import WANDB_MODES

logger = logging.getLogger(__name__)

# event -> the fields exported as scalars (under "<event>/<field>"; round fields at the top level)
SCALARS: dict[str, tuple[str, ...]] = {
    "round": (
        "loss",
        "eval_loss",
        "group_size",
        "bytes_sent",
        "bytes_received",
        "round_seconds",
        "averaging_seconds",
        "compute_seconds",
        "samples_per_second",
        "local_update_norm",
        "mean_update_norm",
    ),
    "initial_eval": ("eval_loss",),
    "done": ("final_eval_loss", "bytes_sent", "bytes_received"),
}


class ExporterError(ValueError):
    """An exporter cannot start (package missing, folder unwritable); says how to fix it."""


class Exporter(Protocol):
    def write(self, event: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(event: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
    """(step, {tag: value}) of the event's exported fields, or None when it has none."""
    fields = SCALARS.get(str(event.get("event")))
    if not fields:
        return None
    prefix = "" if event["event"] == "round" else f"{event['event']}/"
    values = {
        f"{prefix}{name}": float(event[name])
        for name in fields
        if isinstance(event.get(name), (int, float))
        and not isinstance(event.get(name), bool)
        and math.isfinite(float(event[name]))
        # a round that did not evaluate (--eval-every) carries the last evaluation: not plotted again
        and not (name == "eval_loss" and event.get("evaluated") is False)
    }
    step = event.get("outer_step", event.get("syncs", 0))
    return (int(step) if isinstance(step, (int, float)) else 0), values


class TensorBoardExporter:
    """Scalars into a TensorBoard event file under ``directory``."""

    def __init__(self, directory: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ExporterError(
                "--tensorboard needs the tensorboard package: pip install 'swarm-workbench[tensorboard]'"
            ) from None
        try:
            self.writer = SummaryWriter(log_dir=str(directory))
        except OSError as error:
            raise ExporterError(f"cannot write TensorBoard logs to {directory}: {error}") from None
        self.directory = Path(directory)

    def write(self, event: dict[str, Any]) -> None:
        found = scalars(event)
        if found:
            step, values = found
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, global_step=step, walltime=event.get("time"))

    def close(self) -> None:
        self.writer.close()


class WandbExporter:
    """Scalars into a W&B run (offline by default: no account, no network), written by wandb
    under ``<directory>/wandb/``."""

    def __init__(
        self,
        project: str,
        *,
        directory: str | Path,
        name: str,
        mode: str = "offline",
        config: dict | None = None,
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise ExporterError(
                "--wandb needs the wandb package: pip install 'swarm-workbench[wandb]'"
            ) from None
        if mode not in WANDB_MODES:
            raise ExporterError(f"unknown W&B mode {mode!r}: choose {', '.join(WANDB_MODES)}")
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ExporterError(f"cannot write W&B's runs under {directory}: {error}") from None
        if not os.access(directory, os.W_OK):  # wandb would write them to the temp folder, unsaid
            raise ExporterError(f"cannot write W&B's runs under {directory}: it is read-only")
        try:
            self.run = wandb.init(
                project=project,
                name=name,
                dir=str(directory),
                mode=mode,
                config=config or {},
                reinit="create_new",
                settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
            )
        except Exception as error:  # noqa: BLE001 - wandb's own errors (no API key, no network...)
            # (A traceback before, out of `start` and `export --wandb-mode online` with no API
            # key: a review, stop 72.)
            hint = (
                "run `wandb login`, or use --wandb-mode offline"
                if mode == "online"
                else "see wandb's message"
            )
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ExporterError(f"cannot start W&B ({reason}): {hint}") from None
        self._last_step = -1

    def write(self, event: dict[str, Any]) -> None:
        found = scalars(event)
        if found:
            step, values = found
            step = max(step, self._last_step)  # W&B refuses steps that go back
            self._last_step = step
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def make_exporters(
    *,
    tensorboard: str | None,
    wandb_project: str | None,
    wandb_mode: str,
    wandb_dir: str | Path,
    name: str,
    config: dict | None = None,
) -> list[Exporter]:
    exporters: list[Exporter] = []
    try:
        if tensorboard:
            exporters.append(TensorBoardExporter(tensorboard))
        if wandb_project:
            exporters.append(
                WandbExporter(wandb_project, directory=wandb_dir, name=name, mode=wandb_mode, config=config)
            )
    except ExporterError:
        for exporter in exporters:  # (TensorBoard's writer was left open)
            exporter.close()
        raise
    return exporters


def peer_exporters(config: Any, run_dir: Path | None, name: str, peer_id: str) -> list[Exporter]:
    """The exporters a peer's flags ask for (``--tensorboard``, ``--wandb-project``), fed every
    event as metrics.jsonl is; none by default."""
    import dataclasses

    peer = config.peer
    if peer.tensorboard is None and not peer.wandb_project:
        return []
    return make_exporters(
        tensorboard=str(run_dir / "tensorboard") if peer.tensorboard == "" and run_dir else peer.tensorboard,
        wandb_project=peer.wandb_project,
        wandb_mode=peer.wandb_mode,
        wandb_dir=run_dir or Path("."),
        name=name,
        config=dict(method=config.method, outer=dataclasses.asdict(config.diloco), peer_id=peer_id),
    )
