"""Hugging Face models, tokenizers and datasets (the optional ``[hf]`` extra).

``--model DIR`` takes a folder holding a causal-LM ``config.json`` (and, if present, its
weights): :func:`load_model` builds it, seeded like the presets so every peer starts from the
same θ, and wraps it in :class:`CausalLM`, which speaks the workbench's ``model(x, y) ->
(logits, loss)``. ``--tokenizer PATH`` turns documents into token ids instead of bytes.
``--dataset NAME_OR_PATH`` reads documents with ``datasets`` (local files, a saved dataset or a
hub name; ``--streaming`` reads only what it needs), each peer its own shard of the records.

Nothing here downloads at import; ``transformers`` and ``datasets`` are imported when used, with
an error that says how to install them.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
DATA_SUFFIXES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


class MissingExtra(ValueError):
    """An optional dependency is not installed; the message says which extra brings it."""


def _require(module: str) -> Any:
    try:
        imported = __import__(module)
    except ImportError:
        raise MissingExtra(
            f"this needs the '{module}' package: pip install 'swarm-workbench[hf]' (or pip install {module})"
        ) from None
    _one_log()
    return imported


def _first_line(error: BaseException) -> str:
    """transformers' errors run over many lines (hints, tables): the first, for a one-line error."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _one_log() -> None:
    """Hugging Face's libraries log through the peer's log, once: huggingface_hub adds a handler
    of its own and propagates as well (each of its retry warnings came out twice, raw and
    formatted), transformers logs raw lines beside the peer's."""
    for name in ("huggingface_hub", "transformers"):
        library = logging.getLogger(name)
        if logging.getLogger().handlers:  # a log is set up (the CLI's): theirs go through it
            library.handlers.clear()
            library.propagate = True


def is_model_dir(name: str) -> bool:
    """True when ``name`` is a folder with a Hugging Face ``config.json`` (not a preset name)."""
    return (Path(name).expanduser() / "config.json").is_file()


class CausalLM(nn.Module):
    """A ``transformers`` causal LM as a workbench model: ``forward(idx, targets)`` returns
    ``(logits, loss)`` with ``targets`` already shifted by one (as the data gives them)."""

    def __init__(self, model: nn.Module, source: str) -> None:
        super().__init__()
        self.hf = model
        self.source = source
        config = model.config
        # A composite config (Gemma 3, multimodal families) keeps the text model's under text_config.
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.vocab_size = int(config.vocab_size)
        self.max_positions = int(
            getattr(config, "max_position_embeddings", 0) or getattr(config, "n_positions", 0) or 0
        )

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        logits = self.hf(input_ids=idx).logits  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def extra_repr(self) -> str:
        """Part of the model fingerprint: the architecture's settings, not where they came from."""
        config = {
            k: v
            for k, v in self.hf.config.to_dict().items()
            if not k.startswith("_") and k not in ("transformers_version", "name_or_path")
        }
        return f"config={json.dumps(config, sort_keys=True, default=str)}"


