"""What ``foundry-attn bench gpu`` trains on: its three batches, and the model and settings they run through.

The batches (:func:`workloads`: ``a_report``, ``b_no_padding``, ``c_mix``, see :mod:`foundry_attn.bench.gpu`) as
:class:`Workload` (token ids, each row's document lengths, the padded, masked and documents forms of one batch);
:class:`Settings` (CUDA: SmolLM2-135M's shapes, or another of ``llama_shapes.SHAPES``, in bf16; CPU: a tiny model in
fp32) and :func:`build_model`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import torch

from foundry_attn.flat.packing import IGNORE_INDEX
from foundry_attn.verify.llama_shapes import BLOG_LENGTHS, SHAPES, TINY_SHAPE, llama_config

REPORT_LENGTHS = BLOG_LENGTHS
ROWS, WIDTH, CPU_WIDTH, CPU_VOCAB = 6, 2048, 128, 512
PAD_ID, SEED = 0, 0
MIX_MEDIAN, MIX_SIGMA, MIX_MIN = 0.15, 1.0, 64  # lognormal: median 15% of a row, clipped to 64..width (at 2048)
DEFAULT_SHAPE = "smollm2-135m"


# ---- workloads ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Workload:
    """One batch: ``rows`` x ``width`` token ids, per row its documents' lengths (real tokens first)."""

    name: str
    title: str
    doc_lens: list[list[int]]
    width: int
    ids: torch.Tensor

    @property
    def real_tokens(self) -> int:
        return sum(sum(row) for row in self.doc_lens)

    @property
    def positions(self) -> int:
        return self.ids.numel()

    @property
    def one_document_per_row(self) -> bool:
        return all(len(row) <= 1 for row in self.doc_lens)

    def _labels(self, starts_too: bool) -> torch.Tensor:
        labels = torch.full_like(self.ids, IGNORE_INDEX)
        for r, row in enumerate(self.doc_lens):
            used = sum(row)
            labels[r, :used] = self.ids[r, :used]
            if starts_too:  # the targets ours has: no document predicts the next one's first token
                start = 0
                for n in row:
                    labels[r, start] = IGNORE_INDEX
                    start += n
        return labels

    def real_mask(self) -> torch.Tensor:
        used = torch.tensor([sum(row) for row in self.doc_lens])
        return (torch.arange(self.width)[None, :] < used[:, None]).long()

    def batches(self, device: torch.device) -> dict[str, dict[str, Any]]:
        """``padded``: stock, no mask; ``masked``: stock with a 2-D mask; ``documents``: ours (``doc_lens``);
        ``flattened``: stock padding-free, as transformers' ``DataCollatorWithFlattening`` gives it (every document in
        one row, ``position_ids`` restarting, each document's first token no target)."""
        ids, labels = self.ids.to(device), self._labels(starts_too=True).to(device)
        real = labels.new_tensor([sum(row) for row in self.doc_lens])
        keep = torch.arange(self.width, device=device)[None, :] < real.to(device)[:, None]
        positions = torch.cat([torch.arange(n) for row in self.doc_lens for n in row]).to(device)
        return {
            "flattened": {"input_ids": ids[keep][None], "position_ids": positions[None], "labels": labels[keep][None]},
            "padded": {"input_ids": ids, "labels": labels},
            "masked": {"input_ids": ids, "attention_mask": self.real_mask().to(device), "labels": labels},
            "documents": {
                "input_ids": ids,
                "labels": self._labels(starts_too=False).to(device),
                "doc_lens": [list(row) for row in self.doc_lens],
            },
        }

    def repeated(self, k: int) -> Workload:
        """``k`` copies of this batch stacked: ``k`` x its rows, the same documents (equal memory's multiples)."""
        return Workload(self.name, f"{k} x {self.name}", self.doc_lens * k, self.width, self.ids.repeat(k, 1))

    def describe(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "rows": len(self.doc_lens),
            "width": self.width,
            "doc_lens": self.doc_lens,
            "documents": sum(len(row) for row in self.doc_lens),
            "real_tokens": self.real_tokens,
            "positions": self.positions,
            "fill": self.real_tokens / self.positions,
            "limit_vs_padded_dense": self.positions / self.real_tokens,
        }


