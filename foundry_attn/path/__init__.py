"""The path a model runs, flat or rows, and why: attach, the per-batch plan, and the forward that acts on it.

:func:`~foundry_attn.path.attach.attach` (``attach``: the chain walked, the path proven at the door); the path kept on
the model and its one per-batch plan (``state``); the forward that lays a batch out as the plan says
(``forward``: :func:`~foundry_attn.path.forward.forward_documents`). The path asks the proof
(:mod:`foundry_attn.proof`) whether a layout is exact, and acts on the answer.

May import: torch, transformers, :mod:`foundry_attn.attention`, :mod:`foundry_attn.selection`,
:mod:`foundry_attn.flat`, :mod:`foundry_attn.proof`.
"""
