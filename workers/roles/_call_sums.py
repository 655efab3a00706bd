"""Sums over every row of a group call, for transforms that need statistics of the
whole batch (e.g. advantage whitening) while each rank holds only its share.

A transform runs on each consumer rank over that rank's rows. To whiten over the
whole batch it sums its partial statistics over the ranks with
:func:`sum_over_call_rows`: an all-reduce over the called role's pool group, to which
each row contributes once (the ranks of a tensor/pipeline-parallel replica hold the
same rows, and only the replica's output rank counts them). The rows stay where they
are; only a few numbers travel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from channels import ConfigError
from workers.host import current_call


def sum_over_call_rows(partial: Tensor) -> Tensor:
    """Add up ``partial`` (a sum over this rank's rows) over every rank of the call
    whose transforms are running, counting each row once.

    Collective over the called role's pool when its rows are split over several
    ranks: every rank of the call must call it, in the same order, with the same
    shape, also a rank with no rows (it passes zeros). Outside a worker's call (on
    the driver, which holds every row) and when each rank holds every row, it
    returns ``partial`` unchanged.

    Args:
        partial: this rank's partial sums (any shape and float dtype).

    Returns:
        The sums over the whole batch, on ``partial``'s device, equal on every rank.

    Raises:
        ConfigError: the call is rank-local (it may run on some ranks only, so a
            collective could wait forever); map the transform onto a method that
            is not rank-local.
    """
    call = current_call()
    if call is None or call.ctx.world_size == 1 or call.ctx.process_group is None:
        return partial
    counting = call.protocol.counting_ranks(call.ctx.layout)
    if counting is None:
        return partial
    if call.rank_local:
        raise ConfigError(
            f"a transform sums over every row of {call.ctx.role}'s call, but that method is rank-local "
            "(it may run on some ranks only); map the transform onto a method that runs on every rank, "
            "e.g. the update that consumes the rows"
        )
    device = call.ctx.device
    total = (partial if counting[call.ctx.rank] else torch.zeros_like(partial)).to(device).clone()
    dist.all_reduce(total, group=call.ctx.process_group)
    return total.to(partial.device)
