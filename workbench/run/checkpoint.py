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

import contextlib
import fcntl
import logging
import os
import pickle
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import torch

from swarm.dataplane import one_line
from swarm.errors import SwarmError, folder_problem
from workbench.run.stopping import not_interrupted

logger = logging.getLogger(__name__)

FORMAT = "workbench-checkpoint/1"
NAME, PREVIOUS = "checkpoint.pt", "checkpoint.prev.pt"
UNFINISHED = NAME + ".tmp"
"""A save's file before it is put in place: complete once it is fsynced, before the renames."""


class CheckpointError(SwarmError):
    """No usable checkpoint (missing, truncated, corrupt, or for another run/model)."""


class GlobalParamsError(CheckpointError):
    """The swarm's model could not be written (``global_params.pt``: a full disk)."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint of another run, owner or model: not passed over for the previous one (the
    folder is another peer's, or the flags are not the ones its peer was started with)."""


class CheckpointUnreadable(CheckpointError):
    """A checkpoint this process may not read (permissions): not corrupt, so not passed over
    for the previous one (which a later save would then replace)."""


REQUIRED = ("model", "inner_optimizer", "outer")
"""What every checkpoint holds (:func:`training_state`)."""

_passed_over: set[str] = set()
"""Newest checkpoints found corrupt and passed over for the previous one (their resolved paths):
the next save in that folder replaces them instead of moving them over the good previous one."""


