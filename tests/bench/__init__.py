"""Tests of the benchmarks, untimed: their plumbing and their exactness checks (foundry_attn/bench)."""
