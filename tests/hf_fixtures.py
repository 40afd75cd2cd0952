"""Hugging Face things the tests make themselves (nothing downloaded): a tiny Llama config, a
word-level tokenizer trained on the spot, and a small dataset on disk."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ["alpha", "beta", "gamma", "delta", "swarm", "peer", "average", "step", "round", "outer"]


def documents(count: int, *, seed: int = 0) -> list[str]:
    """``count`` short documents of the words above, the same for a given seed."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for _ in range(count)]


def make_llama(
    directory: Path, *, vocab_size: int = 256, positions: int = 128, weights: bool = False
) -> Path:
    """A 2-layer, 32-wide Llama config (and, if asked, its weights) in ``directory``."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        tie_word_embeddings=False,
    )
    directory.mkdir(parents=True, exist_ok=True)
    if weights:
        transformers.LlamaForCausalLM(config).save_pretrained(directory)
    else:
        config.save_pretrained(directory)
    return directory


def make_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer over WORDS (plus [UNK] and an end-of-text token), saved as a
    ``transformers`` fast tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="<eos>"
    )
    fast.save_pretrained(directory)
    return directory


def make_jsonl_dataset(directory: Path, *, files: int = 2, records: int = 200, field: str = "text") -> Path:
    """``files`` JSONL files of ``records`` records each, with an extra non-text field."""
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        lines = [json.dumps({field: text, "id": i}) for i, text in enumerate(documents(records, seed=f))]
        (directory / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    return directory
