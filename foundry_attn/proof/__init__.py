"""The proof: does a layout train each document as it trains alone? Logits, loss and every parameter's gradient.

The proofs of the flat row and of one document per row against stock on each document alone (``prove``); the one
that takes a training batch's own forward as its packed side (``step_proof``); running a model and reading what it
computed (``runs``), what exact means and each document against its run alone (``tolerance``), every parameter and
the influence (``comparison``); the synthetic documents of the proof at attach (``synthetic``); the forwards the
callbacks leave out (``proving``); a forward's autocast and embeddings (``forward_probe``).

The path asks, the proof answers: it takes the model as a :class:`~foundry_attn.proof.subject.Subject` (its one door:
the model's own forward and the stock implementation a block runs under, handed in by the path), the inputs that train
and the truth read from the batch, and returns a :class:`~foundry_attn.proof.result.Proof`. It never imports the
path (:mod:`foundry_attn.path`), whose state a step proof is handed (:class:`~foundry_attn.proof.step_proof.Keeper`),
and it checks the flat row's building blocks (:mod:`foundry_attn.flat`) without deciding anything.

May import: torch, transformers, :mod:`foundry_attn.attention`, :mod:`foundry_attn.selection`,
:mod:`foundry_attn.flat`.
"""
