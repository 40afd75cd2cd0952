"""Byte-level text corpora for the workbench: load, split, batch, evaluate.

Phases: ``DataConfig`` -> ``ByteCorpus.load`` (read files as raw bytes, hold some files out
for evaluation) -> ``ByteCorpus.batches`` (random training windows; each peer samples its own
shard) / ``ByteCorpus.eval_batches`` (fixed windows, identical in every process) ->
``evaluate``.

With no path the corpus is the Python standard library's own source, found at run time, so a
swarm can train with no download and every peer sees the same bytes.
"""

from __future__ import annotations

import json
import logging
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from workbench.run.model import autocast_context
from workbench.run.progress_bar import progress

logger = logging.getLogger(__name__)

__all__ = ["ByteCorpus", "DataConfig", "DataError", "evaluate", "stdlib_sources"]

_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
"""Folder names skipped when collecting the standard library's sources."""


class DataError(ValueError):
    """The corpus cannot be built or is too small; the message says how to fix it."""


@dataclass(kw_only=True)
class DataConfig:
    """Where the bytes come from and how they are batched."""

    path: str | None = None
    """A text file, or a folder searched recursively; None = the Python stdlib's source."""
    batch_size: int = 16
    """Sequences per batch (B)."""
    eval_fraction: float = 0.05
    """Fraction of files held out for evaluation, chosen by a stable hash of each path."""
    max_bytes: int = 16_000_000
    """Stop reading files after this many bytes in total; keeps start-up fast."""
    extensions: tuple[str, ...] = (".py", ".txt", ".md", ".rst", ".jsonl")
    """File suffixes a folder contributes (a single file is read whatever its suffix)."""
    text_field: str = "text"
    """In a ``.jsonl`` file or a dataset, the field holding each record's text."""
    dataset: str | None = None
    """Read documents with ``datasets`` instead: a saved dataset folder, data files, or a hub
    name (the ``[hf]`` extra). Replaces ``path``."""
    dataset_subset: str | None = None
    """The dataset's configuration name, for hub datasets that have several."""
    dataset_split: str = "train"
    """Which split of the dataset to read (evaluation records are held out of it by index)."""
    streaming: bool = False
    """Stream the dataset's records instead of downloading and preparing it whole."""
    tokenizer: str | None = None
    """A ``transformers`` tokenizer (local folder or hub name): train on its token ids
    instead of bytes. The model's vocabulary must hold them."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` saying what is wrong and how to fix it."""
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"DataConfig.batch_size={self.batch_size!r} must be an integer >= 1; try 16.")
        if not 0.0 < self.eval_fraction < 0.5:
            raise ValueError(
                f"DataConfig.eval_fraction={self.eval_fraction!r} must be in (0, 0.5); try 0.05 (5% held out)."
            )
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1024:
            raise ValueError(
                f"DataConfig.max_bytes={self.max_bytes!r} must be an integer >= 1024; try 16_000_000."
            )
        if self.path is not None and self.dataset is not None:
            raise ValueError("pass either --data (files) or --dataset (the datasets library), not both")
        if self.dataset is None and (self.streaming or self.dataset_subset is not None):
            flag = "--streaming" if self.streaming else "--dataset-subset"
            raise ValueError(
                f"{flag} shapes how a --dataset is read, and none is given: add --dataset NAME|PATH"
            )
        if not self.extensions or not all(isinstance(e, str) and e.startswith(".") for e in self.extensions):
            raise ValueError(
                f"DataConfig.extensions={self.extensions!r} must be a non-empty tuple of suffixes "
                f"starting with '.', e.g. ('.py', '.txt')."
            )


