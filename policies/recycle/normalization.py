"""Failure normalization (ReCycle Algorithm 1): how many of the failures each pipeline stage should carry.

Rerouting puts a failed worker's micro-batches on the surviving data-parallel peers of its stage; the peers absorb
that work in their pipeline bubbles as long as there are enough of them. Failures concentrated on one stage
overflow its peers' bubbles, while the same number spread over stages may cost nothing. The planner therefore
picks, by dynamic programming over stages, the number of failures per stage that minimises the summed overhead,
and then moves surviving workers between stages to realise it (``rebalance``).

Choices where the algorithm as published is unclear:

- COST. The published cost is ``min(0, MB*f*3 - (DP-f)*(PP-1)*3)`` for f > 0. Read in the algorithm's unit (one
  slot per forward, two per backward, so three per micro-batch): ``MB*f*3`` is the rerouted work of f failed
  workers, ``(DP-f)*(PP-1)*3`` the bubble slots of the DP-f surviving peers in a 1F1B iteration, and the overhead is
  the work the bubbles cannot hold. That is ``max(0, ...)``; ``min`` would make the cost never positive and reward
  leaving bubbles empty, so we read ``min`` as a typo for ``max``.
- A stage whose every worker failed cannot be rerouted at all, so ``COST(f) = inf`` for ``f >= DP``.
- Ties. Many distributions often cost the same (every overflow zero). Moving a worker to another stage interrupts
  training (it must receive that stage's layers and optimizer state), so among the cheapest distributions the
  program picks the one closest to where the failures actually are: the objective is (overhead, workers moved),
  compared lexicographically, which the stage-by-stage recursion still optimises exactly since both terms add up
  over stages.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ftlab.runtime.core.contract import LayerTransfer
from ftlab.runtime.core.plan import Pipeline, Plan, Stage


class NormalizationError(ValueError):
    """More failures than the stages can absorb: some stage would have no surviving worker."""


def cost(failures: int, dp: int, pp: int, mb: int) -> float:
    """Algorithm 1's COST: the time slots of rerouted work that the stage's surviving peers' bubbles cannot hold."""
    if failures >= dp:
        return math.inf
    if failures == 0:
        return 0.0
    return float(max(0, mb * failures * 3 - (dp - failures) * (pp - 1) * 3))


@dataclass(frozen=True)
class Normalization:
    per_stage: tuple[int, ...]
    """The number of failed workers each stage should carry."""
    overhead: float
    """Summed COST over stages, in Algorithm 1's time slots."""
    moves: int
    """How many surviving workers must change stage to get there from the actual failures."""


def normalize_failures(dp: int, pp: int, mb: int, actual: Sequence[int]) -> Normalization:
    """The cheapest spread of ``sum(actual)`` failures over ``pp`` stages; ``actual[s]`` failed in stage s now.

    ``mb`` is the number of micro-batches per pipeline.
    """
    if len(actual) != pp:
        raise ValueError(f"actual failures are given for {len(actual)} stages, the grid has {pp}")
    total = sum(actual)
    if total > pp * (dp - 1):
        raise NormalizationError(
            f"{total} failures in a {pp} x {dp} (stages x pipelines) grid: every stage needs a surviving worker, "
            f"so at most {pp * (dp - 1)} failures can be absorbed; restart from a checkpoint instead"
        )
    # best[f] = ((overhead, moves), per-stage counts) for f failures over the stages seen so far.
    best: list[tuple[tuple[float, int], tuple[int, ...]]] = [((0.0, 0), ())] + [((math.inf, 0), ())] * total
    for stage in range(pp):
        nxt = [((math.inf, 0), ())] * (total + 1)
        for f in range(total + 1):
            for x in range(min(f, dp - 1) + 1):
                (prev_cost, prev_moves), prev = best[f - x]
                candidate = (prev_cost + cost(x, dp, pp, mb), prev_moves + max(0, actual[stage] - x))
                if candidate < nxt[f][0]:
                    nxt[f] = (candidate, prev + (x,))
        best = nxt
    (overhead, moves), per_stage = best[total]
    return Normalization(per_stage, overhead, moves)


def rebalance(grid: Plan, failed: Collection[int], target: Sequence[int]) -> tuple[Plan, tuple[LayerTransfer, ...]]:
    """Move surviving workers so that stage s has ``target[s]`` failed slots.

    A moved worker takes over a failed slot of a stage with too many failures; the grid returned names it there
    and names the failed worker in the slot it left, so rerouting then treats that slot as failed. The moved
    worker receives its new stage's layers from that stage's surviving workers, spread over them.
    """
    slots = [[stage.worker for stage in pipeline.stages] for pipeline in grid.pipelines]
    bounds = [(stage.start, stage.stop) for stage in grid.pipelines[0].stages]
    dead = set(failed)
    actual = [sum(row[s] in dead for row in slots) for s in range(len(bounds))]
    holes_per_pipeline = [sum(w in dead for w in row) for row in slots]
    transfers: list[LayerTransfer] = []
    for j in range(len(bounds)):
        sources = [row[j] for row in slots if row[j] not in dead]
        if actual[j] > target[j] and not sources:
            raise NormalizationError(
                f"every worker of stage {j} (layers {bounds[j][0]}..{bounds[j][1] - 1}) failed: no peer holds "
                f"those layers any more, so only a checkpoint can restore them"
            )
        for _ in range(actual[j] - target[j]):
            hole = next(d for d, row in enumerate(slots) if row[j] in dead)
            donor_stage = next(i for i in range(len(bounds)) if actual[i] < target[i])
            # A survivor of the hole's own pipeline keeps the other pipelines intact; otherwise take one from the
            # pipeline that is broken the most.
            donors = [d for d, row in enumerate(slots) if row[donor_stage] not in dead]
            d = hole if hole in donors else max(donors, key=lambda k: (holes_per_pipeline[k], -k))
            mover = slots[d][donor_stage]
            slots[hole][j], slots[d][donor_stage] = mover, slots[hole][j]
            holes_per_pipeline[hole] -= 1
            holes_per_pipeline[d] += 1
            actual[donor_stage] += 1
            for layer in range(*bounds[j]):
                transfers.append(LayerTransfer(layer, sources[len(transfers) % len(sources)], mover))
    pipelines = tuple(
        Pipeline(tuple(Stage(w, *bounds[s]) for s, w in enumerate(row)), p.microbatches)
        for row, p in zip(slots, grid.pipelines)
    )
    moved = Plan(grid.generation, grid.num_layers, grid.global_batch, grid.micro_batch, pipelines, grid.step)
    return moved, tuple(transfers)
