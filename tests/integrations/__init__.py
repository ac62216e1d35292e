"""Tests of LLM-Foundry, Composer and the Trainer/TRL glue, in real runs (foundry_attn/integrations)."""
