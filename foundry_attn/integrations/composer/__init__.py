"""Composer callbacks, registered in ``llmfoundry_callbacks``, one module per registry key: ``attn_decision``,
``attention_inspector``, ``upad_tracer`` (and ``common``, what they share)."""
