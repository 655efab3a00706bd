"""Parallel layouts and resharding of the actor's weights between its training
layout (p-t-d) and its generation layout (pg-tg-dg-d).

Not built yet: today the actor generates with the full weights on every rank (the
generation layout with ``tg = 1``, distributed by ``channels.MicroDP(tg=1)``), and the
weights reach the rollout engine through ``TrainingEngine.named_full_weights``. The
package exists so that ``workers`` can depend on it when resharding lands.
"""

__all__: list[str] = []
