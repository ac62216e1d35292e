"""Composer callbacks, registered in ``llmfoundry_callbacks``: attn_decision, attention_inspector, upad_tracer."""
