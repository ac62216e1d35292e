"""The integrations: the only code that imports Composer, LLM-Foundry, accelerate or TRL.

``llm_foundry``: the registered model ``foundry_attn_causal_lm``, the dataloaders and the tiny offline assets;
``composer``: the registered Composer callbacks; ``hf_trainer``: the same callbacks for transformers' ``Trainer``
and TRL. Registry entry points name these modules, so YAML names work after ``pip install``.

May import: everything else in the package but the benches.
"""
