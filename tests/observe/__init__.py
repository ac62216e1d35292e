"""Tests of the probe, the verdict, the flash symbols, the event logs and their views (foundry_attn/observe)."""