def scaled(lengths: tuple[int, ...], width: int) -> list[int]:
    """Lengths at 2048 scaled to rows of ``width`` (the CPU run's shorter rows keep the same fill)."""
    return [max(1, round(n * width / WIDTH)) for n in lengths]


def mix_lengths(width: int, rows: int = ROWS, seed: int = SEED) -> list[list[int]]:
    """Seeded lognormal lengths packed in order into ``rows`` rows of ``width``; a row closes (padded) when the
    next document does not fit, and the document that does not fit the last row ends the batch."""
    rng = random.Random(seed)
    out: list[list[int]] = [[]]
    used = 0
    shortest = scaled((MIX_MIN,), width)[0]
    while True:
        n = int(min(width, max(shortest, round(rng.lognormvariate(math.log(MIX_MEDIAN * width), MIX_SIGMA)))))
        if used + n > width:
            if len(out) == rows:
                return out
            out.append([])
            used = 0
        out[-1].append(n)
        used += n


def workloads(width: int, vocab: int, seed: int = SEED) -> list[Workload]:
    """The three batches, token ids seeded (1..vocab-1, padding 0); rows shorter than 2048 (the CPU run) get the
    report's lengths scaled to them."""
    report = scaled(REPORT_LENGTHS, width)
    layouts = {
        "a_report": (
            f"(a) the public report: 6 rows x {width}, one document each, real "
            f"{', '.join(map(str, report))}" + ("" if width == WIDTH else " (scaled from 2048)"),
            [[n] for n in report],
        ),
        "b_no_padding": ("(b) no padding: 6 documents of a full row each", [[width] for _ in range(ROWS)]),
        "c_mix": (
            "(c) a realistic mix: seeded lognormal lengths packed in order, rows padded",
            mix_lengths(width, ROWS, seed),
        ),
    }
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, (title, doc_lens) in layouts.items():
        ids = torch.full((ROWS, width), PAD_ID, dtype=torch.long)
        for r, row in enumerate(doc_lens):
            ids[r, : sum(row)] = torch.randint(1, vocab, (sum(row),), generator=gen)
        out.append(Workload(name, title, doc_lens, width, ids))
    return out


# ---- the model ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    device: str
    dtype: str
    layers: int
    width: int
    vocab: int
    rounds: int
    warmup: int
    quick: bool
    model: str = DEFAULT_SHAPE  # a name of llama_shapes.SHAPES (CUDA); the CPU builds TINY_SHAPE

    @classmethod
    def make(
        cls, device: torch.device, quick: bool, layers: int | None, rounds: int | None, shape: str | None = None
    ) -> Settings:
        cuda = device.type == "cuda"
        model = shape or DEFAULT_SHAPE
        if model not in SHAPES:
            raise ValueError(f"foundry-attn bench gpu: unknown --shape {model!r}; valid: {', '.join(SHAPES)}")
        base, vocab = SHAPES[model] if cuda else (TINY_SHAPE, CPU_VOCAB)
        default_rounds = (3 if cuda else 2) if quick else (10 if cuda else 5)
        return cls(
            device=str(device),
            dtype="bfloat16" if cuda else "float32",
            layers=layers or base["num_hidden_layers"],
            width=WIDTH if cuda else CPU_WIDTH,
            vocab=vocab,
            rounds=rounds or default_rounds,
            warmup=1 if quick else 2,
            quick=quick,
            model=model,
        )

    @property
    def shape(self) -> dict[str, Any]:
        base = SHAPES[self.model][0] if self.device.startswith("cuda") else TINY_SHAPE
        return {
            **base,
            "num_hidden_layers": self.layers,
            "max_position_embeddings": max(base["max_position_embeddings"], self.width),
        }


def build_model(settings: Settings) -> torch.nn.Module:
    """Random init (seed 0) on the CPU in fp32, then moved and cast; train mode, dropout 0."""
    from transformers import LlamaForCausalLM

    config = llama_config(
        settings.vocab, **settings.shape, attention_dropout=0.0, use_cache=False, attn_implementation="sdpa"
    )
    torch.manual_seed(SEED)
    model: Any = LlamaForCausalLM(config)
    return model.to(device=settings.device, dtype=getattr(torch, settings.dtype)).train()
