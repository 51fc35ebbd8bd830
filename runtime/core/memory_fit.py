"""Whether a layout's stages fit the job's devices: the one memory check behind the preflight refusal of a first
plan, a restart's layout (fewer stages hold more layers each) and Varuna's choice of micro-batch. The figures come
from ``costs.stage_footprint``, the formula the cost model charges."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ftlab.runtime.core.contract import Job
from ftlab.runtime.core.costs import LayerProfile, layer_bytes, stage_footprint
from ftlab.runtime.core.plan import Plan

GIB = 2**30


@dataclass(frozen=True)
class Overfull:
    """A stage that needs more memory than a device has."""

    pipeline: int
    stage: int
    start: int
    stop: int
    need: float
    device: int

    def describe(self, model: str) -> str:
        where = f"stage {self.stage} of pipeline {self.pipeline} (layers {self.start}..{self.stop - 1} of {model})"
        return f"{where} needs {self.need / GIB:.2f} GiB but a device has {self.device / GIB:.2f} GiB"


def layer_memory(job: Job, micro_batch: int | None = None) -> list[LayerProfile]:
    """Every layer's memory fields at ``micro_batch`` (default ``train.micro_batch``) in the job's precision; no
    times (a memory check needs none, and measuring them can take minutes)."""
    t = job.train
    micro = t.micro_batch if micro_batch is None else micro_batch
    return [LayerProfile(0.0, 0.0, 0.0, **layer_bytes(spec, micro, job.model.seq_len, t.precision))
            for spec in job.specs]  # fmt: skip


def overfull_bounds(job: Job, bounds: Sequence[tuple[int, int]], micro_batch: int | None = None) -> Iterator[Overfull]:
    """The stages of one pipeline of ``bounds`` (layer ranges, first stage first) that do not fit a device."""
    return _overfull(job, layer_memory(job, micro_batch), bounds, pipeline=0)


def first_overfull(plan: Plan, job: Job) -> Overfull | None:
    """The first stage of ``plan`` that does not fit a device, or None when every one fits."""
    layers = layer_memory(job)  # once for every pipeline: a plan at paper scale has hundreds
    for p, pipeline in enumerate(plan.pipelines):
        for overfull in _overfull(job, layers, [(stage.start, stage.stop) for stage in pipeline.stages], p):
            return overfull
    return None


def _overfull(
    job: Job, layers: Sequence[LayerProfile], bounds: Sequence[tuple[int, int]], pipeline: int
) -> Iterator[Overfull]:
    """The stages of pipeline ``pipeline`` of ``bounds`` whose footprint under 1F1B (which keeps ``len(bounds) - s``
    micro-batches in flight at stage ``s``) is more than a device has."""
    t = job.train
    for s, (start, stop) in enumerate(bounds):
        need = stage_footprint(layers, start, stop, len(bounds) - s, t.activation_checkpointing, t.precision)
        if need > job.device_memory_bytes:
            yield Overfull(pipeline, s, start, stop, need, job.device_memory_bytes)
