"""What the ranks of a multi-process run agree on, so each pairs its collectives with the others'.

    world()                        # the processes of this run (1 without torch.distributed)
    agreed_lengths((41, 28), hf)   # the longest over the ranks of a sharded model: every rank proves the same batches
    fewest(3, hf)                  # the fewest forwards any rank would run a batch's rows in

Core module: torch only.
"""

from __future__ import annotations

from typing import Any

import torch


def world() -> int:
    """The processes of this run (1 without torch.distributed).

    Returns:
        The world size, or 1.

    Example::

        >>> world()
        1
    """
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agreed_lengths(lengths: tuple[int, int], hf: Any) -> tuple[int, int]:
    """The longest ``lengths`` over the ranks of a sharded model (FSDP2: its parameters are DTensors), so every rank
    proves the same batches and all-gathers as often as the others; this rank's own elsewhere (DDP's proofs run the
    inner module, with no collective).

    Args:
        lengths: this rank's (flat row, longest document) lengths.
        hf: the transformers model.

    Returns:
        The lengths every rank proves against (one all-reduce where the parameters are sharded).

    Example::

        >>> agreed_lengths((41, 28), hf_model)     # one process
        (41, 28)
    """
    if world() == 1:
        return lengths
    from torch.distributed.tensor import DTensor

    param = next(hf.parameters())
    if not isinstance(param, DTensor):
        return lengths
    import torch.distributed as dist

    values = torch.tensor(lengths, dtype=torch.long, device=param.to_local().device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return int(values[0]), int(values[1])


def sharded(hf: Any) -> bool:
    """Whether the model's parameters are sharded (FSDP2's DTensors, FSDP1's wrapped modules or flat parameters): its
    forwards all-gather, so a rank's forwards pair with the others' one by one.

    Args:
        hf: the transformers model.

    Returns:
        True where its forwards all-gather.

    Example::

        >>> sharded(hf_model)
        False
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    param = next(hf.parameters(), None)
    if param is None or isinstance(param, DTensor) or getattr(param, "_is_flat_param", False):
        return True
    return any(isinstance(m, FullyShardedDataParallel) for m in hf.modules())


def fewest(count: int, hf: Any) -> int:
    """The fewest ``count`` over the ranks (one all-reduce, on the parameters' device).

    Args:
        count: this rank's count (the forwards its batch's rows would run in).
        hf: the transformers model (its parameters' device carries the all-reduce).

    Returns:
        The smallest count of any rank.

    This example is not run here: it needs a multi-process run (an initialized process group, another rank).

    Example::

        >>> fewest(3, hf_model)     # another rank would run 1  # doctest: +SKIP
        1
    """
    import torch.distributed as dist

    value = torch.tensor([count], dtype=torch.long, device=next(hf.parameters()).device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value[0])
