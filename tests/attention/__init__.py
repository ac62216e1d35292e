"""Tests of the attention functions and the documents they take (foundry_attn/attention)."""
