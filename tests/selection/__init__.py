"""Tests of choosing a backend, and the guarded flash-attn import on real installs (foundry_attn/selection)."""
