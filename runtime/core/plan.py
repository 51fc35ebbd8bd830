"""A Plan says who holds what for one generation of the cluster.

Plans are plain data: they travel to workers, are logged to MLflow as JSON, and are what policies produce and the
simulator consumes. A worker is named by a stable integer id (``node * workers_per_node + local_index``) that does
not change across generations; ranks inside a generation's process groups are derived from the plan.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property


class PlanError(ValueError):
    """A plan that cannot be executed; the message says what to change."""


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a worker holding the contiguous layers ``[start, stop)``."""

    worker: int
    start: int
    stop: int

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)


@dataclass(frozen=True)
class Pipeline:
    """A chain of stages covering every layer once, and the global micro-batch ids it processes."""

    stages: tuple[Stage, ...]
    microbatches: tuple[int, ...]

    @cached_property
    def workers(self) -> tuple[int, ...]:
        return tuple(stage.worker for stage in self.stages)

    @cached_property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """Each stage's layers ``(start, stop)``."""
        return tuple((stage.start, stage.stop) for stage in self.stages)

    @cached_property
    def chain_stop(self) -> int | None:
        """Where the stages stop when they are non-empty and each starts where the one before stops, from layer 0;
        None otherwise. Kept: successive plans share most of their pipelines, and a plan checks each of them."""
        expected = 0
        for start, stop in self.spans:
            if start != expected or stop <= start:
                return None
            expected = stop
        return expected if self.stages else None