def load_model(
    directory: str, *, seed: int, block_size: int, vocab_size: int, shapes_only: bool = False
) -> CausalLM:
    """The causal LM described by ``directory/config.json``: its weights when the folder has
    them, else a fresh init seeded with ``seed`` (identical on every peer). Checks that it can
    read ``block_size`` tokens of a ``vocab_size`` vocabulary. ``shapes_only``: the weights are
    not read (for a model built on the ``meta`` device, whose parameters hold no values)."""
    transformers = _require("transformers")
    path = Path(directory).expanduser()
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as error:  # noqa: BLE001 - transformers raises many kinds for a bad config
        raise ValueError(
            f"{path}/config.json is not a Hugging Face model config ({_first_line(error)})"
        ) from None
    has_weights = any((path / name).exists() for name in WEIGHT_FILES)
    missing: list[str] = []
    try:
        # Seeded either way: weights the folder lacks (an untied head, a layer added to the
        # config) are initialised, and must be the same on every peer (and every virtual peer of
        # one process), or the peers start from different θ.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if has_weights and not shapes_only:
                model, info = transformers.AutoModelForCausalLM.from_pretrained(
                    path, local_files_only=True, output_loading_info=True
                )
                missing = list(info.get("missing_keys") or [])
            else:
                model = transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as error:
        raise ValueError(
            f"{path} does not describe a causal language model ({_first_line(error)}); use a "
            "*ForCausalLM config such as Llama, GPT-2 or Qwen"
        ) from None
    except (RuntimeError, OSError) as error:  # weights of other shapes than config.json's, a bad file
        if not has_weights or shapes_only:  # nothing was loaded: the config itself is bad
            raise ValueError(
                f"{path}: its config.json does not make a model ({_first_line(error)}); check its sizes"
            ) from None
        raise ValueError(
            f"{path}: its weights do not load into the model its config.json describes ({_first_line(error)}); "
            "use the config.json the weights were saved with"
        ) from None
    except Exception as error:  # noqa: BLE001 - safetensors' and pickle's own kinds: a damaged file
        if not has_weights or shapes_only:
            raise
        import pickle

        # (pickle's says to load it with weights_only=False: unsafe advice for a damaged file)
        detail = "not a torch checkpoint" if isinstance(error, pickle.UnpicklingError) else _first_line(error)
        raise ValueError(
            f"{path}: a weights file cannot be read ({type(error).__name__}: {detail}); it is cut short or "
            "damaged: copy or download it again"
        ) from None
    model = model.float()
    wrapped = CausalLM(model, str(path))
    if not shapes_only and (leak := _sees_ahead(wrapped)):
        raise ValueError(
            f"{path} describes {type(model).__name__}, which sees the tokens it is to predict ({leak}): "
            "training it on next-token prediction teaches it to copy (a bidirectional encoder such as "
            "BERT's, or a config without is_decoder=true); use a causal (decoder) config such as Llama, "
            "GPT-2 or Qwen"
        )
    if wrapped.vocab_size < vocab_size:
        raise ValueError(
            f"{path}: vocab_size {wrapped.vocab_size} is smaller than the data's {vocab_size} token "
            "values; raise vocab_size in config.json or pass the model's own --tokenizer"
        )
    if wrapped.max_positions and wrapped.max_positions < block_size:
        raise ValueError(
            f"{path}: the model reads at most {wrapped.max_positions} positions, fewer than "
            f"--block-size {block_size}; lower --block-size"
        )
    if shapes_only:
        return wrapped
    logger.info(
        "model %s: %s, %.2fM params (%s)",
        path.name,
        type(model).__name__,
        wrapped.num_params() / 1e6,
        "its weights" if has_weights else f"fresh init, seed {seed}",
    )
    if missing:
        logger.warning(
            "model %s: %d weight(s) are not in the folder (%s%s): initialised with seed %d, the same on "
            "every peer",
            path.name,
            len(missing),
            ", ".join(missing[:3]),
            ", ..." if len(missing) > 3 else "",
            seed,
        )
    return wrapped


