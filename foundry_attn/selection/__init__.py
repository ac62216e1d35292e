"""Choosing a backend: FA2 -> torch_varlen -> SDPA -> eager, decided from checks.

What this machine and install can run (``capability``), what a model asks of a kernel (``traits``), whether one
backend runs here (``backend_checks``), the fallback chain and its decision (``policy``), flash-attn and
TransformerEngine across their releases (``flash_compat``), and from a model path to one decision: compute dtype and
load checks (``decision``).

May import: torch, transformers (lazily: ``policy`` imports without it), :mod:`foundry_attn.attention`,
:mod:`foundry_attn.guard`.
"""
