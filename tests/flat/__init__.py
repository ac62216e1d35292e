"""Tests of the collator, the flat path and its proof, under every wrapper (foundry_attn/flat)."""