@torch.no_grad()
def _sees_ahead(model: CausalLM, length: int = 8) -> str | None:
    """Whether the model's prediction at a position depends on a later token (not causal): the
    logits of every position before the last must not move when the last token changes. Why
    it is not, in words, or None. (transformers builds BertLMHeadModel from a BERT config and
    only warns: its attention is bidirectional unless is_decoder is set.)"""
    length = max(2, min(length, model.max_positions or length))
    vocab = max(2, model.vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tokens = torch.randint(0, vocab, (1, length))
    changed = tokens.clone()
    changed[0, -1] = (tokens[0, -1] + 1) % vocab
    training = model.training
    model.eval()  # no dropout: the same input gives the same logits
    try:
        device = next(model.parameters()).device
        before = model.hf(input_ids=tokens.to(device)).logits[0, :-1].float()
        after = model.hf(input_ids=changed.to(device)).logits[0, :-1].float()
    finally:
        model.train(training)
    moved = float((before - after).abs().max())
    scale = float(before.abs().max()) + 1e-12
    if moved > 1e-5 * scale:
        return (
            f"its logits at earlier positions moved by {moved:.2g} when the last of {length} tokens changed"
        )
    return None


# --- tokenizers ---------------------------------------------------------------------------------


def load_tokenizer(name: str):
    """A ``transformers`` tokenizer from a local folder (or a hub name when online)."""
    from pathlib import Path

    if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().is_dir():
        # A path, not a hub name: transformers would say "Repo id must use alphanumeric chars".
        raise ValueError(f"--tokenizer {name}: no such folder (give a folder holding tokenizer.json)")
    folder = Path(name).expanduser()
    if folder.is_dir() and not any((folder / f).exists() for f in TOKENIZER_FILES):
        raise ValueError(
            f"--tokenizer {name}: the folder holds no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...): "
            "give the folder the model's tokenizer was saved in (tokenizer.save_pretrained)"
        )
    transformers = _require("transformers")
    if not folder.is_dir():
        # Said before the hub is asked: offline, its retries take about a minute for a typo.
        logger.info(
            "--tokenizer %s: no folder by that name here; asking the Hugging Face hub "
            "(a folder is given as ./%s; HF_HUB_OFFLINE=1 skips the hub)",
            name,
            name,
        )
    try:
        return transformers.AutoTokenizer.from_pretrained(name)
    except Exception as error:  # noqa: BLE001 - transformers raises many kinds, over many lines
        raise ValueError(
            f"cannot load a tokenizer from {name!r} ({type(error).__name__}: {_first_line(error)})"
        ) from None


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "tokenizer_config.json",
    "spiece.model",
    "vocab.txt",
    "tiktoken.model",
)
"""What a tokenizer folder holds (one at least), as transformers saves or reads them."""


def tokenize(tokenizer, documents: list[bytes]) -> Tensor:
    """Token ids of the documents, each followed by the end-of-text token when there is one
    (int32, 1-D)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for document in documents:
        ids += tokenizer.encode(document.decode("utf-8", errors="replace"), add_special_tokens=False) + eos
    return torch.tensor(ids, dtype=torch.int32)


# --- datasets -----------------------------------------------------------------------------------


def open_dataset(name: str, *, subset: str | None, split: str, streaming: bool):
    """``datasets``' view of ``name``: a folder written by ``save_to_disk``, a data file or folder
    of them (json/jsonl, csv, parquet, txt), or a hub name."""
    datasets = _require("datasets")
    path = Path(name).expanduser()
    # A path, or a bare name ending like a data file ("data.jsonl": hub names have no such
    # end): a missing one is a typo here, not a hub name to try for a minute.
    local = name.startswith(("/", "./", "../", "~")) or path.suffix in DATA_SUFFIXES
    if local and not path.exists():
        raise ValueError(f"cannot open dataset {name!r}: no such file or folder")
    try:
        if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ValueError(
                        f"{path} has no split '{split}' (it has: {', '.join(loaded)}); pass --dataset-split"
                    )
                loaded = loaded[split]
            return loaded.to_iterable_dataset() if streaming else loaded
        if path.is_file() or path.is_dir():
            files = [path] if path.is_file() else _data_files(path)
            kinds = {DATA_SUFFIXES.get(p.suffix) for p in files}
            if not files or None in kinds or len(kinds) > 1:
                raise ValueError(
                    f"{path}: expected data files of one kind ({', '.join(DATA_SUFFIXES)}), found "
                    f"{sorted({p.suffix for p in files}) or 'none'}"
                )
            empty = [str(p) for p in files if p.stat().st_size == 0]
            if empty:  # datasets said "An error occurred while generating the dataset" (a review)
                raise ValueError(
                    f"{', '.join(empty[:3])}{' and more' if len(empty) > 3 else ''}: empty; point "
                    "--dataset at files with data"
                )
            # The split's names, without a slice ("train[:50%]") or the others it adds ("+test").
            wanted = [part.split("[", 1)[0].strip() for part in split.split("+")]
            splits = (
                {wanted[0]: files} if path.is_file() else _splits(files, path)
            )  # one file: the split asked
            missing = [name for name in wanted if name not in splits]
            if missing:
                raise ValueError(
                    f"{path} has no split '{missing[0]}' (it has: {', '.join(splits)}; files are told apart "
                    "by train/test/validation in their names); pass --dataset-split"
                )
            return datasets.load_dataset(
                kinds.pop(),
                data_files={name: [str(p) for p in splits[name]] for name in wanted},
                split=split,
                streaming=streaming,
            )
        return datasets.load_dataset(name, subset, split=split, streaming=streaming)
    except ValueError:
        raise
    except Exception as error:  # noqa: BLE001 - network, missing dataset, bad files: say which
        raise ValueError(f"cannot open dataset {name!r} ({type(error).__name__}: {error})") from None


SPLIT_NAMES = {
    "train": "train", "training": "train",
    "test": "test", "testing": "test",
    "validation": "validation", "valid": "validation", "val": "validation", "dev": "validation",
    "eval": "validation",
}  # fmt: skip
"""Words in a data file's path that name its split (as ``datasets`` reads a folder)."""