def _documents(path: Path, root: Path, config: DataConfig, budget: int) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each document in ``path``: the file itself, or one per JSONL record;
    ``budget`` bytes at most are wanted (a 1 GB file was read whole for 4 KB of it, and a file
    larger than memory ended the peer)."""
    relative = path.relative_to(root).as_posix()
    try:
        with open(path, "rb") as handle:
            if path.suffix.lower() == ".jsonl":
                # bytes.splitlines() of each line read: a file whose lines end in a bare \r too
                lines = (piece for line in handle for piece in line.splitlines())
                yield from _jsonl_documents(path, relative, lines, config.text_field, budget)
                return
            data = handle.read(budget)
    except OSError as exc:
        logger.debug("skipping unreadable file %s: %s", path, exc)
        return
    if not data:
        return
    if b"\x00" in data:
        logger.debug("skipping binary file %s (contains NUL bytes)", path)
        return
    yield relative, data


def _jsonl_documents(
    path: Path, relative: str, lines, field: str, budget: int
) -> Iterator[tuple[str, bytes]]:
    """The records' texts, line by line until ``budget`` bytes of text; a record whose field is
    null or empty holds no document (skipped: before, "has no text field 'text' (it has: text)"
    ended the load)."""
    taken = 0
    for number, line in enumerate(lines, 1):
        if taken >= budget:
            return
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataError(
                f"{path}:{number} is not a JSON line ({exc.__class__.__name__}); fix or drop it"
            ) from None
        if not isinstance(record, dict) or field not in record:
            fields = ", ".join(sorted(record)[:8]) if isinstance(record, dict) else type(record).__name__
            raise DataError(
                f"{path}:{number} has no text field '{field}' (it has: {fields}); name the right one "
                f"with --text-field"
            )
        text = record[field]
        if text is None or text == "":
            continue
        if not isinstance(text, str):
            raise DataError(
                f"{path}:{number}: field '{field}' holds {type(text).__name__} {str(text)[:40]!r}, not text; "
                "name the text field with --text-field"
            )
        # A lone surrogate (valid JSON, "\ud800") is no UTF-8: replaced, not a bare UnicodeEncodeError.
        data = text.encode("utf-8", errors="replace")
        taken += len(data)
        yield f"{relative}#{number}", data


def stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files, sorted, without site-packages and test folders."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    # Pruned as it walks: site-packages alone can hold 10x the stdlib's files (torch's), and
    # walking it cost every peer 1.5 s at start-up.
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _EXCLUDED_DIRS]
        files.extend(Path(folder, n) for n in names if n.endswith(".py") and os.path.isfile(Path(folder, n)))
    files.sort()
    if not files:
        raise DataError(
            f"found no Python standard library sources under {root}; "
            f"pass a text file or folder with --data PATH instead."
        )
    return files


def _folder_files(root: Path, extensions: tuple[str, ...]) -> list[Path]:
    """Files under ``root`` with a matching suffix, sorted; hidden files and folders skipped."""
    suffixes = {e.lower() for e in extensions}
    return sorted(
        p
        for p in root.rglob("*")
        if p.suffix.lower() in suffixes
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


def _is_eval_file(relative: str, eval_fraction: float) -> bool:
    """Stable across processes and Python versions (unlike ``hash``)."""
    return zlib.crc32(relative.encode("utf-8", "surrogateescape")) % 10_000 < eval_fraction * 10_000


class ByteCorpus:
    """A train and a validation byte stream (uint8, 1-D), each file separated by ``b"\\n"``."""

    def __init__(
        self,
        *,
        train: Tensor,
        val: Tensor,
        source: str,
        num_files: int,
        vocab_size: int = 256,
        presharded: bool = False,
    ) -> None:
        for split in (train, val):  # bytes, or token ids of a tokenizer
            assert split.dtype in (torch.uint8, torch.int32) and split.dim() == 1, (
                f"{split.dtype=} {split.shape=}"
            )
        self.train = train  # (N_train,) uint8 bytes or int32 token ids
        self.val = val  # (N_val,)
        self.source = source
        self.num_files = num_files
        self.vocab_size = vocab_size
        """Token values the data holds: 256 for bytes, else the tokenizer's vocabulary."""
        self.presharded = presharded
        """The documents are already this peer's shard (a dataset sharded by record)."""

    def __repr__(self) -> str:
        return f"ByteCorpus({self.source}: train={len(self.train)} B, val={len(self.val)} B)"

    # --- loading ------------------------------------------------------------------------------

    @classmethod
    def load(cls, config: DataConfig, *, shard: int | None = None, num_shards: int = 1) -> ByteCorpus:
        """Read the documents named by ``config`` and split them into train and val. A dataset
        is sharded here, by record (``shard`` of ``num_shards``; files are sharded per batch)."""
        if config.dataset is not None:
            train_parts, val_parts, files, label, total = cls._read_dataset(config, shard, num_shards)
        else:
            train_parts, val_parts, files, label, total = cls._read_files(config)
        num_files = len(train_parts) + len(val_parts)
        if num_files == 0 and config.dataset is not None:
            raise DataError(f"{label} gave no text from field '{config.text_field}'; check --text-field")
        if num_files == 0:
            raise DataError(
                f"all {len(files)} candidate files under {label!r} are empty or binary; "
                f"point --data at non-empty text files."
            )
        held = sum(len(part) for part in val_parts)
        whole = held + sum(map(len, train_parts))
        by_file = bool(train_parts and val_parts) and (
            # Files held out by name: a few small ones could be all of it (a package folder's
            # eval set was the one line `__version__ = "3.21"`, 21 of 332,781 bytes), and one
            # big one most of it (a 1 MB corpus beside a 16 KB README: 98.5 % held out, the
            # peer trained on the README; a review, stop 72).
            config.dataset is not None
            or config.eval_fraction / 4 * whole <= held <= min(3 * config.eval_fraction, 0.5) * whole
        )
        if by_file:
            train_bytes, val_bytes = b"\n".join(train_parts), b"\n".join(val_parts)
        else:
            # Too few files (or too small, or too big) for a split by file (e.g. a single file):
            # hold out the tail instead.
            stream = b"\n".join(train_parts + val_parts)
            cut = len(stream) - max(1, int(len(stream) * config.eval_fraction))
            train_bytes, val_bytes = stream[:cut], stream[cut:]
            logger.debug("split by bytes instead of by file (%d files)", num_files)

        source = f"{label} ({num_files} {'records' if config.dataset else 'files'}, {total / 1e6:.1f} MB)"
        if config.tokenizer is None:
            train, val, vocab = _to_tensor(train_bytes), _to_tensor(val_bytes), 256
        else:
            import workbench.run.hf as hf

            tokenizer = hf.load_tokenizer(config.tokenizer)
            # Document by document, so that each ends with the end-of-text token (joined first,
            # 200 records held one between them all).
            with progress(f"tokenizing with {config.tokenizer}"):
                if by_file:
                    train, val = hf.tokenize(tokenizer, train_parts), hf.tokenize(tokenizer, val_parts)
                else:
                    ids = hf.tokenize(tokenizer, train_parts + val_parts)
                    cut = len(ids) - max(1, int(len(ids) * config.eval_fraction))
                    train, val = ids[:cut], ids[cut:]
            vocab = len(tokenizer)
            source += f", {len(train) + len(val)} tokens of {config.tokenizer}"
        logger.info("loaded corpus %s: train=%d, val=%d", source, len(train), len(val))
        presharded = config.dataset is not None and shard is not None
        return cls(
            train=train, val=val, source=source, num_files=num_files, vocab_size=vocab, presharded=presharded
        )

    @staticmethod
    def _read_dataset(
        config: DataConfig, shard: int | None, num_shards: int
    ) -> tuple[list[bytes], list[bytes], list[Path], str, int]:
        """The records of ``config.dataset`` (this peer's shard of them), train and val by index."""
        import workbench.run.hf as hf

        dataset = hf.open_dataset(
            config.dataset,
            subset=config.dataset_subset,
            split=config.dataset_split,
            streaming=config.streaming,
        )
        train_parts: list[bytes] = []
        val_parts: list[bytes] = []
        with progress(f"reading {config.dataset}", total=config.max_bytes, unit="bytes") as bar:
            for is_eval, data in hf.dataset_documents(
                dataset,
                text_field=config.text_field,
                shard=shard or 0,
                num_shards=num_shards if shard is not None else 1,
                eval_fraction=config.eval_fraction,
                max_bytes=config.max_bytes,
            ):
                (val_parts if is_eval else train_parts).append(data)
                bar.advance(len(data))
        label = f"dataset {config.dataset}" + (f" shard {shard}/{num_shards}" if shard is not None else "")
        return train_parts, val_parts, [], label, sum(map(len, train_parts)) + sum(map(len, val_parts))

    @staticmethod
    def _read_files(config: DataConfig) -> tuple[list[bytes], list[bytes], list[Path], str, int]:
        """The documents of ``config.path`` (or the stdlib), train and val by file."""
        if config.path is None:
            root = Path(sysconfig.get_paths()["stdlib"])
            files, label = stdlib_sources(), "python stdlib"
        else:
            root = Path(config.path).expanduser()
            label = str(config.path)
            if not root.exists():
                raise DataError(
                    f"data path {str(root)!r} does not exist; pass an existing text file or folder."
                )
            if root.is_dir():
                files = _folder_files(root, config.extensions)
                if not files:
                    raise DataError(
                        f"folder {str(root)!r} has no files ending in {', '.join(config.extensions)}; "
                        f"add such files or point at another folder (in Python, widen DataConfig.extensions)."
                    )
            else:
                files, root = [root], root.parent

        train_parts: list[bytes] = []
        val_parts: list[bytes] = []
        total = 0
        with progress(f"reading {label}", total=len(files), unit="files") as bar:
            for i, path in enumerate(files):
                if total >= config.max_bytes:
                    logger.debug(
                        "max_bytes=%d reached; not reading %d more files", config.max_bytes, len(files) - i
                    )
                    break
                for relative, data in _documents(path, root, config, config.max_bytes - total):
                    if total >= config.max_bytes:
                        break
                    data = data[: config.max_bytes - total]
                    total += len(data)
                    (val_parts if _is_eval_file(relative, config.eval_fraction) else train_parts).append(data)
                bar.advance(1)
        return train_parts, val_parts, files, label, total

    # --- batching -----------------------------------------------------------------------------

    def check_fits(self, block_size: int) -> None:
        """Raise :class:`DataError` unless both splits hold at least one window of ``block_size``."""
        for split, data in (("train", self.train), ("val", self.val)):
            _check_length(len(data), block_size, f"the {split} split of {self.source}")

    def batches(
        self, *, block_size: int, batch_size: int, seed: int, shard: int = 0, num_shards: int = 1
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Endless random ``(x, y)`` int64 batches ``(B, T)`` from train; ``y`` is ``x`` shifted by one.

        Shard ``shard`` samples only from its own contiguous ``1/num_shards`` slice of train,
        so peers read different data; the stream is fixed by ``(seed, shard)``.
        """
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise DataError(
                f"shard={shard} is out of range for num_shards={num_shards}; use 0 <= shard < num_shards."
            )
        _check_positive(block_size=block_size, batch_size=batch_size)
        n = len(self.train)
        lo, hi = n * shard // num_shards, n * (shard + 1) // num_shards
        _check_length(
            hi - lo, block_size, f"shard {shard}/{num_shards} of the train split of {self.source}", num_shards
        )
        return self._sample(lo, hi, block_size=block_size, batch_size=batch_size, seed=seed, shard=shard)

    def _sample(
        self, lo: int, hi: int, *, block_size: int, batch_size: int, seed: int, shard: int
    ) -> BatchStream:
        generator = torch.Generator()
        # Mix seed and shard so shards draw unrelated offsets, not the same ones shifted.
        generator.manual_seed((seed * 0x9E3779B97F4A7C15 + shard * 0xBF58476D1CE4E5B9) % 2**63)
        return BatchStream(
            self.train, lo, hi, block_size=block_size, batch_size=batch_size, generator=generator
        )

    def eval_batches(
        self, *, block_size: int, batch_size: int, num_batches: int = 8
    ) -> list[tuple[Tensor, Tensor]]:
        """``num_batches`` fixed ``(x, y)`` batches from val at evenly spaced positions.

        Depends only on the corpus and the arguments, so every call and every peer evaluates on
        exactly the same bytes.
        """
        _check_positive(block_size=block_size, batch_size=batch_size, num_batches=num_batches)
        _check_length(len(self.val), block_size, f"the val split of {self.source}")
        last_start = len(self.val) - block_size - 1
        starts = torch.linspace(0, last_start, num_batches * batch_size, dtype=torch.float64).long()  # (N*B,)
        offsets = torch.arange(block_size + 1)  # (T+1,)
        return [_windows(self.val, chunk, offsets) for chunk in starts.split(batch_size)]


def _to_tensor(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


EVAL_BATCH_SIZE = 16
"""The held-out set's batch size, whatever a peer's ``--batch-size`` (the default's): the eval
set is ``eval_batches`` of these windows, the same bytes on every peer. Built with each peer's
own batch size, peers with another ``--batch-size`` printed other eval losses for the same θ."""


class BatchStream:
    """An endless stream of random training windows whose position can be saved and restored
    (checkpoints): ``state_dict()`` holds the random generator's state and the batches drawn."""

    def __init__(
        self, data: Tensor, lo: int, hi: int, *, block_size: int, batch_size: int, generator
    ) -> None:
        self.data, self.lo, self.hi = data, lo, hi
        self.block_size, self.batch_size = block_size, batch_size
        self.generator = generator
        self.seed = generator.initial_seed()
        self.offsets = torch.arange(block_size + 1)  # (T+1,)
        self.drawn = 0

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        starts = torch.randint(
            self.lo, self.hi - self.block_size, (self.batch_size,), generator=self.generator
        )
        self.drawn += 1
        return _windows(self.data, starts, self.offsets)

    def state_dict(self) -> dict:
        return {
            "rng": self.generator.get_state(),
            "drawn": self.drawn,
            "batch_size": self.batch_size,
            "stream": [self.seed, self.lo, self.hi],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` left off, if it is a position in this stream; a position in
        another one (another peer id: a checkpoint resumed into a second folder, side by side
        with the first; another --shard or data) is left, and this stream starts from its own
        beginning: taken, two peers resumed from one checkpoint drew the same batches."""
        check_batch_size(state, self.batch_size)
        stream = state.get("stream")
        if stream is not None and list(stream) != [self.seed, self.lo, self.hi]:
            logger.info(
                "the checkpoint's data position is in another stream of batches (another peer id, "
                "--shard or data): this peer draws its own from the start"
            )
            return
        self.generator.set_state(state["rng"])
        self.drawn = int(state["drawn"])


def check_batch_size(state: dict, batch_size: int) -> None:
    """DataError unless a checkpoint's data position (``state``) is for ``batch_size``."""
    if state.get("batch_size") != batch_size:
        raise DataError(
            f"the checkpoint's data position is for batch size {state.get('batch_size')}, "
            f"this peer uses {batch_size}: resume with the same --batch-size"
        )


def _windows(data: Tensor, starts: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
    """Cut ``len(starts)`` windows of T+1 bytes; return inputs and next-byte targets."""
    chunk = data[starts[:, None] + offsets[None, :]].long()  # (B, T+1)
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()  # (B, T), (B, T)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise DataError(f"{name}={value} must be >= 1; pass a positive value.")


def _check_length(found: int, block_size: int, what: str, num_shards: int = 1) -> None:
    needed = block_size + 1  # one window of T inputs plus the target of the last one
    if found < needed:
        hint = " or use fewer shards" if num_shards > 1 else ""
        raise DataError(
            f"{what} has {found} bytes but a batch needs at least {needed} (block_size + 1); "
            f"use more or larger files, a smaller --block-size{hint}, or a larger --max-bytes."
        )


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: list[tuple[Tensor, Tensor]], device: torch.device, chunk: int | None = None
) -> float:
    """Mean loss of ``model(x, y)`` over ``batches``; the model's train/eval mode is restored.
    ``chunk``: at most this many windows in one forward (a peer's own --batch-size, which fits
    its memory; the eval set's batches are :data:`EVAL_BATCH_SIZE`), each batch's loss the mean
    of its chunks' weighted by their windows: the same number."""
    if not batches:
        raise ValueError(
            "evaluate() got no batches; pass ByteCorpus.eval_batches(...) with num_batches >= 1."
        )
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for x, y in batches:
            size = min(chunk or len(x), len(x))
            loss_sum = 0.0
            for lo in range(0, len(x), size):
                with autocast_context(device):
                    _, loss = model(x[lo : lo + size].to(device), y[lo : lo + size].to(device))
                loss_sum += float(loss) * len(x[lo : lo + size])
            total += loss_sum / len(x)
        return total / len(batches)
    finally:
        model.train(was_training)
