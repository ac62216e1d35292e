"""One rank of a DDP / FSDP2 run on CPU (gloo): packed documents vs each alone through stock transformers.

    torchrun --nproc_per_node 2 tests/flat/wrapped_worker.py llama sdpa fsdp2 out.json [checkpoint_wrapper]
    torchrun --nproc_per_node 2 tests/flat/wrapped_worker.py llama sdpa ddp out.json plain split   # rows by width
    torchrun --nproc_per_node 2 tests/flat/wrapped_worker.py llama sdpa ddp out.json plain "" compiled

Each rank gets every other document of ``conformance.sample_documents()``, packed. Its loss is scaled by its share
of the targets, so the gradients the wrapper averages are those of the mean loss over all documents, which
rank 0 compares with stock transformers running each document alone. Every attention call is recorded:
the mask it got (the [1, 1, 1, 1] placeholder, never an L x L mask) and whether the documents came with it.
"""

from __future__ import annotations

import faulthandler
import json
import sys

import torch
import torch.distributed as dist
from transformers.modeling_utils import AttentionInterface

from foundry_attn.attention.documents import DOCS_KEY, is_placeholder
from foundry_attn.flat import layout_cost
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents
from foundry_attn.verify import conformance

#: seconds after which a rank prints every thread's stack and exits (a run takes 10-30 s here)
HANG_S = 150


def recorded(name: str, calls: list[bool]) -> None:
    inner = AttentionInterface._global_mapping[name]

    def record(module, query, key, value, attention_mask, **kwargs):  # transformers' signature
        calls.append(is_placeholder(attention_mask) and kwargs.get(DOCS_KEY) is not None)
        return inner(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface._global_mapping[name] = record


def fsdp2_gloo_scale() -> float:
    """What FSDP2 on gloo multiplies an averaged gradient by here: the world size where #162338 bites, else 1."""
    from torch.distributed.fsdp import fully_shard

    probe = torch.nn.Linear(2, 2, bias=False)
    torch.nn.init.ones_(probe.weight)
    fully_shard(probe)
    probe(torch.ones(1, 2)).sum().backward()  # the same input on every rank: the average is the local gradient
    return probe.weight.grad.full_tensor()[0, 0].item()


def main(
    family: str,
    backend: str,
    wrapper: str,
    out: str,
    checkpointing: str = "plain",
    rows: str = "",
    execution: str = "eager",
) -> None:
    """``rows``: one document per row in forwards by width, ``split`` where every rank would split its rows,
    ``agree`` where rank 1 would not (its forward costs more than any split saves): the ranks agree on one.
    ``execution``: ``compiled`` runs the flat step under attach's switch (aot_eager), after a first batch (its proof
    runs eagerly) whose gradients are dropped."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = conformance.build(family, backend)
    calls: list[bool] = []
    if rows:
        layout_cost.FORWARD_OVERHEAD["cpu"] = 1e30 if rows == "agree" and rank == 1 else 0.0
        attach(model, backend, path="rows", fa2_reference=True)
    elif execution != "eager":
        from foundry_attn.path import execution as execution_module

        execution_module.BACKEND = "aot_eager"  # inductor's traced graph and autograd, without its codegen
        attach(model, backend, fa2_reference=True, execution=execution)
    else:
        recorded(attach(model, backend, fa2_reference=True).flat_name, calls)
    conformance.enable_checkpointing(model, checkpointing)
    if wrapper == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in [m for m in model.modules() if type(m).__name__ in model._no_split_modules]:
            fully_shard(layer)
        wrapped = fully_shard(model)
    docs = conformance.sample_documents()
    mine = docs[rank::world]
    targets = sum(d.numel() - 1 for d in docs)
    if execution != "eager":  # the first batch proves (eagerly); the one measured below runs compiled
        forward_documents(wrapped, conformance.collated(mine, "pack")).loss.backward()
        model.zero_grad(set_to_none=True)
    forwards: list[int] = []
    wrapped.register_forward_pre_hook(lambda *_: forwards.append(1))
    loss = forward_documents(wrapped, conformance.collated(mine, "pack")).loss
    counts: list[int] = [0] * world
    dist.all_gather_object(counts, len(forwards))
    share = sum(d.numel() - 1 for d in mine) * world / targets
    (loss * share).backward()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    grad = torch.cat([g.reshape(-1) for g in grads])
    if wrapper == "fsdp2":  # torch 2.7: gloo's reduce-scatter sums where FSDP2 asks for AVG (pytorch/pytorch#162338)
        grad = grad / fsdp2_gloo_scale()
    total = (loss.detach() * share / world).clone()
    dist.all_reduce(total)
    if rank == 0:
        want_loss, want_grad = conformance.truth_alone(family, backend)
        result = dict(
            loss_err=abs(total.item() - want_loss),
            grad_err=((grad - want_grad).norm() / want_grad.norm()).item(),
            calls=len(calls),
            fast=all(calls),
            wrapped=type(wrapped).__name__,
            forwards=counts,
            execution=model.foundry_path.execution.runs,
            eager=model.foundry_path.execution.eager,
        )
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()  # both ranks done before gloo tears down (torch 2.13 aborted a rank still in flight, once)
    dist.destroy_process_group()


if __name__ == "__main__":
    # a rank that hangs (gloo on torch 2.13, at times on a loaded box) prints where and exits: torchrun stops the others
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    main(*sys.argv[1:])
