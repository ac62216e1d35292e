"""Tests of the conformance matrix, the zoo and its sweeps (foundry_attn/verify)."""
