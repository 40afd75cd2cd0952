"""Peer checkpoints: everything a stopped peer needs to continue where it was.

One file, ``<dir>/checkpoint.pt``, holding the model, the inner optimizer, the outer state
(global θ, outer momentum, outer step, queued delayed updates), the error-feedback residuals,
the data position and the run's identity (run id, model fingerprint). Writes are atomic: a
temp file, fsync, the current checkpoint renamed to ``checkpoint.prev.pt``, the temp file
renamed into place, the folder fsynced. A crash at any point leaves a good checkpoint.

Loading checks the file and falls back to ``checkpoint.prev.pt`` (with a warning) when the
newest one is truncated or corrupt; if neither loads, the error names both problems.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from swarm.errors import SwarmError

logger = logging.getLogger(__name__)

FORMAT = "workbench-checkpoint/1"
NAME, PREVIOUS = "checkpoint.pt", "checkpoint.prev.pt"


class CheckpointError(SwarmError):
    """No usable checkpoint (missing, truncated, corrupt, or for another run/model)."""


def save(directory: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` atomically as ``directory/checkpoint.pt``; keeps the previous one."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path, temporary = directory / NAME, directory / f"{NAME}.tmp"
    with open(temporary, "wb") as handle:
        torch.save({"format": FORMAT, "saved": time.time(), **payload}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    if path.exists():
        os.replace(path, directory / PREVIOUS)
    os.replace(temporary, path)
    folder = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(folder)  # the renames themselves survive a power cut
    finally:
        os.close(folder)
    return path


def _read(path: Path) -> dict[str, Any]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except Exception as error:  # truncated zip, garbage bytes, unpickling errors, ...
        raise CheckpointError(f"{path} is truncated or corrupt ({type(error).__name__}: {error})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a workbench checkpoint ({FORMAT})")
    return payload


def load(directory: str | Path) -> tuple[dict[str, Any], Path]:
    """The newest good checkpoint in ``directory`` and its path; raises CheckpointError."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(
            f"--resume {directory}: no such folder (give the --run-dir of the stopped peer)"
        )
    try:
        return _read(directory / NAME), directory / NAME
    except CheckpointError as newest:
        if not (directory / PREVIOUS).exists():
            raise CheckpointError(f"cannot resume: {newest}") from None
        try:
            payload = _read(directory / PREVIOUS)
        except CheckpointError as previous:
            raise CheckpointError(f"cannot resume: {newest}; and {previous}") from None
        logger.warning("%s; resuming from the previous checkpoint %s", newest, directory / PREVIOUS)
        return payload, directory / PREVIOUS


# --- a peer's training state, in and out of a checkpoint -----------------------------------------


def training_state(rounds: Any, model: Any, inner_optimizer: Any, batches: Any) -> dict[str, Any]:
    """What a checkpoint holds of a peer's training: the outer state (``rounds``: DiLoCo or
    streaming rounds), the model, AdamW, the error-feedback residuals and the data position."""
    import dataclasses

    feedback = getattr(rounds, "feedback", None)
    if isinstance(feedback, list):  # streaming: one residual memory per fragment
        residuals = [f.residuals if f is not None else None for f in feedback]
    else:
        residuals = feedback.residuals if feedback is not None else None
    return {
        "outer": dataclasses.asdict(rounds.outer_state()),
        "model": model.state_dict(),
        "inner_optimizer": inner_optimizer.state_dict(),
        "feedback": residuals,
        "data": batches.state_dict() if batches is not None else None,
    }


def restore_training(
    payload: dict[str, Any], rounds: Any, model: Any, inner_optimizer: Any, batches: Any
) -> None:
    """The inverse of :func:`training_state`."""
    from optim.diloco import OuterState

    model.load_state_dict(payload["model"])
    inner_optimizer.load_state_dict(payload["inner_optimizer"])
    rounds.load_outer_state(OuterState(**payload["outer"]))
    inner_optimizer.load_state_dict(payload["inner_optimizer"])  # load_outer_state may reset it
    feedback = getattr(rounds, "feedback", None)
    if isinstance(feedback, list):
        for memory, residuals in zip(feedback, payload.get("feedback") or []):
            if memory is not None:
                memory.residuals = residuals
    elif feedback is not None:
        feedback.residuals = payload.get("feedback")
    if payload.get("data") is not None and batches is not None:
        batches.load_state_dict(payload["data"])


def load_for(directory: str | Path, *, run_id: str, fingerprint: str) -> tuple[dict[str, Any], Path]:
    """:func:`load`, refusing a checkpoint of another run or model (``--resume``)."""
    payload, path = load(directory)
    if payload.get("run_id") != run_id:
        raise CheckpointError(
            f"{path} belongs to run '{payload.get('run_id')}', not '{run_id}': pass --run-id {payload.get('run_id')}"
        )
    if payload.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"{path} was written for model fingerprint {payload.get('fingerprint')}, this peer's is "
            f"{fingerprint}: resume with the flags the peer ran with"
        )
    return payload, path
