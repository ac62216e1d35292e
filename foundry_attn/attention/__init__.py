"""The attention functions and the documents they take.

Our function per backend (``functions``: FA2 varlen, SDPA and eager per document in a few batches, flex with a document
``BlockMask``, torch's varlen), registered in transformers' attention interface under the names of the backend table
(``backends``, with the stock backends that stand in for ours); a config's values (``config_values``); the documents
of one flat row they receive as an argument (``documents``), those documents grouped by length into the padded batches
sdpa and eager run (``length_groups``), the flex mask cache (``block_masks``), the opaque op
``torch.compile`` sees (``compiled_op``), torch's varlen kernel (``torch_varlen``) and the pure-PyTorch FA2 reference
kernel for CPU runs (``fa2_reference``).

May import: torch, transformers, :mod:`foundry_attn.patching`. Nothing else of ours: everything builds on this.
"""
