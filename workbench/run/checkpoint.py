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
