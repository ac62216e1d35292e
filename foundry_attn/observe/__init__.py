"""Observing what attention really did: the same core for the Composer and the Trainer callbacks.

The cores of the inspector and the unpad tracer, which both glues call (``inspector``, ``tracer``); the attention
probe and its console table (``probe``, ``console_table``), where attention sits in a model (``discovery``), whether
packed documents see each other (``verdict``, with its own forwards of a row: ``row_calls``), transformers'
flash-attention symbols (``flash_symbols``) and their call counts (``flash_calls``), per-rank JSONL event logs
(``events``), every rank's decision said once (``ranks``), the fleet view over them (``fleet``) and the HTML report
(``report``, matplotlib from the ``report`` extra).

May import: torch, transformers, :mod:`foundry_attn.attention`, :mod:`foundry_attn.selection`,
:mod:`foundry_attn.flat`.
"""
