"""Hugging Face models, tokenizers and datasets (the [hf] extra), on things the tests make."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from swarm.manifest import model_fingerprint  # noqa: E402
from tests.hf_fixtures import documents, make_jsonl_dataset, make_llama, make_tokenizer  # noqa: E402
from workbench.run import hf  # noqa: E402
from workbench.run.data import ByteCorpus, DataConfig, DataError  # noqa: E402
from workbench.run.model import build_model, tiny  # noqa: E402


def test_a_llama_from_a_config_is_seeded_and_speaks_the_workbench_interface(tmp_path: Path) -> None:
    directory = make_llama(tmp_path / "llama")
    a = hf.load_model(str(directory), seed=0, block_size=64, vocab_size=256)
    b = hf.load_model(str(directory), seed=0, block_size=64, vocab_size=256)
    c = hf.load_model(str(directory), seed=1, block_size=64, vocab_size=256)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)  # every peer starts from the same θ
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))
    x = torch.randint(0, 256, (2, 16))
    logits, loss = a(x, torch.roll(x, -1, 1))
    assert logits.shape == (2, 16, 256) and loss.ndim == 0 and torch.isfinite(loss)
    assert a(x)[1] is None
    loss.backward()  # trainable end to end
    assert a.num_params() == sum(p.numel() for p in a.hf.parameters())


def test_the_fingerprint_tells_models_apart(tmp_path: Path) -> None:
    small = hf.load_model(str(make_llama(tmp_path / "a")), seed=0, block_size=64, vocab_size=256)
    wide = hf.load_model(
        str(make_llama(tmp_path / "b", vocab_size=300)), seed=0, block_size=64, vocab_size=256
    )
    same = hf.load_model(str(make_llama(tmp_path / "c")), seed=0, block_size=64, vocab_size=256)
    preset = build_model(tiny(), seed=0)
    prints = {
        name: model_fingerprint(m, {})
        for name, m in dict(small=small, wide=wide, same=same, preset=preset).items()
    }
    assert prints["small"] == prints["same"]  # same config, another folder: the same model
    assert len({prints["small"], prints["wide"], prints["preset"]}) == 3


def test_saved_weights_are_loaded_not_reinitialized(tmp_path: Path) -> None:
    directory = make_llama(tmp_path / "llama", weights=True)
    import transformers

    saved = transformers.AutoModelForCausalLM.from_pretrained(directory)
    loaded = hf.load_model(str(directory), seed=123, block_size=64, vocab_size=256)
    for pa, pb in zip(saved.parameters(), loaded.hf.parameters()):
        assert torch.equal(pa, pb)


def test_weights_the_folder_lacks_are_seeded_and_weights_of_other_shapes_are_one_line(
    tmp_path: Path, caplog
) -> None:
    """Stop 57, a review: a missing weight (an untied head, a layer the config adds) was
    initialised unseeded, so peers (and the virtual peers of one process) started from
    different θ; weights of other shapes than config.json's raised transformers' RuntimeError
    as a traceback."""
    import json

    directory = make_llama(tmp_path / "llama", weights=True)
    config = json.loads((directory / "config.json").read_text())
    config["num_hidden_layers"] = 3  # a layer the weights do not hold
    (directory / "config.json").write_text(json.dumps(config))
    a = hf.load_model(str(directory), seed=0, block_size=64, vocab_size=256)
    torch.manual_seed(999)  # another process's generator
    b = hf.load_model(str(directory), seed=0, block_size=64, vocab_size=256)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))
    assert "are not in the folder" in caplog.text
    config["num_hidden_layers"], config["vocab_size"] = 2, 300  # weights of 256 rows
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="its weights do not load into the model its config.json describes"):
        hf.load_model(str(directory), seed=0, block_size=64, vocab_size=256)


@pytest.mark.parametrize(
    ("make", "kwargs", "message"),
    [
        pytest.param(lambda d: make_llama(d, vocab_size=100), {}, "vocab_size 100 is smaller", id="vocab"),
        pytest.param(lambda d: make_llama(d, positions=32), {}, "at most 32 positions", id="positions"),
        pytest.param(
            lambda d: (d.mkdir(), (d / "config.json").write_text("{oops"))[0],
            {},
            "not a Hugging Face model config",
            id="bad-json",
        ),
    ],
)
def test_a_model_that_cannot_train_on_the_data_is_a_clear_error(
    tmp_path: Path, make, kwargs, message
) -> None:
    directory = tmp_path / "m"
    make(directory)
    with pytest.raises(ValueError, match=message):
        hf.load_model(str(directory), seed=0, block_size=64, vocab_size=256, **kwargs)


def test_a_config_that_is_not_a_causal_lm_is_refused(tmp_path: Path) -> None:
    import transformers

    transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="causal language model"):
        hf.load_model(str(tmp_path), seed=0, block_size=64, vocab_size=256)


# --- tokenizers and datasets ------------------------------------------------------------------


def test_a_tokenized_corpus_holds_token_ids_of_the_tokenizers_vocabulary(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(tmp_path / "tok")
    data = tmp_path / "words.txt"
    data.write_text("\n".join(documents(300)))
    corpus = ByteCorpus.load(DataConfig(path=str(data), tokenizer=str(tokenizer)))
    assert corpus.train.dtype == torch.int32 and corpus.vocab_size == 12
    assert int(corpus.train.max()) == 11  # the last word's id: the whole vocabulary is used
    assert int((corpus.train == 0).sum()) <= 1  # [UNK] at most where the split cut a word
    x, y = next(corpus.batches(block_size=16, batch_size=4, seed=0))
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])


def test_a_local_jsonl_dataset_shards_records_and_holds_out_the_same_eval_set(tmp_path: Path) -> None:
    directory = make_jsonl_dataset(tmp_path / "ds")
    config = DataConfig(dataset=str(directory))
    shards = [ByteCorpus.load(config, shard=i, num_shards=2) for i in range(2)]
    whole = ByteCorpus.load(config)
    assert torch.equal(shards[0].val, shards[1].val) and torch.equal(shards[0].val, whole.val)
    assert shards[0].presharded and not whole.presharded
    # Disjoint halves of the training records: together they are the whole training split.
    assert len(shards[0].train) + len(shards[1].train) == pytest.approx(len(whole.train), abs=2)
    assert not torch.equal(shards[0].train[:500], shards[1].train[:500])


def test_shards_of_a_dataset_train_on_disjoint_records_and_evaluate_on_the_same_ones() -> None:
    """Counted by record index, 20 shards left shard 19 with eval records only (it then trained on
    them), and 4 shards got 5000, 5000, 5000 and 4000 records; capped by each peer's own bytes,
    the shards stopped at different records and held different eval sets."""
    from workbench.run.hf import dataset_documents

    records = [{"text": f"record {i:05d} " + "x" * (i % 37)} for i in range(4000)]

    def read(shard: int, shards: int, max_bytes: int = 10**9) -> tuple[list[bytes], list[bytes]]:
        out: dict[bool, list[bytes]] = {True: [], False: []}
        for is_eval, data in dataset_documents(
            records,
            text_field="text",
            shard=shard,
            num_shards=shards,
            eval_fraction=0.05,
            max_bytes=max_bytes,
        ):
            out[is_eval].append(data)
        return out[False], out[True]

    for shards in (4, 20):
        parts = [read(i, shards) for i in range(shards)]
        trains = [set(train) for train, _ in parts]
        evals = {tuple(val) for _, val in parts}
        assert len(evals) == 1 and not set().union(*trains) & set(parts[0][1])  # no eval record trained on
        assert max(map(len, trains)) - min(map(len, trains)) <= 1 and sum(map(len, trains)) == 3800
    capped = [read(i, 4, max_bytes=20_000) for i in range(4)]
    assert len({tuple(val) for _, val in capped}) == 1  # the same eval bytes on every shard
    assert all(sum(map(len, train)) <= 19_000 for train, _ in capped)


def test_streaming_reads_the_same_records_as_a_prepared_dataset(tmp_path: Path) -> None:
    directory = make_jsonl_dataset(tmp_path / "ds")
    prepared = ByteCorpus.load(DataConfig(dataset=str(directory)), shard=1, num_shards=3)
    streamed = ByteCorpus.load(DataConfig(dataset=str(directory), streaming=True), shard=1, num_shards=3)
    assert torch.equal(prepared.train, streamed.train) and torch.equal(prepared.val, streamed.val)


def test_a_saved_dataset_folder_loads_and_max_bytes_stops_a_stream_early(tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_dict({"body": documents(400)}).save_to_disk(str(tmp_path / "saved"))
    corpus = ByteCorpus.load(
        DataConfig(dataset=str(tmp_path / "saved"), text_field="body", streaming=True, max_bytes=20_000)
    )
    assert len(corpus.train) + len(corpus.val) <= 20_000 + corpus.num_files  # + the separators
    assert "400" not in corpus.source and "records" in corpus.source


def test_dataset_mistakes_are_clear(tmp_path: Path) -> None:
    directory = make_jsonl_dataset(tmp_path / "ds", field="content")
    with pytest.raises(ValueError, match="no text field 'text'.*content.*--text-field"):
        ByteCorpus.load(DataConfig(dataset=str(directory)))
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.csv").write_text("text\nhello\n")
    (tmp_path / "mixed" / "b.jsonl").write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match="data files of one kind"):
        ByteCorpus.load(DataConfig(dataset=str(tmp_path / "mixed")))
    with pytest.raises(ValueError, match="either --data .* or --dataset"):
        DataConfig(path="x", dataset="y")
    with pytest.raises((ValueError, DataError), match="cannot open dataset"):
        ByteCorpus.load(DataConfig(dataset=str(tmp_path / "no-such-dataset-here")))
    # A bare name that ends like a data file is a local typo, not a hub name tried for a minute.
    with pytest.raises(
        (ValueError, DataError), match="cannot open dataset 'nope.jsonl': no such file or folder"
    ):
        ByteCorpus.load(DataConfig(dataset="nope.jsonl"))
    # An empty file: datasets said "An error occurred while generating the dataset" (stop 71)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(
        (ValueError, DataError), match="empty.jsonl: empty; point --dataset at files with data"
    ):
        ByteCorpus.load(DataConfig(dataset=str(tmp_path / "empty.jsonl")))


def test_the_simulator_trains_the_folder_s_model_on_the_tokenizer_s_ids(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """`workbench simulate --model DIR` stopped with "unknown model preset", and
    `Experiment(backend="sim", model=DIR)` trained the built-in GPT instead of the folder's
    model, silently; --tokenizer and --block-size were not simulate's. Now every virtual peer
    builds what a real peer with the same settings would."""
    import json

    from workbench import Experiment
    from workbench.cli.command import main

    llama, tokenizer = make_llama(tmp_path / "llama"), make_tokenizer(tmp_path / "tok")
    data = tmp_path / "words.txt"
    data.write_text("\n".join(documents(300)))
    built: list[tuple[str, int, int]] = []
    load = hf.load_model

    def spy(path, **kwargs):
        built.append((path, kwargs["block_size"], kwargs["vocab_size"]))
        return load(path, **kwargs)

    monkeypatch.setattr(hf, "load_model", spy)
    common = ["--peers", "2", "--inner-steps", "2", "--steps", "4", "--batch-size", "4", "--block-size", "16"]
    flags = ["--model", str(llama), "--tokenizer", str(tokenizer), "--data", str(data)]
    assert main(["simulate", *flags, *common, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["outer_rounds"] == 2 and result["final_eval_loss"] < result["initial_eval_loss"]
    assert built == [(str(llama), 16, 12)] * 2  # one per virtual peer, sized to the tokenizer
    built.clear()
    run = Experiment(
        backend="sim", peers=2, rounds=1, model=str(llama), tokenizer=str(tokenizer), data=str(data),
        inner_steps=2, batch_size=4, block_size=16,
    ).run().wait(120)  # fmt: skip
    assert run.error is None and built == [(str(llama), 16, 12)] * 2


def test_a_dataset_folders_test_file_is_its_own_split_not_training_data(tmp_path: Path) -> None:
    """Stop 57, a review: every data file of a --dataset folder became the train split: its
    test.jsonl was trained on, `--dataset-split test` was refused, and a notebook's
    .ipynb_checkpoints copy was read twice."""
    import json

    write = lambda path, word: path.write_text(  # noqa: E731
        "".join(json.dumps({"text": f"{word} {i}"}) + "\n" for i in range(20))
    )
    write(tmp_path / "train.jsonl", "train")
    write(tmp_path / "test.jsonl", "TEST")
    (tmp_path / ".ipynb_checkpoints").mkdir()
    write(tmp_path / ".ipynb_checkpoints" / "train-checkpoint.jsonl", "copy")
    train = hf.open_dataset(str(tmp_path), subset=None, split="train", streaming=False)
    assert sorted({r["text"].split()[0] for r in train}) == ["train"] and len(train) == 20
    assert len(hf.open_dataset(str(tmp_path), subset=None, split="test", streaming=False)) == 20
    with pytest.raises(ValueError, match="has no split 'validation' \\(it has: test, train"):
        hf.open_dataset(str(tmp_path), subset=None, split="validation", streaming=False)
    alone = hf.open_dataset(str(tmp_path / "test.jsonl"), subset=None, split="train", streaming=False)
    assert len(alone) == 20  # one file named: whatever its name, the split asked for
    # Slices and sums of splits, as datasets takes them, on a folder and on one file.
    assert len(hf.open_dataset(str(tmp_path), subset=None, split="train[:50%]", streaming=False)) == 10
    assert len(hf.open_dataset(str(tmp_path), subset=None, split="train+test", streaming=False)) == 40
    one = hf.open_dataset(str(tmp_path / "test.jsonl"), subset=None, split="train[:25%]", streaming=False)
    assert len(one) == 5
    only = tmp_path / "only"
    only.mkdir()
    write(only / "val_data.jsonl", "v")  # a folder of one named split: no empty train split
    with pytest.raises(ValueError, match="has no split 'train' \\(it has: validation"):
        hf.open_dataset(str(only), subset=None, split="train", streaming=False)


def test_each_document_of_a_tokenized_corpus_ends_with_end_of_text(tmp_path: Path) -> None:
    """Stop 57, a review: the documents were joined into one text before tokenizing: 200
    records held one end-of-text token between them all."""
    import json

    tokenizer = make_tokenizer(tmp_path / "tok")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(200)))
    corpus = ByteCorpus.load(DataConfig(path=str(data), tokenizer=str(tokenizer)))
    eos = 1  # make_tokenizer's <eos>
    ends = int((corpus.train == eos).sum()) + int((corpus.val == eos).sum())
    assert ends >= 199, ends  # one per record (the split may cut one off)


def test_hugging_face_libraries_log_once_through_the_peers_log(monkeypatch) -> None:
    """huggingface_hub has a handler of its own and propagates too: each of its retry warnings
    (a tokenizer name the hub cannot be reached for) came out twice, raw and formatted."""
    import logging

    from workbench.run import hf

    root = logging.getLogger()
    handler = logging.StreamHandler()
    monkeypatch.setattr(root, "handlers", [handler])
    hub = logging.getLogger("huggingface_hub")
    monkeypatch.setattr(hub, "handlers", [logging.StreamHandler()])
    monkeypatch.setattr(hub, "propagate", True)
    library = logging.getLogger("transformers")  # (put back as found after the test)
    monkeypatch.setattr(library, "handlers", list(library.handlers))
    monkeypatch.setattr(library, "propagate", library.propagate)
    hf._require("transformers")
    assert hub.handlers == [] and hub.propagate
    assert logging.getLogger("transformers").handlers == [] and logging.getLogger("transformers").propagate


def test_a_config_that_makes_no_model_is_one_line_about_the_config(tmp_path: Path) -> None:
    """A config.json with a bad size and no weights said "its weights do not load", and one of an
    unknown model type printed transformers' message over several lines."""
    from workbench.run.hf import load_model

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": -5, "num_hidden_layers": 1, "num_attention_heads": 1, '
        '"intermediate_size": 8, "vocab_size": 256}'
    )
    with pytest.raises(ValueError, match="its config.json does not make a model") as refused:
        load_model(str(bad), seed=0, block_size=8, vocab_size=256)
    assert "\n" not in str(refused.value) and "weights" not in str(refused.value)
    (bad / "config.json").write_text('{"model_type": "bogus"}')
    with pytest.raises(ValueError, match="is not a Hugging Face model config") as refused:
        load_model(str(bad), seed=0, block_size=8, vocab_size=256)
    assert "\n" not in str(refused.value)


