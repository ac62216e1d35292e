"""Tiny offline assets made by our own code, nothing fetched (``foundry-attn assets build/tiny``): a word-level
tokenizer (pad == EOS on purpose), tiny Llama and SmolLM2-135M configs, MDS text rows and finetuning pairs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from foundry_attn.verify.llama_shapes import SMOLLM2_135M_SHAPE, SMOLLM2_VOCAB, TINY_SHAPE, llama_config

EOS = "<|endoftext|>"
UNK = "<unk>"
_NOUNS = "cat dog bird fox owl cow pig hen bee ant frog fish bear wolf deer goat duck lamb mole seal".split()
_ADJS = "red big old shy odd calm quick slow tall small warm cold dark pale loud soft".split()
_VERBS = "sees likes chases finds meets helps follows hears feeds greets watches calls".split()
WORDS = ["the", "a", "and", ".", "?", "what", "who", "does", "answer", ":", *_NOUNS, *_ADJS, *_VERBS]


def sentence(rng: random.Random) -> str:
    """One random sentence of the tiny vocabulary.

    Args:
        rng: the random source.

    Returns:
        The sentence, words separated by spaces.

    Example::

        >>> sentence(random.Random(0))
        'the dark wolf sees a tall duck .'
    """
    return (
        f"the {rng.choice(_ADJS)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} "
        f"a {rng.choice(_ADJS)} {rng.choice(_NOUNS)} ."
    )


def _document(rng: random.Random, max_sentences: int) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(1, max_sentences)))


def build_tokenizer(out: Path):
    """A word-level fast tokenizer whose pad token is its EOS token, saved to ``out``.

    Args:
        out: the folder it is saved to.

    Returns:
        The ``PreTrainedTokenizerFast`` (60 tokens, ``<|endoftext|>`` at id 0).

    Example::

        >>> tok = build_tokenizer(Path("build/tiny/tokenizer"))
        >>> len(tok), tok.pad_token_id, tok.eos_token_id
        (60, 0, 0)
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([EOS, UNK, *WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=UNK)
    tok.save_pretrained(out)
    return tok


def write_text_mds(out: Path, tokenizer, n_rows: int, max_seq_len: int, seed: int) -> None:
    """MDS ``tokens`` rows, one real document each (ending in EOS), padded with EOS to ``max_seq_len``.

    Args:
        out: the MDS folder written.
        tokenizer: the tokenizer of :func:`build_tokenizer`.
        n_rows: how many rows.
        max_seq_len: the length of every row.
        seed: the seed of the documents.

    Example::

        >>> write_text_mds(Path("build/tiny/text/train"), tok, n_rows=512, max_seq_len=128, seed=0)
    """
    from streaming import MDSWriter

    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    with MDSWriter(columns={"tokens": "ndarray:int32"}, out=str(out), compression=None) as writer:
        for _ in range(n_rows):
            ids = [*tokenizer(_document(rng, 6), add_special_tokens=False)["input_ids"][: max_seq_len - 1], eos]
            row = np.full(max_seq_len, eos, dtype=np.int32)
            row[: len(ids)] = ids
            writer.write({"tokens": row})


def write_finetune_jsonl(path: Path, n: int, seed: int) -> None:
    """Prompt/response pairs, one JSON object a line.

    Args:
        path: the ``.jsonl`` file written.
        n: how many pairs.
        seed: the seed of the pairs.

    Example::

        >>> write_finetune_jsonl(Path("build/tiny/finetune/train.jsonl"), n=512, seed=2)
    """
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            noun, adj = rng.choice(_NOUNS), rng.choice(_ADJS)
            prompt = f"what does the {adj} {noun} see ?"
            response = f"answer : the {adj} {noun} sees a {rng.choice(_ADJS)} {rng.choice(_NOUNS)} ."
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")


def build_assets(out: str | Path, max_seq_len: int = 128, train_rows: int = 512, val_rows: int = 64) -> Path:
    """Every tiny asset written under ``out`` (existing MDS folders are replaced).

    Args:
        out: the folder to write.
        max_seq_len: the length of every text row.
        train_rows: text rows and finetuning pairs in ``train``.
        val_rows: text rows and finetuning pairs in ``val``.

    Returns:
        ``out`` as a ``Path``.

    Example::

        >>> build_assets("build/tiny")  # the CLI: foundry-attn assets build/tiny
        PosixPath('build/tiny')
    """
    import shutil

    out = Path(out)
    tokenizer = build_tokenizer(out / "tokenizer")
    vocab = (len(tokenizer) + 63) // 64 * 64
    llama_config(vocab, **TINY_SHAPE).save_pretrained(out / "tiny-llama")
    llama_config(SMOLLM2_VOCAB, **SMOLLM2_135M_SHAPE).save_pretrained(out / "smollm2-135m")
    for split, rows, seed in (("train", train_rows, 0), ("val", val_rows, 1)):
        shutil.rmtree(out / "text" / split, ignore_errors=True)
        write_text_mds(out / "text" / split, tokenizer, rows, max_seq_len, seed)
    (out / "finetune").mkdir(parents=True, exist_ok=True)
    write_finetune_jsonl(out / "finetune" / "train.jsonl", train_rows, 2)
    write_finetune_jsonl(out / "finetune" / "val.jsonl", val_rows, 3)
    return out
