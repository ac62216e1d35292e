"""The registered loaders ``foundry_attn_text`` and ``foundry_attn_finetuning``: LLM-Foundry's stock loaders with
our padding-aware collator (``padding: mask | pack | none``); samples count examples, tokens count real tokens."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from composer.core import DataSpec
from composer.core.data_spec import _default_split_batch
from llmfoundry.data.finetuning.dataloader import build_finetuning_dataloader as _stock_finetuning
from llmfoundry.data.text_data import StreamingTextDataset, build_streams
from llmfoundry.data.text_data import build_text_dataloader as _stock_text
from llmfoundry.data.utils import get_tokens_per_batch_func
from streaming import StreamingDataset
from torch.utils.data import DataLoader
from typing_extensions import override

from foundry_attn.checks import check_choice
from foundry_attn.flat.packing import IGNORE_INDEX, PADDING_MODES, PaddingCollator


def _collator(tokenizer: Any, max_seq_len: int, padding: str, overflow: str) -> PaddingCollator:
    if tokenizer is None:
        raise ValueError("a tokenizer is required (set `tokenizer:` in the YAML)")
    return PaddingCollator(tokenizer.pad_token_id, tokenizer.eos_token_id, max_seq_len, padding, overflow)


def _split_packed(batch: Any, microbatch_size: int | float) -> Sequence:
    """Composer's own split; a packed batch often has fewer rows than the microbatch size, by design."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Cannot split .* into batches of size", category=UserWarning)
        return _default_split_batch(batch, microbatch_size)


def _examples_in_batch(batch: Mapping) -> int:
    """Composer's sample clock: examples consumed (a packed batch has fewer rows, a split one more)."""
    return sum(batch["examples"]) if "examples" in batch else int(batch["input_ids"].shape[0])


def _data_spec(dl: DataLoader) -> DataSpec:
    return DataSpec(
        dataloader=dl,
        get_num_tokens_in_batch=get_tokens_per_batch_func(),
        split_batch=_split_packed,
        get_num_samples_in_batch=_examples_in_batch,
    )


