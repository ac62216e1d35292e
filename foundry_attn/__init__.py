"""foundry_attn: attention fallback, padding-aware packing and attention inspection for LLM-Foundry.

The core (``guard``, ``capability``, ``policy``, ``backends``, ``loading``, ``packing``, ``layout``, ``documents``,
``adapters``, ``block_masks``, ``torch_varlen``, ``document_op``, ``forward``, ``paths``, ``comparison``, ``proof``,
``unwrap``, ``verdict``, ``deprecation``, ``conformance``, ``sweep``, ``zoo``, ``events``, ``fleet``, ``report``,
``shapes``, ``fa2_reference``, ``reference_kernels``, ``flash_symbols``, ``flash_compat``, ``patching``,
``discovery``, ``inspection``, ``console_table``, ``hf``, ``cli``, ``bench``) imports only torch and transformers
(``report`` draws with matplotlib when asked); ``foundry_attn.foundry`` and ``foundry_attn.callbacks`` hold the
LLM-Foundry / Composer glue; ``hf`` holds the same callbacks for transformers' ``Trainer`` and TRL.
``guard`` runs at every interpreter start (``foundry_attn_guard.pth``): this file must stay free of imports.
"""

__version__ = "0.1.0"