def test_a_model_that_sees_the_tokens_it_predicts_is_refused(tmp_path: Path) -> None:
    """transformers builds BertLMHeadModel from a BERT config and only warns: its attention is
    bidirectional (is_decoder false), so next-token training taught it to copy the answer and
    its loss fell for nothing (a review, stop 60)."""
    import transformers

    folder = tmp_path / "bert"
    transformers.BertConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    ).save_pretrained(folder)
    with pytest.raises(ValueError, match=r"sees the tokens it is to predict .*causal \(decoder\) config"):
        hf.load_model(str(folder), seed=0, block_size=16, vocab_size=256)
    assert (
        hf._sees_ahead(
            hf.load_model(str(make_llama(tmp_path / "llama")), seed=0, block_size=16, vocab_size=256)
        )
        is None
    )


@pytest.mark.parametrize("damage", ["cut", "junk-bin"])
def test_a_damaged_weights_file_is_one_line(tmp_path: Path, damage: str) -> None:
    """A model.safetensors cut short was a 50-line SafetensorError traceback; a junk
    pytorch_model.bin an UnpicklingError that advised loading it unsafely."""
    folder = make_llama(tmp_path / "m", weights=True)
    weights = folder / "model.safetensors"
    if damage == "cut":
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        weights.unlink()
        (folder / "pytorch_model.bin").write_bytes(b"not a checkpoint at all" * 10)
    with pytest.raises(
        ValueError, match="a weights file cannot be read .*copy or download it again"
    ) as error:
        hf.load_model(str(folder), seed=0, block_size=16, vocab_size=256)
    assert "\n" not in str(error.value) and "weights_only" not in str(error.value)


