"""Bring your own model and data over real peers: a tiny Hugging Face Llama made from a config,
a local `datasets` dataset sharded by record, a tokenizer made here, TensorBoard scalars out."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import FAST, max_abs_diff

pytest.importorskip("transformers")
pytest.importorskip("datasets")


def test_a_tiny_llama_trains_over_two_peers_on_a_sharded_dataset(spawn, tmp_path: Path):
    from tests.hf_fixtures import make_jsonl_dataset, make_llama, make_tokenizer

    llama = make_llama(tmp_path / "llama", vocab_size=16, positions=64)
    tokenizer = make_tokenizer(tmp_path / "tok")
    dataset = make_jsonl_dataset(tmp_path / "corpus", files=2, records=300, field="body")
    assert FAST[:2] == ["--model", "tiny"]
    common = [
        *FAST[2:], "--model", str(llama), "--block-size", "32", "--tokenizer", str(tokenizer),
        "--dataset", str(dataset), "--text-field", "body", "--inner-lr", "3e-3",
        "--rounds", "3", "--min-peers", "2", "--run-id", "byo",
    ]  # fmt: skip
    first = spawn("a", "start", *common, "--shard", "0/2", "--tensorboard")
    second = spawn("b", "join", first.address(), *common, "--shard", "1/2")
    assert first.wait(180) == 0, first.stderr()[-3000:]
    assert second.wait(60) == 0, second.stderr()[-3000:]
    # The printed join command carries the model folder and the tokenizer.
    assert f"--model {llama}" in first.stdout() and f"--tokenizer {tokenizer}" in first.stdout()
    assert "LlamaForCausalLM" in first.stderr() and "shard 1/2" in second.stderr()
    assert max_abs_diff(first.global_params(), second.global_params()) <= 1e-5
    rounds = first.events("round")
    assert [r["group_size"] for r in rounds] == [2, 2, 2]
    done = first.events("done")[0]
    assert done["final_eval_loss"] < done["initial_eval_loss"]
    # TensorBoard scalars next to metrics.jsonl, readable by TensorBoard itself.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(first.directory / "tensorboard"))
    accumulator.Reload()
    assert [s.step for s in accumulator.Scalars("eval_loss")] == [1, 2, 3]


def test_a_joiner_with_another_model_config_is_refused(spawn, tmp_path: Path):
    from tests.hf_fixtures import make_llama

    common = [*FAST[2:], "--block-size", "32", "--run-id", "byo-refuse"]
    first = spawn(
        "a", "start", *common, "--model", str(make_llama(tmp_path / "one", positions=64)), "--min-peers", "2"
    )
    other = spawn(
        "b",
        "join",
        first.address(),
        *common,
        "--model",
        str(make_llama(tmp_path / "two", vocab_size=300, positions=64)),
    )
    assert other.wait(120) != 0
    assert "this peer's model does not match run 'byo-refuse'" in other.stderr(), other.stderr()[-2000:]
    assert "Traceback" not in other.stderr()
