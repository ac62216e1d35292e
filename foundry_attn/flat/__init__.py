"""The flat row: a batch read, laid out flat or one document per row, and the model's own forwards.

The collator that makes packed and padded batches (``packing``); the one reader of a batch (``layout``); the inputs
each layout takes (``inputs``); what a layout costs, so the cheapest proven one runs (``layout_cost``); the one
writer of the model's implementation (``implementation``); the forwards attach installs and the model's own a check
runs (``model_forward``); finding the HF model inside training's wrappers (``unwrap``). No state, no decision: the
path (:mod:`foundry_attn.path`) decides, the proof (:mod:`foundry_attn.proof`) checks.

May import: torch, transformers, :mod:`foundry_attn.attention`, :mod:`foundry_attn.selection`.
"""