def make_folder(directory: str | Path, flag: str = "--run-dir") -> Path:
    """``directory``, made with its parents; CheckpointError naming ``flag`` and the fix if it
    cannot be (a part of the path that is a file said only ``[Errno 20] Not a directory``)."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointError(
            f"cannot make {flag} {directory} ({folder_problem(error, directory)}): give a folder this user "
            "can create and write to"
        ) from None
    return directory


def run_dir_holder(directory: Path) -> str | None:
    """The pid of the live peer that holds ``directory`` (:func:`hold_run_dir`), or None: asked
    without taking it (a peer's lock is its process's, released when it dies)."""
    try:
        handle = open(directory / ".lock", "a+")  # noqa: SIM115 - closed below
    except OSError:
        return None  # no folder, or unwritable: nobody holds it here
    with handle:
        holder = _lock(handle)
        if holder is None:
            fcntl.lockf(handle, fcntl.LOCK_UN)
        return holder


def _lock(handle: IO[str]) -> str | None:
    """Take the lock of an open ``.lock`` file: None, or the pid written by the live peer that
    holds it ("?" if it wrote none yet)."""
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        return handle.read().strip() or "?"
    return None


def hold_run_dir(directory: Path) -> IO[str]:
    """Lock ``directory`` for this peer (``<dir>/.lock``, its pid inside) until the process ends;
    CheckpointError if another live peer holds it. Two peers in one folder would share its
    identity key (one peer id for both) and overwrite each other's checkpoints and metrics.

    A POSIX record lock: held by this process only (hivemind's forked children do not inherit
    it) and released by the kernel when the process dies, even by SIGKILL."""
    try:
        handle = open(directory / ".lock", "a+")  # noqa: SIM115 - held open for the life of the peer
    except OSError as error:  # a read-only folder, another user's: the bare errno said no fix
        raise CheckpointError(
            f"cannot write in --run-dir {directory} ({error.strerror or error}): give a folder this user "
            "can write to, or fix its permissions"
        ) from None
    holder = _lock(handle)
    if holder is not None:
        handle.close()
        raise CheckpointError(
            f"--run-dir {directory} is in use by another running peer (pid {holder}): give each peer "
            "its own --run-dir"
        ) from None
    try:
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
    except OSError as error:  # a full disk: the bare errno was a traceback
        with contextlib.suppress(OSError):  # closing flushes the pid again: the same full disk
            handle.close()
        raise CheckpointError(
            f"cannot write in --run-dir {directory} ({error.strerror or error}; is the disk full?): "
            "free some space or give another --run-dir"
        ) from None
    return handle


def save(directory: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` atomically as ``directory/checkpoint.pt``; keeps the previous one."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path, temporary = directory / NAME, directory / UNFINISHED
    # Ctrl+C or SIGTERM during a write takes effect after it: interrupted inside torch.save they
    # left a half-written temp file and two tracebacks (the checkpoint itself was safe).
    with not_interrupted():
        try:
            with open(temporary, "wb") as handle:
                torch.save({"format": FORMAT, "saved": time.time(), **payload}, handle)
                handle.flush()
                os.fsync(handle.fileno())
        except (OSError, RuntimeError) as error:  # torch says a full disk as "unexpected pos"
            temporary.unlink(missing_ok=True)  # no half file left beside the good ones
            raise CheckpointError(
                f"could not write a checkpoint in {directory} ({one_line(error)}; is the disk full?): "
                "the earlier checkpoints are kept; free some space or give another --run-dir"
            ) from None
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        try:
            _put_in_place(temporary, path)
        except OSError as error:  # raised out of the round loop, it stopped the peer (a review)
            temporary.unlink(missing_ok=True)
            raise CheckpointError(
                f"could not put the checkpoint in place in {directory} ({one_line(error)}): the "
                "earlier checkpoints are kept; free some space or give another --run-dir"
            ) from None
        _sync_folder(directory)
    return path


def _put_in_place(temporary: Path, path: Path) -> None:
    """A save's renames: ``path`` becomes ``checkpoint.prev.pt`` (not one passed over as bad:
    the previous one stays), then ``temporary`` becomes ``path``; OSError as it fails."""
    if path.exists() and str(path.resolve()) not in _passed_over:
        os.replace(path, path.with_name(PREVIOUS))
    os.replace(temporary, path)  # (a corrupt newest one is replaced: the previous one stays)
    _passed_over.discard(str(path.resolve()))


def _sync_folder(directory: Path) -> None:
    """Make the renames in ``directory`` survive a power cut. Some file systems (FUSE, network
    ones) refuse to sync a folder: the checkpoint is written all the same, so that is said at
    debug level, not raised (it stopped a peer at its first checkpoint there, a review)."""
    try:
        folder = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    except OSError as error:
        logger.debug("could not sync the folder %s after writing a checkpoint: %s", directory, error)


def _read(path: Path, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The checkpoint at ``path``, checked: every stored record against its CRC-32 (torch.load
    reads flipped bytes without a word: a resumed peer then hit NaN and was told to lower its
    learning rate), the ``required`` keys (a peer's: :data:`REQUIRED`), and finite weights and
    global state."""
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
        if damaged is not None:
            raise CheckpointError(f"{path} is corrupt ({damaged} does not match its checksum)")
        # Tensors, numbers, strings and containers only: a checkpoint is a file a user may be
        # given ("resume from this one"), and unpickling anything else runs the code it names.
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # (torch's own message advises loading it unsafely: not shown)
        raise CheckpointError(
            f"{path} holds more than a checkpoint's tensors and numbers (objects whose unpickling runs "
            "code), which a checkpoint never does: refused unread; resume only from checkpoints your own "
            "peers wrote"
        ) from None
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except PermissionError:
        raise CheckpointUnreadable(
            f"cannot read {path}: permission denied (let this user read it: chmod u+r {path})"
        ) from None
    except CheckpointError:
        raise
    except Exception as error:  # truncated zip, garbage bytes, unpickling errors, ...
        raise CheckpointError(f"{path} is truncated or corrupt ({one_line(error)})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a workbench checkpoint ({FORMAT})")
    missing = [key for key in required if key not in payload]
    if missing:
        raise CheckpointError(f"{path} is incomplete (no {', '.join(missing)})")
    outer = payload.get("outer") if isinstance(payload.get("outer"), dict) else {}
    inner = payload.get("inner_optimizer")
    # θ, its momentum and every other state of training are never infinite; a model's state may
    # hold -inf (an attention mask kept as a buffer), so NaN and +inf refuse it (a parameter at
    # -inf is refused once the state is put in the model: :func:`check_parameters`). A streaming
    # peer's +inf weights were resumed, and its first step told it to lower its --inner-lr (a
    # review, stop 71). Before stop 69 the
    # inner optimizer's moments, the error feedback and the eager/streaming state were not
    # checked: NaN moments resumed, and the peer's first step was told to lower its --inner-lr
    # (a review), never falling back to the good previous checkpoint.
    weights = {
        "the model": (payload.get("model"), _nan_or_positive_inf),
        "the global params": (outer.get("params"), _not_finite),
        "the outer momentum": (outer.get("momentum"), _not_finite),
        "the outer state": (outer, _not_finite),
        "the inner optimizer's state": (inner.get("state") if isinstance(inner, dict) else None, _not_finite),
        "the error feedback": ([payload.get("feedback"), payload.get("take_back")], _not_finite),
        "the peer's own round state": (payload.get("local"), _not_finite),
    }
    for what, (held, bad) in weights.items():
        if any(bool(bad(t).any()) for t in _tensors(held) if t.is_floating_point()):
            raise CheckpointError(f"{path} holds NaN/Inf in {what}")
    return payload


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value`` (nested dicts, lists and tuples; walked without recursion: a
    checkpoint may be a file somebody gave)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if torch.is_tensor(item):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def _not_finite(tensor: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(tensor)


def _nan_or_positive_inf(tensor: torch.Tensor) -> torch.Tensor:
    return torch.isnan(tensor) | torch.isposinf(tensor)


def check_parameters(model: Any, path: Path) -> None:
    """CheckpointError if a parameter of ``model``, just given a checkpoint's state, is not
    finite (a buffer may hold -inf: an attention mask)."""
    for name, parameter in model.named_parameters():
        if not bool(torch.isfinite(parameter.detach()).all()):
            raise CheckpointError(f"{path} holds NaN/Inf in the model's {name}")


def check_present(directory: str | Path) -> None:
    """CheckpointError unless ``directory`` holds a checkpoint file: checked before a peer starts,
    so a ``--resume`` that cannot happen creates no run folder, key or metrics (the files are read
    later, after hivemind's processes are forked, so that they do not share their pages)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(
            f"--resume {directory}: no such folder (give the --run-dir of the stopped peer)"
        )
    if not any((directory / name).exists() for name in (NAME, PREVIOUS, UNFINISHED)):
        raise CheckpointError(
            f"cannot resume: {directory / NAME} does not exist (a peer writes one with "
            "--checkpoint-every N, or when the run owner asks with `workbench steer --checkpoint`)"
        )


Use = Callable[[dict[str, Any], Path], None]


def load(
    directory: str | Path, *, required: tuple[str, ...] = (), use: Use | None = None
) -> tuple[dict[str, Any], Path]:
    """The newest good checkpoint in ``directory`` (holding the ``required`` keys) and its path;
    raises CheckpointError. ``use``: puts a checkpoint's state to use (a peer's training state);
    a checkpoint it fails on (its structure is not this release's, or it was edited) is passed
    over for the previous one, as a corrupt one is."""
    directory = Path(directory)
    check_present(directory)
    finished = _finish_save(directory, required, use)
    if finished is not None:
        return finished
    try:
        return _usable(directory / NAME, required, use), directory / NAME
    except CheckpointMismatch:
        raise
    except CheckpointUnreadable as newest:
        raise CheckpointError(f"cannot resume: {newest}") from None
    except CheckpointError as newest:
        if not (directory / PREVIOUS).exists():
            raise CheckpointError(f"cannot resume: {newest}") from None
        try:
            payload = _usable(directory / PREVIOUS, required, use)
        except CheckpointError as previous:
            raise CheckpointError(
                f"cannot resume: {newest}; and {previous}: nothing to resume from; start without "
                "--resume (and with another --run-dir): a joiner downloads the run's state"
            ) from None
        logger.warning("%s; resuming from the previous checkpoint %s", newest, directory / PREVIOUS)
        if (directory / NAME).exists():
            _passed_over.add(str((directory / NAME).resolve()))
        return payload, directory / PREVIOUS


def _finish_save(
    directory: Path, required: tuple[str, ...], use: Use | None
) -> tuple[dict[str, Any], Path] | None:
    """The checkpoint of a save stopped between its write and its renames (a SIGKILL, a power
    cut), put in place as the save would have and returned; None if there is none, or it is
    incomplete (stopped as it wrote: the older ones are used). Before, a resume took
    ``checkpoint.prev.pt``, one checkpoint older, beside a complete newer one (a review, stop 71)."""
    unfinished = directory / UNFINISHED
    if not unfinished.exists():
        return None
    try:
        payload = _usable(unfinished, required, use)
    except (CheckpointMismatch, CheckpointUnreadable):
        raise
    except CheckpointError as why:
        logger.info(
            "%s: a save stopped as it wrote (%s); resuming from the checkpoints before it", unfinished, why
        )
        return None
    path = directory / NAME
    try:
        _put_in_place(unfinished, path)  # as the save would have
        _sync_folder(directory)
    except OSError as error:  # (its state is in the peer already: resumed from where it is)
        logger.warning(
            "resuming from %s, the newest checkpoint (cannot put it in place: %s)",
            unfinished,
            one_line(error),
        )
        return payload, unfinished
    logger.warning(
        "resuming from %s: the newest checkpoint, whose save was stopped before it was put in place", path
    )
    return payload, path


def _usable(path: Path, required: tuple[str, ...], use: Use | None) -> dict[str, Any]:
    """:func:`_read`, then put to ``use``: its failures are this checkpoint's."""
    payload = _read(path, required)
    if use is None:
        return payload
    try:
        use(payload, path)
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - a file's content, whatever it fails with
        # (an OuterState of another release's fields, a state dict missing keys, a step "x")
        # The whole message on one line (a state dict's says what is missing on its second).
        said = " ".join(f"{type(error).__name__}: {error}".split())
        raise CheckpointError(
            f"{path} does not fit this peer's training state ({said[:400]}): written by "
            "another release, or edited"
        ) from None
    return payload


def check_no_checkpoint(directory: str | Path, resume: str | Path | None) -> None:
    """CheckpointError if ``directory`` (a ``--run-dir``) holds a checkpoint this start would
    replace: without ``--resume`` of that folder, its checkpoints were silently overwritten by
    the new run's first saves."""
    directory = Path(directory)
    if resume is not None and directory.resolve() == Path(resume).resolve():
        return
    held = [directory / name for name in (NAME, PREVIOUS) if (directory / name).exists()]
    if held:
        raise CheckpointError(
            f"--run-dir {directory} holds a checkpoint ({held[0].name}) that this peer's saves would replace: "
            f"continue from it with --resume {directory}, or give another --run-dir (or delete "
            f"{directory}/checkpoint*.pt to start over there)"
        )


# --- a peer's training state, in and out of a checkpoint -----------------------------------------


def training_state(rounds: Any, model: Any, inner_optimizer: Any, batches: Any) -> dict[str, Any]:
    """What a checkpoint holds of a peer's training: the outer state (``rounds``: DiLoCo or
    streaming rounds), the model, AdamW, the error-feedback residuals and the data position."""
    import dataclasses

    feedback = getattr(rounds, "feedback", None)
    later = None
    if hasattr(rounds, "checkpoint_state"):  # as the round (or fragment) in flight will leave them
        outer, local, residuals, later = rounds.checkpoint_state()
    else:
        outer = rounds.outer_state(inner=False)
        local = rounds.local_state() if hasattr(rounds, "local_state") else None
        if isinstance(feedback, list):  # streaming: one residual memory per fragment
            residuals = [f.residuals if f is not None else None for f in feedback]
        else:
            residuals = feedback.residuals if feedback is not None else None
    return {
        "outer": dataclasses.asdict(outer),  # AdamW: saved below
        "model": model.state_dict(),
        "inner_optimizer": inner_optimizer.state_dict(),
        "feedback": residuals,
        "data": batches.state_dict() if batches is not None else None,
        "local": local,
        "take_back": later,  # error feedback's, after the next encode (DiLoCo.checkpoint_state)
        # Dropout's masks (a Hugging Face model's, 0.1 by default) come from torch's generator:
        # without it a resumed run was not the uninterrupted one.
        "torch_rng": torch.get_rng_state(),
        # ...and, on a GPU, from the CUDA generators (dropout on CUDA tensors draws there).
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def restore_training(
    payload: dict[str, Any], rounds: Any, model: Any, inner_optimizer: Any, batches: Any
) -> None:
    """The inverse of :func:`training_state`."""
    from optim.diloco import OuterState

    model.load_state_dict(payload["model"])
    load_moments(inner_optimizer, payload["inner_optimizer"])
    rounds.load_outer_state(OuterState(**payload["outer"]))
    load_moments(inner_optimizer, payload["inner_optimizer"], say=False)  # load_outer_state may reset it
    if hasattr(rounds, "load_local_state"):
        # Streaming: load_outer_state starts the model from θ, as a joiner must; a resumed peer's
        # fragments not synced yet carry its own inner steps since their last sync (lost before:
        # a resumed run ended 4e-2 away from an uninterrupted one), and their samples count.
        model.load_state_dict(payload["model"])
        rounds.load_local_state(payload.get("local") or {})
    feedback = getattr(rounds, "feedback", None)
    if isinstance(feedback, list):  # streaming: one memory per fragment
        for memory, residuals in zip(feedback, payload.get("feedback") or []):
            if memory is not None:
                memory.residuals = residuals
    elif feedback is not None:
        feedback.residuals = payload.get("feedback")
    if feedback is not None and hasattr(rounds, "take_back_later"):
        rounds.take_back_later(payload.get("take_back"))
    restore_position(payload, batches)


def restore_position(payload: dict[str, Any], batches: Any) -> None:
    """Where a checkpoint's data stream and random generators were (:func:`restore_training`'s
    last part; a peer puts them back once its batches exist, after the rest)."""
    if payload.get("data") is not None and batches is not None:
        batches.load_state_dict(payload["data"])
    rng = payload.get("torch_rng")
    if isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8:
        torch.set_rng_state(rng)
    cuda = payload.get("cuda_rng")
    if (
        isinstance(cuda, list)
        and cuda
        and all(isinstance(r, torch.Tensor) and r.dtype == torch.uint8 for r in cuda)
    ):
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all(cuda)
        else:  # another machine: dropout's masks differ from the run that went on, nothing else
            logger.info("the checkpoint's CUDA generators are for %d GPU(s); not restored here", len(cuda))


def changed_flags(saved: Any, now: dict[str, Any]) -> str | None:
    """ "resumed with --inner-lr 0.01 of its flags (the checkpoint's: --inner-lr 0.001)" for the
    flags of ``now`` whose values the checkpoint (``saved``: what it kept) had otherwise, or None
    (a peer resumed with another --inner-lr took it without a word)."""
    saved = saved if isinstance(saved, dict) else {}
    changed = [flag for flag, value in now.items() if flag in saved and saved[flag] != value]
    if not changed:
        return None
    return (
        f"resumed with {', '.join(f'{flag} {now[flag]}' for flag in changed)} of its flags "
        f"(the checkpoint's: {', '.join(f'{flag} {saved[flag]}' for flag in changed)})"
    )


def load_moments(optimizer: Any, saved: dict[str, Any], *, say: bool = True) -> None:
    """The inner optimizer's state from a checkpoint, under the settings it has now: torch's
    ``load_state_dict`` also puts back the saved weight decay, betas and eps, so a peer resumed
    with ``--weight-decay 0 --beta2 0.99`` trained with the checkpoint's 0.1 and 0.95, silently."""
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, kept in zip(optimizer.param_groups, settings, strict=True):
        changed = sorted(k for k, v in kept.items() if k != "lr" and group.get(k) != v)
        if changed and say:
            logger.info(
                "resumed with the inner optimizer's %s of its flags (the checkpoint's: %s)",
                ", ".join(f"{k} {kept[k]}" for k in changed),
                ", ".join(f"{k} {group.get(k)}" for k in changed),
            )
        group.update(kept)


def resume_training(
    payload: dict[str, Any],
    steering: Any,
    rounds: Any,
    model: Any,
    inner_optimizer: Any,
    batches: Any,
    *,
    check: Callable[[], None] | None = None,
) -> None:
    """A resumed peer's state from its checkpoint: the settings the owner had steered when it
    was written (``steering``: :class:`workbench.run.control.Steering`), then the training state.
    In that order: a steered codec makes a new error feedback, which must then take the
    checkpoint's residuals (put back before it, they were dropped, and the resumed peer lost what
    compression had held back since the steer). ``check``: run last; if anything fails, the
    steered settings are undone, so that the checkpoint tried next (the previous one) does not
    run with them (it retunes only the ones it steered itself: a review, stop 71, where H 8,
    int8 and lr 0.3 of a checkpoint passed over stayed under the previous one's H 2, fp16, 0.7)."""
    settings = getattr(rounds, "config", None)
    unsteered = {key: getattr(settings, key, None) for key in ("outer_lr", "inner_steps", "codec")}
    try:
        steering.restore(
            int(payload.get("control_version", 0)),
            payload.get("steered") or {},
            rounds,
            checkpoints=int(payload.get("control_checkpoints", 0)),
        )
        restore_training(payload, rounds, model, inner_optimizer, batches)
        if check is not None:
            check()
    except Exception:
        if settings is not None and hasattr(rounds, "retune"):
            rounds.retune(**unsteered)
        steering.restore(0, {}, rounds)
        steering.round_seconds = None
        raise


def load_for(
    directory: str | Path,
    *,
    run_id: str,
    fingerprint: str,
    summary: str = "",
    fingerprinted: dict[str, str] | None = None,
    also: tuple[str, ...] = (),
    owner: str | None = None,
    use: Use | None = None,
) -> tuple[dict[str, Any], Path]:
    """:func:`load`, refusing a checkpoint of another run or model (``--resume``); ``also``:
    other fingerprints this peer's settings had in earlier releases; ``summary``:
    this peer's model and optimizer in words, shown beside the checkpoint's when they differ;
    ``fingerprinted``: what the fingerprint covers, flag by flag, to name the flags that differ
    (the summaries alone read the same for another --update-codec or --outer-momentum).
    ``owner``: the run's owner (its manifest's); a checkpoint written in a run of another owner
    under the same id is refused (one of an earlier release names none: taken). ``use``: as
    :func:`load`'s, once the checkpoint is known to be this run's and this model's."""

    def fits(payload: dict[str, Any], path: Path) -> None:
        _belongs(payload, path, run_id, fingerprint, summary, fingerprinted, also, owner)
        if use is not None:
            use(payload, path)

    return load(directory, required=REQUIRED, use=fits)


def _belongs(
    payload: dict[str, Any],
    path: Path,
    run_id: str,
    fingerprint: str,
    summary: str,
    fingerprinted: dict[str, str] | None,
    also: tuple[str, ...],
    owner: str | None,
) -> None:
    """CheckpointMismatch unless ``payload`` is this run's and this model's (:func:`load_for`)."""
    if payload.get("run_id") != run_id:
        raise CheckpointMismatch(
            f"{path} belongs to run '{payload.get('run_id')}', not '{run_id}': pass --run-id {payload.get('run_id')}, "
            "or join without --resume (with another --run-dir)"
        )
    written_in = payload.get("owner")
    if owner and isinstance(written_in, str) and written_in != owner:
        # A run started anew under the same id by someone else: the old θ took over the new
        # run (its owner, at outer step 0, downloaded the resumed joiner's state: a review).
        raise CheckpointMismatch(
            f"{path} was written in another run named '{run_id}' (owner {written_in}; this one's is "
            f"{owner}): its state is not this run's: join without --resume (with another --run-dir; "
            "the run's state is downloaded)"
        )
    theirs = payload.get("fingerprinted")
    recorded = theirs if isinstance(theirs, dict) else {}
    if payload.get("fingerprint") in also and all(
        str(recorded[flag]) == mine for flag, mine in (fingerprinted or {}).items() if flag in recorded
    ):  # an earlier release's fingerprint, unless a flag it recorded says otherwise (a mean run's
        # checkpoint resumed into --aggregate trimmed-mean: a review, stop 69)
        return
    if payload.get("fingerprint") != fingerprint and isinstance(theirs, dict) and fingerprinted:
        differ = [
            f"{flag} {theirs.get(flag, '?')} (this peer: {mine})"
            for flag, mine in fingerprinted.items()
            if str(theirs.get(flag)) != mine
        ]
        if differ:
            raise CheckpointMismatch(
                f"{path} was written by a peer started with other settings: {'; '.join(differ)}: "
                "resume with the flags the peer was started with"
            )
    if payload.get("fingerprint") != fingerprint:
        raise CheckpointMismatch(
            f"{path} was written for model fingerprint {payload.get('fingerprint')}"
            + (f" ({payload['summary']})" if payload.get("summary") else "")
            + f", this peer's is {fingerprint}"
            + (f" ({summary})" if summary else "")
            + ": resume with the flags the peer was started with"
        )
