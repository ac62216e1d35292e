"""foundry_attn: attention fallback, padding-aware packing and attention inspection for LLM-Foundry.

The core (``capability``, ``policy``, ``packing``, ``layout``, ``masks``, ``events``, ``loading``,
``fa2_reference``) imports only torch and transformers; ``foundry_attn.foundry`` and
``foundry_attn.callbacks`` hold the LLM-Foundry / Composer glue.
"""

__version__ = "0.1.0"
