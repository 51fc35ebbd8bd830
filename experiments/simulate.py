"""``ftlab mode=simulate``: the job as composed, on a simulated cluster (``runtime.sim.backend``).

The same checks as a real job (``job.check_job``), the same policy and protection objects, the same coordinator,
the same fault schedule fired by the same injector (in simulated time), the same MLflow run with tag
``backend=sim``: only the machines are simulated. Costs come from the job's machine (``runtime.sim.machines``), the
one a policy predicts with: the job's profile (analytic for a GPU type of ``runtime.core.devices``, measured for
``cluster.device=cpu``) on the platform its cluster describes, and the constants the profile has no figure for
(process start, detection, storage: ``conf/sim``, measured by ``experiments/measure_sim_constants.py``).

``sim.horizon_s`` ends the job after that much simulated training, whatever ``train.steps`` (then a cap) says.
``sim.calibrate_samples_per_s`` sets ``cluster.device_efficiency`` first (``experiments.calibration``): the run records
the efficiency found, and the policies plan and predict at it as the simulator charges at it.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from ftlab.experiments.calibration import calibrated_efficiency
from ftlab.experiments.config import JobConfig
from ftlab.experiments.job import (
    JobResult, check_device, check_job, check_settings, conclude, everyone, observe, record_checks, tracked,
)
from ftlab.faults.injector import Injector
from ftlab.runtime.core.contract import ConfigError
from ftlab.runtime.control.coordinator import Coordinator, JobStopped
from ftlab.runtime.sim.backend import HorizonReached, SimBackend
from ftlab.runtime.sim.fault_free import FasterThanFaultFree
from ftlab.runtime.reporting.tracking import Tracker


@dataclass
class Simulated:
    """What ``simulate`` gives besides the job's result."""

    result: JobResult
    horizon_reached: bool
    """The job ended at ``sim.horizon_s`` rather than at train.steps or a stop."""
    components: int
    """Distinct plan components the simulator executed (every other pipeline reused one of them)."""
    faster_than_fault_free: list[FasterThanFaultFree]
    """Plans after failures that trained faster than the fault-free plan (``runtime.sim.fault_free``): none, unless
    a plan is timed unlike its fault-free counterpart."""


def simulate_job(dict_cfg: DictConfig, defer_refusal: bool = False) -> JobResult:
    """One simulated job as its own MLflow run (tag ``backend=sim``); a refused one as ``job.tracked`` says."""
    return tracked(dict_cfg, lambda cfg, tracker: simulate(cfg, tracker).result, backend="sim",
                   check=check_simulation, defer_refusal=defer_refusal)  # fmt: skip


def check_simulation(cfg: JobConfig) -> None:
    """Everything a simulation is checked for (``simulate`` checks the same, in the run's folder), at the calibrated
    device efficiency where the job states a throughput (``check_sim``)."""
    check_sim(cfg)
    check_job(cfg)


def check_sim(cfg: JobConfig) -> None:
    """What only a simulation needs: a profile for the device, a positive horizon, a protection it can cost; with
    ``sim.calibrate_samples_per_s``, ``cfg.cluster.device_efficiency`` becomes the calibrated one."""
    check_device(cfg)
    if cfg.protection.name == "reft" and cfg.protection.mode == "aor":
        raise ConfigError(
            "mode=simulate has no model of protection.mode=aor (the peer's optimizer chunk recomputed on the host "
            "from its gradient chunk, with train.zero=1): use protection.mode=arc, aec or arc+aec, or run the job for "
            "real (mode=train)"
        )
    horizon = cfg.sim.horizon_s
    if horizon is not None and not horizon > 0:
        raise ConfigError(f"sim.horizon_s={horizon}: give the simulated seconds of training, > 0, or null")
    if cfg.sim.calibrate_samples_per_s is not None:
        check_settings(cfg)  # calibrating plans the job: its settings first
        cfg.cluster.device_efficiency = calibrated_efficiency(cfg)


def simulate(cfg: JobConfig, tracker: Tracker | None = None) -> Simulated:
    """Simulate the job; with a tracker, record it in the tracker's open run."""
    check_sim(cfg)
    checked = check_job(cfg)
    c, t = cfg.cluster, cfg.train
    job = checked.make_job(everyone(cfg))
    seen = observe(cfg, tracker, clock_origin=0.0, repeats=False)
    seen.progress.on_simulated_clock()  # no loss to show: the simulated time instead
    record_checks(cfg, tracker, seen, checked, 0.0)
    if tracker is not None and cfg.sim.calibrate_samples_per_s is not None:
        tracker.set_tag("calibration", f"cluster.device_efficiency={c.device_efficiency:.6g} from "
                                       f"sim.calibrate_samples_per_s={cfg.sim.calibrate_samples_per_s:g}")  # fmt: skip
    backend = SimBackend(c.nodes, c.workers_per_node, job.machine(), c.heartbeat_timeout_s, seen.bus)
    injector = Injector(checked.faults, backend.cluster, seen.bus, clock=backend.clock, schedule=backend.call_at)
    coordinator = Coordinator(
        backend, checked.policy, checked.protection, checked.make_job, seen.bus, t.steps, t.checkpoint_dir
    )
    stopped: JobStopped | None = None
    horizon = False
    try:
        coordinator.run(checked.decision)
    except JobStopped as exc:
        stopped = exc
    except HorizonReached:
        horizon = True
    finally:
        injector.stop()
        seen.progress.close()
    return Simulated(conclude(cfg, tracker, seen, checked, injector, stopped), horizon, backend.machine.timer.components,
                     backend.bound.faster)  # fmt: skip

