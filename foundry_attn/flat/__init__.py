"""The flat path and its proof: a packed batch unpadded once, every document honoured, proven exact.

The collator that makes packed and padded batches (``packing``); the one reader of a batch (``layout``); the
forward that lays a batch out flat or one document per row (``forward``); :func:`~foundry_attn.flat.attach.attach`
(``attach``) and the path it keeps on the model (``state``); which proven layout a batch runs, the cheapest within
the free memory (``layout_cost``); the one writer of the model's implementation
(``implementation``); the forwards attach installs and the model's own a check runs (``model_forward``); the proof
against stock on each document alone (``proof``, ``comparison``, ``step_proof``, ``synthetic``), whose forwards the
callbacks leave out (``proving``); a forward's autocast and embeddings (``forward_probe``); finding the HF model
inside training's wrappers (``unwrap``).

May import: torch, transformers, :mod:`foundry_attn.attention`, :mod:`foundry_attn.selection`.
"""
