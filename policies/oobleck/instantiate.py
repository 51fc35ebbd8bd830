"""Pipeline instantiation (Oobleck, SOSP'23, Section 4.2): how many pipelines of each template use all N nodes.

The paper enumerates every feasible combination with a coin-change dynamic program (Eq. 5) and scores each by
running batch distribution on it. The number of combinations grows like the partitions of N (hundreds of
thousands at N = 128), so we solve one integer program over the template counts instead:

    maximise   sum_n x_n * rate_n                (micro-batches per second of all pipelines)
    subject to sum_n x_n * n = N                 (all nodes are used)
               sum_n x_n >= f + 1                (fault threshold)
               sum_n x_n <= B / b                (optional: every pipeline gets a micro-batch)
               x_n integer >= 0

``rate_n`` is a template's throughput at the planning batch ``Nb = 4 S``, the paper's assumption that makes
pipeline bubbles negligible; the batch distributor then balances the real batch over the chosen pipelines.
Among equally fast choices the one with more pipelines wins (a tiny bonus per pipeline): more replicas tolerate
more failures in place and shallower pipelines idle less when the batch is small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import pyomo.environ as pyo
from pyomo.opt import TerminationCondition

from ftlab.policies.oobleck.templates import PipelineTemplate, TemplateSet

MILP_SOLVER = "appsi_highs"
PIPELINE_BONUS = 1e-6  # relative to the slowest template's rate: breaks ties only


class InstantiationError(ValueError):
    """No combination of templates uses these nodes; the message says what would."""


@dataclass(frozen=True)
class PipelineInstance:
    """A pipeline built from ``template`` on ``nodes`` (the node id at each position of the template)."""

    template: PipelineTemplate
    nodes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.nodes) != self.template.num_nodes:
            raise ValueError(f"a {self.template.num_nodes}-node template cannot run on nodes {self.nodes}")

    @cached_property
    def held(self) -> tuple[tuple[tuple[int, int], range], ...]:
        """((node id, local GPU), layers) of every GPU of the pipeline: kept, as every reconfiguration asks."""
        return tuple(((self.nodes[position], gpu), layers) for position, gpu, layers in self.template.slots)


def instantiate(templates: TemplateSet, num_nodes: int, max_pipelines: int | None = None) -> dict[int, int]:
    """Pipelines per template size (only sizes used) maximising throughput on exactly ``num_nodes`` nodes."""
    least = templates.fault_threshold + 1
    if num_nodes < least * templates.min_nodes:
        raise InstantiationError(
            f"{num_nodes} nodes cannot hold f + 1 = {least} pipelines of at least {templates.min_nodes} nodes"
        )
    if max_pipelines is not None and max_pipelines < least:
        raise InstantiationError(
            f"{max_pipelines} micro-batches cannot feed f + 1 = {least} pipelines: raise the global batch to at "
            f"least {least} micro-batches"
        )
    sizes = tuple(n for n in templates.sizes if n <= num_nodes)
    rates = tuple(templates.for_nodes(n).rate for n in sizes)
    return dict(_solve(sizes, rates, least, num_nodes, max_pipelines))


@lru_cache(maxsize=1024)
def _solve(
    sizes: tuple[int, ...], rates: tuple[float, ...], least: int, num_nodes: int, max_pipelines: int | None
) -> tuple[tuple[int, int], ...]:
    """The integer program, kept by its inputs: a cluster that loses and regains nodes (a spot trace, a
    simulated day) asks the same few questions hundreds of times, and each solve takes HiGHS tens of ms."""
    rate = dict(zip(sizes, rates))
    bonus = PIPELINE_BONUS * min(rate.values())

    model = pyo.ConcreteModel()
    model.x = pyo.Var(sizes, domain=pyo.NonNegativeIntegers, bounds=lambda _, n: (0, num_nodes // n))
    model.all_nodes = pyo.Constraint(expr=sum(n * model.x[n] for n in sizes) == num_nodes)
    pipelines = sum(model.x[n] for n in sizes)
    model.replicas = pyo.Constraint(expr=pipelines >= least)
    if max_pipelines is not None:
        model.fed = pyo.Constraint(expr=pipelines <= max_pipelines)
    model.throughput = pyo.Objective(expr=sum((rate[n] + bonus) * model.x[n] for n in sizes), sense=pyo.maximize)
    result = pyo.SolverFactory(MILP_SOLVER).solve(model, load_solutions=False)
    if result.solver.termination_condition != TerminationCondition.optimal:
        raise InstantiationError(
            f"no combination of {sizes[0]}..{sizes[-1]}-node templates uses exactly {num_nodes} nodes in "
            f"{least}..{max_pipelines or 'any'} pipelines ({result.solver.termination_condition})"
        )
    model.solutions.load_from(result)
    counts = {n: round(pyo.value(model.x[n])) for n in sizes}
    return tuple((n, c) for n, c in counts.items() if c)


def assign_nodes(templates: TemplateSet, counts: dict[int, int], node_ids: Sequence[int]) -> list[PipelineInstance]:
    """Lay the pipelines out on ``node_ids`` in order, largest templates first."""
    if sum(n * c for n, c in counts.items()) != len(node_ids):
        raise ValueError(f"pipelines of {counts} nodes do not use exactly the {len(node_ids)} nodes {list(node_ids)}")
    nodes = sorted(node_ids)
    out, at = [], 0
    for size in sorted(counts, reverse=True):
        for _ in range(counts[size]):
            out.append(PipelineInstance(templates.for_nodes(size), tuple(nodes[at : at + size])))
            at += size
    return out
