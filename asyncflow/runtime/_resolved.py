"""What a future of rows resolves to inside the runtime: the rows' metadata, the
leases that keep their shards alive, and the transforms still to apply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncflow.runtime._transform import BoundTransform
from channels import BatchMeta

if TYPE_CHECKING:
    from asyncflow.runtime._ledger import Lease


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """What a row future resolves to inside the runtime."""

    meta: BatchMeta
    row_lengths: tuple[int, ...] | None
    leases: tuple[Lease, ...]
    transforms: tuple[BoundTransform, ...] = ()

    def narrowed(self, meta: BatchMeta, row_lengths: tuple[int, ...] | None) -> Resolved:
        """These rows narrowed to ``meta`` (a selection of them), keeping only the
        leases of the shards ``meta`` names."""
        named = meta.shard_keys()
        return Resolved(meta=meta, row_lengths=row_lengths, transforms=self.transforms,
                        leases=tuple(le for le in self.leases if (le.worker, le.key) in named))
