"""Verification tools: the conformance matrix, the zoo of every causal-LM type transformers ships, its sweeps.

Tiny random configs for every model type (``zoo``) and the Llama shapes of the demo and benches
(``llama_shapes``); every (family, backend) pair against stock, exact or refused (``conformance``); the zoo sweep
behind ``foundry-attn zoo`` (``sweep``). Runtime code never imports this folder.

May import: everything in the core (:mod:`foundry_attn.attention` .. :mod:`foundry_attn.observe`).
"""