class WholeRowTextDataset(StreamingTextDataset):
    """LLM-Foundry's ``StreamingTextDataset`` that hands the collator whole rows, not rows cut to ``max_seq_len``:
    the collator splits or truncates each document (``overflow``), so no token is lost unseen. Its checkpoint state
    records the padding mode; resuming with another one fails with a clear error."""

    def __init__(self, *args: Any, padding: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.padding = padding

    @override
    def _tokenize(self, text_sample: Mapping) -> dict[str, list[int]]:
        if self.tokenizer.pad_token is None:
            raise RuntimeError("tokenizing text on the fly needs a tokenizer with a pad token")
        return self.tokenizer(text_sample["text"], truncation=False, padding=False)

    @override
    def _read_binary_tokenized_sample(self, sample: dict[str, Any]) -> torch.Tensor:
        tokens = sample["tokens"]
        if not isinstance(tokens, np.ndarray):
            tokens = np.frombuffer(tokens, dtype=getattr(np, self.token_encoding_type))
        return torch.from_numpy(tokens.copy()).to(torch.int64)

    @override
    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, Any]:
        """The stock dataset's checkpoint state, with this run's padding mode (``foundry_attn_padding``)."""
        return {**super().state_dict(num_samples, from_beginning), "foundry_attn_padding": self.padding}

    @override
    def load_state_dict(self, obj: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`'s state; a ValueError for one written under another padding mode."""
        saved = obj.get("foundry_attn_padding", "none")
        if saved != self.padding:
            raise ValueError(
                f"foundry_attn_text: this checkpoint was written with padding: {saved}, and this run "
                f"uses padding: {self.padding}; resume with padding: {saved} (the same examples make "
                "different batches under another mode)"
            )
        super().load_state_dict({k: v for k, v in obj.items() if k != "foundry_attn_padding"})


def build_text_dataloader(
    tokenizer: Any,
    device_batch_size: int | float,
    dataset: dict[str, Any],
    padding: str = "mask",
    overflow: str = "split",
    drop_last: bool = False,
    num_workers: int = 0,
    pin_memory: bool = True,
    prefetch_factor: int | None = 2,
    persistent_workers: bool = True,
    timeout: int = 0,
) -> DataSpec:
    """LLM-Foundry's text loader (same keys) with ``padding`` and ``overflow``; rows reach our collator whole.

    Args:
        tokenizer: the run's tokenizer (its pad and EOS tokens).
        device_batch_size: examples per batch on this device.
        dataset: LLM-Foundry's ``dataset`` keys (``local``/``remote``, ``split``, ``max_seq_len``, ``shuffle``, ...).
        padding: ``mask``, ``pack`` or ``none`` (the stock collator).
        overflow: a document longer than ``max_seq_len``: ``split`` or ``truncate``.
        drop_last: drop the last incomplete batch.
        num_workers: DataLoader workers (0: also ``prefetch_factor: null``, ``persistent_workers: false``).
        pin_memory: DataLoader ``pin_memory``.
        prefetch_factor: DataLoader ``prefetch_factor``.
        persistent_workers: DataLoader ``persistent_workers``.
        timeout: DataLoader ``timeout``.

    Returns:
        A Composer ``DataSpec`` counting real tokens, and examples (not packed rows) as samples.

    Example, in an LLM-Foundry YAML::

        train_loader:
          name: foundry_attn_text        # pre-tokenized MDS tokens (or text) datasets
          padding: pack                  # mask | pack | none (none = the stock collator)
          overflow: split                # documents longer than max_seq_len: split | truncate
          dataset: {local: ./build/tiny/text, split: train, max_seq_len: 128, shuffle: true}
    """
    check_choice("padding", padding, PADDING_MODES)
    loader_kwargs = dict(
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
        persistent_workers=persistent_workers,
        timeout=timeout,
    )
    if padding == "none":
        return _stock_text(
            tokenizer=tokenizer, device_batch_size=device_batch_size, dataset=dict(dataset), **loader_kwargs
        )
    cfg = dict(dataset)
    collate = _collator(tokenizer, cfg["max_seq_len"], padding, overflow)
    streams = build_streams(streams=cfg.pop("streams", None))
    allowed = set(inspect.signature(StreamingTextDataset).parameters) | set(
        inspect.signature(StreamingDataset).parameters
    )
    text_dataset = WholeRowTextDataset(
        tokenizer=tokenizer,
        streams=streams,
        batch_size=int(device_batch_size),
        padding=padding,
        **{k: v for k, v in cfg.items() if k in allowed},
    )
    dl = DataLoader(text_dataset, collate_fn=collate, batch_size=int(device_batch_size), **loader_kwargs)
    return _data_spec(dl)


def build_finetuning_dataloader(
    tokenizer: Any,
    device_batch_size: int | float,
    dataset: dict[str, Any],
    padding: str = "mask",
    overflow: str = "split",
    **kwargs: Any,
) -> DataSpec:
    """LLM-Foundry's finetuning loader (same keys: tokenization, prompt masking, splits) with our collator.

    Args:
        tokenizer: the run's tokenizer (its pad and EOS tokens).
        device_batch_size: examples per batch on this device.
        dataset: LLM-Foundry's finetuning ``dataset`` keys (``hf_name``, ``split``, ``max_seq_len``, ...).
        padding: ``mask``, ``pack`` or ``none`` (the stock collator).
        overflow: an example longer than ``max_seq_len``: ``split`` or ``truncate``.
        **kwargs: the stock loader's other keys (``num_workers``, ``drop_last``, ``pin_memory``, ...).

    Returns:
        A Composer ``DataSpec`` counting real tokens, and examples (not packed rows) as samples.

    Example, in an LLM-Foundry YAML::

        train_loader:
          name: foundry_attn_finetuning  # prompt/response data, LLM-Foundry's finetuning keys
          padding: pack
          dataset: {hf_name: ./build/tiny/finetune, split: train, max_seq_len: 128, decoder_only_format: true}
    """
    check_choice("padding", padding, PADDING_MODES)
    spec = _stock_finetuning(tokenizer=tokenizer, device_batch_size=device_batch_size, dataset=dict(dataset), **kwargs)
    if padding == "none":
        return spec
    stock = spec.dataloader
    collate = _collator(tokenizer, dataset["max_seq_len"], padding, overflow)
    dl = DataLoader(
        stock.dataset,
        collate_fn=_FinetuningExamples(collate, tokenizer.eos_token_id),
        batch_size=stock.batch_size,
        sampler=stock.sampler,
        drop_last=stock.drop_last,
        num_workers=stock.num_workers,
        pin_memory=stock.pin_memory,
        prefetch_factor=stock.prefetch_factor if stock.num_workers else None,
        persistent_workers=stock.persistent_workers,
        timeout=stock.timeout,
    )
    return _data_spec(dl)


class _FinetuningExamples:
    """LLM-Foundry's tokenized turns -> ``{input_ids, labels}``: prompts masked, EOS ends the response."""

    def __init__(self, collate: PaddingCollator, eos_id: int | None) -> None:
        self.collate, self.eos_id = collate, eos_id

    def __call__(self, examples: list[dict]) -> dict:
        return self.collate([self._example(e) for e in examples])

    def _example(self, example: dict) -> dict:
        ids: list[int] = []
        labels: list[int] = []
        for turn in example.get("turns") or [example]:
            ids += list(turn["input_ids"]) + list(turn["labels"])
            labels += [IGNORE_INDEX] * len(turn["input_ids"]) + list(turn["labels"])
        if self.eos_id is not None and ids and ids[-1] != self.eos_id:
            ids.append(self.eos_id)
            labels.append(self.eos_id)
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "labels": torch.tensor(labels, dtype=torch.long)}
