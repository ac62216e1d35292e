"""The isolation probe: do packed documents really not see each other, in this model, with this backend?

    model:
      name: foundry_attn_causal_lm
      attn_isolation_check: true     # default; a backend that fails it is rejected (strict: the build fails)

Two short documents run packed in one row and each alone, through the real model and its attention path
(``forward_documents``), in eval mode without gradients. If any logit differs by more than the tolerance
the backend leaks across documents: an untested model class or a future transformers that drops our
per-call arguments is caught before training, not after. Core module: torch and transformers only.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from foundry_attn.forward import forward_documents, repad_logits

LENGTHS = (6, 9)
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6}  # half precision: 5e-2


def isolation_check(model: Any, lengths: tuple[int, ...] = LENGTHS) -> tuple[str | None, float]:
    """``(why it failed or None, milliseconds)``; raises nothing the model itself does not raise."""
    start = time.perf_counter()
    param = next(model.parameters())
    gen = torch.Generator().manual_seed(0)
    high = max(2, min(int(model.config.vocab_size), 1000))
    docs = [torch.randint(1, high, (n,), generator=gen).to(param.device) for n in lengths]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = repad_logits(
                forward_documents(model, {"input_ids": torch.cat(docs)[None], "doc_lens": [list(lengths)]})
            )[0]
            worst, offset = 0.0, 0
            for doc in docs:
                alone = forward_documents(model, {"input_ids": doc[None], "doc_lens": [[doc.numel()]]}).logits[0]
                got = packed[offset : offset + doc.numel()]
                worst = max(worst, (got.float() - alone.float()).abs().max().item())
                offset += doc.numel()
    finally:
        model.train(was_training)
    ms = (time.perf_counter() - start) * 1e3
    tolerance = TOLERANCE.get(param.dtype, 5e-2)
    if not worst <= tolerance:  # also catches nan
        return (
            f"isolation probe: a packed document's logits differ from the same document alone by {worst:.2e} "
            f"(> {tolerance:g}): documents see each other under {model.config._attn_implementation}"
        ), ms
    return None, ms