@dataclass(frozen=True)
class Plan:
    generation: int
    num_layers: int
    global_batch: int
    micro_batch: int
    pipelines: tuple[Pipeline, ...]
    step: int = 0
    """The first step this plan trains (the step every worker's state is at)."""
    notes: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // self.micro_batch

    @cached_property
    def workers(self) -> tuple[int, ...]:
        """Every worker in the plan, sorted; a worker's index here is its rank in the generation's group.

        A worker may serve several pipelines (ReCycle reroutes a failed worker's micro-batches to a data-parallel
        peer, which then appears at the same stage of another pipeline); it is listed once.
        """
        return tuple(sorted({w for p in self.pipelines for w in p.workers}))

    def stages(self) -> Iterator[tuple[int, int, Stage]]:
        """(pipeline index, stage index, stage) for every stage."""
        for p, pipeline in enumerate(self.pipelines):
            for s, stage in enumerate(pipeline.stages):
                yield p, s, stage

    def stage_of(self, worker: int) -> tuple[int, int, Stage]:
        for p, s, stage in self.stages():
            if stage.worker == worker:
                return p, s, stage
        raise KeyError(f"worker {worker} is not in plan generation {self.generation}")

    def holders(self, layer: int) -> tuple[int, ...]:
        """The workers holding a replica of ``layer``, sorted."""
        return tuple(sorted({st.worker for _, _, st in self.stages() if st.start <= layer < st.stop}))

    def reduction_groups(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Layers grouped by the set of workers that hold them: [(holders, layers)], ordered by first layer.

        Every worker walks this list in the same order, so gradient all-reduces over overlapping groups cannot
        deadlock; groups with a single holder need no communication and are left out.
        """
        return list(self._reduction_groups)

    @cached_property
    def _reduction_groups(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        # From the workers of each range: a plan has thousands of workers but few distinct ranges.
        holders: list[list[int]] = [[] for _ in range(self.num_layers)]
        for (start, stop), workers in self._workers_by_range.items():
            for layer in range(start, stop):
                holders[layer].extend(workers)
        groups: dict[tuple[int, ...], list[int]] = {}
        for layer in range(self.num_layers):
            groups.setdefault(tuple(sorted(holders[layer])), []).append(layer)
        return tuple((h, tuple(ls)) for h, ls in groups.items() if len(h) > 1)

    def workers_by_range(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """The workers holding each range of layers ``(start, stop)``, in the order ``layer_ranges`` names them.

        Workers of one range hold the same layers, so they are in the same reduction groups: what depends only on
        a worker's layers is computed once per range (a few dozen) rather than per worker (thousands)."""
        return dict(self._workers_by_range)

    @cached_property
    def _workers_by_range(self) -> dict[tuple[int, int], tuple[int, ...]]:
        by_range: dict[tuple[int, int], list[int]] = {}
        for worker, held in self._layer_ranges.items():
            by_range.setdefault(held, []).append(worker)
        return {held: tuple(workers) for held, workers in by_range.items()}

    def validate(self) -> None:
        """Raise PlanError unless every micro-batch and every layer is covered exactly as training needs."""
        if self.micro_batch <= 0 or self.global_batch % self.micro_batch:
            raise PlanError(
                f"global batch {self.global_batch} does not split into micro-batches of {self.micro_batch}: "
                f"set train.global_batch to a multiple of train.micro_batch"
            )
        if not self.pipelines:
            raise PlanError("the plan has no pipeline: the cluster needs at least one live worker")
        seen: list[int] = []
        for p, pipeline in enumerate(self.pipelines):
            if pipeline.chain_stop != self.num_layers:
                raise self._chain_error(p, pipeline)
            seen.extend(pipeline.microbatches)
        if sorted(seen) != list(range(self.num_microbatches)):
            raise PlanError(
                f"the pipelines must process micro-batches 0..{self.num_microbatches - 1} exactly once each "
                f"between them; they process {sorted(seen)}"
            )
        self._layer_ranges  # noqa: B018 - raises for a worker with two ranges

    def _chain_error(self, p: int, pipeline: Pipeline) -> PlanError:
        """What is wrong with pipeline ``p``, whose stages do not cover the model's layers in order."""
        if not pipeline.stages:
            return PlanError(f"pipeline {p} has no stage")
        expected = 0
        for stage in pipeline.stages:
            if stage.start != expected or stage.stop <= stage.start:
                return PlanError(
                    f"pipeline {p} does not cover layers 0..{self.num_layers - 1} in order with non-empty "
                    f"stages (stage {stage} should start at layer {expected})"
                )
            expected = stage.stop
        return PlanError(f"pipeline {p} stops at layer {expected}, the model has {self.num_layers} layers")

    def layer_ranges(self) -> dict[int, tuple[int, int]]:
        """Each worker's layers ``(start, stop)``; a worker serving several pipelines must hold the same ones."""
        return dict(self._layer_ranges)

    @cached_property
    def _layer_ranges(self) -> dict[int, tuple[int, int]]:
        """Plans are immutable: what is derived from one is kept (a plan of a thousand workers is asked often)."""
        ranges: dict[int, tuple[int, int]] = {}
        for pipeline in self.pipelines:  # from what each pipeline keeps (plans share most of their pipelines)
            ranges.update(zip(pipeline.workers, pipeline.spans))
        if len(ranges) == sum(len(pipeline.stages) for pipeline in self.pipelines):
            return ranges  # every worker in one stage: nothing to disagree
        ranges = {}
        for _, _, stage in self.stages():
            held = ranges.setdefault(stage.worker, (stage.start, stage.stop))
            if held != (stage.start, stage.stop):
                raise PlanError(
                    f"worker {stage.worker} appears with layers {held[0]}..{held[1] - 1} and "
                    f"{stage.start}..{stage.stop - 1}: a worker serving several pipelines must hold the same layers"
                )
        return ranges

    def to_dict(self) -> dict:
        """The plan as plain data (what ``dataclasses.asdict`` gives, built directly: plans run to thousands of
        stages)."""
        return {
            "generation": self.generation,
            "num_layers": self.num_layers,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "pipelines": [
                {
                    "stages": [{"worker": s.worker, "start": s.start, "stop": s.stop} for s in p.stages],
                    "microbatches": list(p.microbatches),
                }
                for p in self.pipelines
            ],
            "step": self.step,
            "notes": dict(self.notes),
        }

    def to_json(self) -> str:
        """One pipeline a line."""
        data = self.to_dict()
        pipelines = ",\n".join(json.dumps(p, separators=(",", ":")) for p in data.pop("pipelines"))
        return json.dumps(data)[:-1] + f', "pipelines": [\n{pipelines}\n]}}\n'

    @staticmethod
    def from_dict(data: dict) -> Plan:
        pipelines = tuple(
            Pipeline(stages=tuple(Stage(**s) for s in p["stages"]), microbatches=tuple(p["microbatches"]))
            for p in data["pipelines"]
        )
        return Plan(**{**data, "pipelines": pipelines})

    @staticmethod
    def from_json(text: str) -> Plan:
        return Plan.from_dict(json.loads(text))


def even_split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges of near-equal size, earlier stages taking the remainder."""
    if num_stages > num_layers:
        raise PlanError(
            f"{num_stages} stages for a model of {num_layers} layers: every stage needs at least one layer, "
            f"use at most {num_layers} stages"
        )
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for s in range(num_stages):
        stop = start + base + (1 if s < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def grid_plan(
    workers: list[int], stages: int, num_layers: int, global_batch: int, micro_batch: int, generation: int = 0,
    step: int = 0, bounds: Sequence[tuple[int, int]] | None = None,
) -> Plan:  # fmt: skip
    """A homogeneous PP x DP plan: ``len(workers) // stages`` pipelines, micro-batches dealt round-robin, each
    pipeline's stages holding ``bounds`` (default: ``even_split``).

    Consecutive workers form one pipeline, so a pipeline stays inside a node when the node's workers are adjacent.
    """
    if stages <= 0 or len(workers) < stages:
        raise PlanError(f"{len(workers)} workers cannot form a pipeline of {stages} stages")
    replicas = len(workers) // stages
    bounds = even_split(num_layers, stages) if bounds is None else bounds
    num_mb = global_batch // micro_batch if micro_batch > 0 else 0
    if num_mb < replicas:
        raise PlanError(
            f"{num_mb} micro-batches cannot feed {replicas} pipelines: raise train.global_batch or lower "
            f"train.micro_batch so that global_batch / micro_batch >= {replicas}"
        )
    pipelines = tuple(
        Pipeline(
            stages=tuple(Stage(workers[r * stages + s], *bounds[s]) for s in range(stages)),
            microbatches=tuple(range(r, num_mb, replicas)),
        )
        for r in range(replicas)
    )
    plan = Plan(generation, num_layers, global_batch, micro_batch, pipelines, step=step)
    plan.validate()
    return plan
