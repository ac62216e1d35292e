"""foundry_attn: attention fallback, padding-aware packing and attention inspection for LLM-Foundry.

The core (``capability``, ``policy``, ``loading``, ``packing``, ``layout``, ``adapters``, ``document_op``,
``forward``, ``isolation``, ``conformance``, ``events``, ``fleet``, ``report``, ``shapes``, ``fa2_reference``,
``flash_symbols``, ``flash_compat``, ``patching``, ``inspection``, ``cli``) imports only torch and transformers
(``report`` draws with matplotlib when asked); ``foundry_attn.foundry`` and ``foundry_attn.callbacks`` hold the
LLM-Foundry / Composer glue.
"""

__version__ = "0.1.0"