def _data_files(folder: Path) -> list[Path]:
    """The data files under ``folder``, but those in hidden folders (``.ipynb_checkpoints``)."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.suffix in DATA_SUFFIXES and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def _splits(files: list[Path], root: Path) -> dict[str, list[Path]]:
    """``files`` by the split their path names (a folder's ``train.jsonl`` and ``test.jsonl``;
    ``test/part-0.parquet``), all ``train`` when none names one. Before stop 57 every file of a
    folder was the train split: its test file was trained on, and --dataset-split test refused."""
    named: dict[str, list[Path]] = {}
    for file in files:
        parts = file.relative_to(root).with_suffix("").parts
        words = [w for part in parts for w in re.split(r"[-_.\s]+", part.lower())]
        which = next((SPLIT_NAMES[w] for w in words if w in SPLIT_NAMES), None)
        named.setdefault(which or "", []).append(file)
    if set(named) == {""}:
        return {"train": named[""]}
    unnamed = named.pop("", [])
    if unnamed:  # files that name no split train
        named.setdefault("train", []).extend(unnamed)
    return named


def dataset_documents(
    dataset,
    *,
    text_field: str,
    shard: int,
    num_shards: int,
    eval_fraction: float,
    max_bytes: int,
) -> Iterator[tuple[bool, bytes]]:
    """(is_eval, text) per record, in order, until ``max_bytes`` of text have been read.

    Records are held out for evaluation by their index (every ``1/eval_fraction``-th), the
    same on every peer, up to ``eval_fraction`` of ``max_bytes`` (a cap that does not depend on
    the shard, so every peer holds the same eval set: capped by this peer's own bytes, shards
    stopped at different records and evaluated on different sets). Of the other records, this
    peer takes every ``num_shards``-th, from its ``shard`` (counted among the training records:
    counted by index, N = 20 left shard 19 with eval records only, and it then trained on them),
    so peers train on disjoint records and read no more of a streamed dataset than they need."""
    every = max(2, round(1 / eval_fraction))
    caps = {True: max(1, int(max_bytes * eval_fraction))}
    caps[False] = max(1, max_bytes - caps[True])
    totals = {True: 0, False: 0}
    trained = -1  # the index among training records
    for index, record in enumerate(dataset):
        if all(totals[kind] >= caps[kind] for kind in caps):
            return
        is_eval = index % every == every - 1
        if not is_eval:
            trained += 1
            if trained % num_shards != shard:
                continue
        if totals[is_eval] >= caps[is_eval]:
            continue
        if not isinstance(record, dict) or text_field not in record:
            fields = ", ".join(sorted(record)[:8]) if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f"record {index} has no text field '{text_field}' (it has: {fields}); name it with --text-field"
            )
        text = record[text_field]
        if text is not None and not isinstance(text, str):
            raise ValueError(
                f"record {index}: field '{text_field}' holds {type(text).__name__} {str(text)[:40]!r}, not "
                "text; name the text field with --text-field"
            )
        if text:  # a null or empty cell holds no document (an empty CSV cell ended the load)
            data = text.encode("utf-8", errors="replace")[: caps[is_eval] - totals[is_eval]]
            totals[is_eval] += len(data)
            yield is_eval, data