def test_a_tokenizer_folder_without_a_tokenizer_is_one_line(tmp_path: Path) -> None:
    """A model folder given as --tokenizer: five lines ending "You need to have sentencepiece or
    tiktoken installed", though nothing was missing but the tokenizer's files."""
    folder = make_llama(tmp_path / "llama")
    with pytest.raises(ValueError, match="the folder holds no tokenizer") as error:
        hf.load_tokenizer(str(folder))
    assert "\n" not in str(error.value)


def test_rotary_embeddings_constants_are_not_said_to_drift(caplog) -> None:
    """Every Llama-style model was warned of two "floating-point buffers (rotary_emb.inv_freq)
    that drift apart between peers": they are constants (not in the state_dict); BatchNorm's
    running statistics are still said."""
    from optim.state import warn_unsynced_buffers

    class Rotary(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("inv_freq", torch.ones(4), persistent=False)
            self.linear = torch.nn.Linear(4, 4)

    assert warn_unsynced_buffers(Rotary()) == []
    assert warn_unsynced_buffers(torch.nn.Sequential(torch.nn.BatchNorm1d(4))) == [
        "0.running_mean", "0.running_var",
    ]  # fmt: skip


def test_a_bare_tokenizer_name_that_is_no_folder_says_the_hub_is_asked(caplog, monkeypatch) -> None:
    """A typo'd folder without ./ was taken for a hub name and, offline, spent about 50 s in the
    hub's retries with nothing said; the peer now says what it asks and how to skip it."""
    import transformers

    def offline(name, **_):
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {name}")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    with caplog.at_level("INFO", logger="workbench.run.hf"), pytest.raises(ValueError):
        hf.load_tokenizer("no-such-tokenizer-folder")
    assert any("asking the Hugging Face hub" in r.getMessage() for r in caplog.records), caplog.text
