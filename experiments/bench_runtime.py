"""ftlab's runtime against DeepSpeed's own PipelineEngine: same model, layout, batch, data and optimizer.

    .venv/bin/python -m ftlab.experiments.bench_runtime                       # gpt2-tiny, 2 stages x 2 replicas
    .venv/bin/python -m ftlab.experiments.bench_runtime --model gpt2-small --rounds 1 --steps 10
    .venv/bin/python -m ftlab.experiments.bench_runtime --precision bf16        # both sides in bf16

Both sides train from the same initial weights (``runtime.training.model.build_layer``) on the same micro-batches, so their
losses must agree; later steps drift by the order of floating-point sums, so the check is on step 0's loss, relative
to its size (``LOSS_TOLERANCE``). In fp32 both sides compute the same operations in fp32 and differ only in the order
of sums: 1e-5. In bf16 ftlab computes under autocast on fp32 weights and DeepSpeed on bf16 parameters
(``experiments.deepspeed_reference`` has the difference): their activations differ by bf16's rounding (a relative
2**-8 each) and DeepSpeed's loss is itself a bf16 number (near a loss of 9 bf16's spacing is 1/16, a relative 3.5e-3
from that rounding alone), so they agree to 1e-2 and no closer. Each system runs alone on the machine; rounds go in
ABBA order (ftlab, DeepSpeed | DeepSpeed, ftlab | ...) so that a drift in machine load (this machine is shared) hits
both alike.

Throughput is measured after ``--warmup`` iterations, two ways:
- wall: measured iterations x global batch / wall-clock time from the end of the last warm-up iteration to the end of
  the last iteration (ftlab: on the coordinator, so it includes everything between steps: commit, the optimizer
  step, MLflow logging; DeepSpeed: rank 0 around back-to-back ``engine.train_batch()`` calls);
- median: global batch / median per-iteration time (ftlab: StepRecord.iter_s, which stops at the last Ready and so
  leaves out the optimizer step, overlapped with the coordinator's bookkeeping; DeepSpeed: one ``train_batch()``).
The ratio is computed from the wall figures, pooled over rounds (total samples / total time per side): it is the one
that counts everything a training job pays per iteration.

``--profile DIR`` runs every ftlab worker and DeepSpeed rank under cProfile (main thread) and leaves one .prof per
process in DIR; the profiler is switched on by a sitecustomize in a temporary directory put on PYTHONPATH, so no
runtime file changes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from ftlab.experiments.deepspeed_reference import ReferenceJob, run_reference
from ftlab.runtime.core.config import TrainConfig

# Step 0's |ftlab - DeepSpeed| / |ftlab| that the run must stay within, by precision (the module docstring says why).
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2}


@dataclass
class Side:
    """One system's measurements, pooled over rounds."""

    name: str
    iter_s: list[float] = field(default_factory=list)  # per measured iteration
    elapsed_s: list[float] = field(default_factory=list)  # per round: wall time of the measured iterations
    iterations: list[int] = field(default_factory=list)  # per round
    losses: list[list[float]] = field(default_factory=list)  # per round: every step's loss
    startup_s: list[float] = field(default_factory=list)  # per round: launch to the end of step 0
    compute_s: list[float] = field(default_factory=list)  # ftlab: the slowest worker's compute per iteration

    def wall_samples_per_s(self, global_batch: int) -> float:
        return sum(self.iterations) * global_batch / sum(self.elapsed_s)

    def median_samples_per_s(self, global_batch: int) -> float:
        return global_batch / statistics.median(self.iter_s)


# -- ftlab -----------------------------------------------------------------------------------------------------------


def run_ftlab(args: argparse.Namespace, workdir: Path, round_index: int, side: Side) -> None:
    from ftlab.experiments.job import compose_config, run_job

    steps = args.warmup + args.steps
    cfg = compose_config(ftlab_overrides(args, workdir, steps, round_index))
    started = time.monotonic()
    result = run_job(cfg)
    records = result.steps  # each with its commit time on the monotonic clock
    ends = {r.step: r.at for r in records}
    assert [r.step for r in records] == list(range(steps)), "a fault-free run must commit every step once"
    measured = records[args.warmup :]
    side.iter_s += [r.iter_s for r in measured]
    side.elapsed_s.append(ends[steps - 1] - ends[args.warmup - 1])
    side.iterations.append(len(measured))
    side.losses.append([r.loss for r in records])
    side.startup_s.append(ends[0] - started)
    side.compute_s += [r.compute_s for r in measured]


def ftlab_overrides(args: argparse.Namespace, workdir: Path, steps: int, round_index: int) -> list[str]:
    return [
        "experiment=plain",  # the default job is a preset with faults and another policy: pin the plain grid
        "policy=none",
        "faults=none",
        f"model={args.model}",
        f"train.steps={steps}",
        f"train.precision={args.precision}",
        "progress=false",
        "cluster=local-4",
        f"cluster.nodes={args.world}",
        "cluster.workers_per_node=1",
        "cluster.threads_per_worker=1",
        "cluster.device_memory_gb=1024",  # no simulated device limit: DeepSpeed has none either
        f"train.stages={args.stages}",
        f"train.global_batch={args.global_batch}",
        f"train.micro_batch={args.micro_batch}",
        f"tracking.uri=sqlite:///{workdir}/mlflow.db",
        f"tracking.run_name=bench-runtime-{round_index}",
        f"train.cache_dir={workdir}/cache",
    ]


# -- DeepSpeed -------------------------------------------------------------------------------------------------------


def run_deepspeed(
    args: argparse.Namespace, workdir: Path, round_index: int, side: Side, tokens: Path, train: TrainConfig
) -> None:
    steps = args.warmup + args.steps
    job = ReferenceJob(
        model=args.model,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        stages=args.stages,
        world=args.world,
        steps=steps,
        lr=train.lr,
        min_lr=train.min_lr,
        warmup_steps=train.warmup_steps,
        weight_decay=train.weight_decay,
        beta1=train.beta1,
        beta2=train.beta2,
        seed=train.seed,
        precision=args.precision,
        tokens_path=str(tokens),
        result_path=str(workdir / f"deepspeed-{round_index}.json"),
    )
    started = time.perf_counter()
    result = run_reference(job)
    ends = result["end_s"]
    side.iter_s += result["iter_s"][args.warmup :]
    side.elapsed_s.append(ends[steps - 1] - ends[args.warmup - 1])
    side.iterations.append(steps - args.warmup)
    side.losses.append(result["loss"])
    # rank 0's clock is another process's perf_counter: the startup figure is approximate (launch to step 0 end)
    side.startup_s.append(time.perf_counter() - started - (ends[-1] - ends[0]))


# -- profiling ------------------------------------------------------------------------------------------------------

_SITECUSTOMIZE = """
import os, sys
_dir = os.environ.get("BENCH_PROFILE_DIR")
_argv = " ".join(getattr(sys, "orig_argv", sys.argv))
if _dir and ("runtime.processes.worker" in _argv or "experiments.deepspeed_reference" in _argv):
    import atexit, cProfile
    _role = "ftlab-worker" if "runtime.processes.worker" in _argv else "deepspeed-rank" + os.environ.get("RANK", "")
    _tag = f"{_role}-{os.getpid()}"
    _prof = cProfile.Profile()
    _prof.enable()
    def _dump():
        _prof.disable()
        _prof.dump_stats(os.path.join(_dir, _tag + ".prof"))
    atexit.register(_dump)
    _exit = os._exit
    def _dump_then_exit(code):  # ftlab's workers leave through os._exit, which skips atexit
        _dump()
        _exit(code)
    os._exit = _dump_then_exit
"""


def enable_profiling(directory: Path, workdir: Path) -> None:
    site = workdir / "profile-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(textwrap.dedent(_SITECUSTOMIZE))
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["BENCH_PROFILE_DIR"] = str(directory.resolve())
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))


# -- main -----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--world", type=int, default=4, help="processes: stages x data-parallel replicas")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3, help="iterations left out of the measurement")
    parser.add_argument("--steps", type=int, default=20, help="measured iterations per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each running both sides (ABBA order)")
    parser.add_argument("--precision", choices=sorted(LOSS_TOLERANCE), default="fp32", help="both sides train in it")
    parser.add_argument("--profile", type=Path, default=None, help="write cProfile .prof files of every worker here")
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/results.md")
    args = parser.parse_args(argv)
    if args.world % args.stages:
        parser.error(f"--world {args.world} is not a multiple of --stages {args.stages}")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first iteration sets up buffers and connections)")

    from omegaconf import OmegaConf

    from ftlab.experiments.config import JobConfig
    from ftlab.runtime.training.data import tokenize_corpus
    from ftlab.experiments.job import compose_config

    workdir = Path(tempfile.mkdtemp(prefix="bench-runtime-"))
    if args.profile is not None:
        enable_profiling(args.profile, workdir)
    cfg: JobConfig = OmegaConf.to_object(compose_config(ftlab_overrides(args, workdir, args.warmup + args.steps, 0)))
    train = cfg.train
    tokens = tokenize_corpus(train.data, cfg.model.vocab_size, Path(train.cache_dir))
    layout = f"{args.stages} stages x {args.world // args.stages} replicas"
    print(
        f"bench_runtime: {args.model} in {args.precision}, {layout} ({args.world} processes, 1 thread each), "
        f"global batch {args.global_batch}, micro-batch {args.micro_batch}, {args.rounds} rounds of {args.warmup} "
        f"warm-up + {args.steps} measured iterations per side",
        flush=True,
    )

    load_before = os.getloadavg()[0]  # the machine is shared: the table says how busy it was
    ftlab, deepspeed = Side("ftlab"), Side("deepspeed")
    round_ratios = []
    runners = {
        "ftlab": lambda r: run_ftlab(args, workdir, r, ftlab),
        "deepspeed": lambda r: run_deepspeed(args, workdir, r, deepspeed, tokens, train),
    }
    for r in range(args.rounds):
        # ABBA: ftlab, deepspeed | deepspeed, ftlab | ... so a steady drift in machine load favours neither side.
        for name in ("ftlab", "deepspeed") if r % 2 == 0 else ("deepspeed", "ftlab"):
            t = time.perf_counter()
            runners[name](r)
            print(f"  round {r}: {name} done in {time.perf_counter() - t:.0f} s", flush=True)
        f_tp = args.steps * args.global_batch / ftlab.elapsed_s[-1]
        d_tp = args.steps * args.global_batch / deepspeed.elapsed_s[-1]
        round_ratios.append(f_tp / d_tp)
        print(f"  round {r}: ftlab {f_tp:.1f} samples/s, deepspeed {d_tp:.1f} samples/s, ratio {f_tp / d_tp:.3f}",
              flush=True)  # fmt: skip

    load = (load_before, os.getloadavg()[0])
    gb = args.global_batch
    f_wall, d_wall = ftlab.wall_samples_per_s(gb), deepspeed.wall_samples_per_s(gb)
    f_med, d_med = ftlab.median_samples_per_s(gb), deepspeed.median_samples_per_s(gb)
    # Loss agreement: every round of both sides trains the same steps from the same weights on the same data.
    f_loss0 = ftlab.losses[0][0]
    d_loss0 = deepspeed.losses[0][0]
    step_diffs = [abs(a - b) for fl, dl in zip(ftlab.losses, deepspeed.losses) for a, b in zip(fl, dl)]
    loss0_rel = abs(f_loss0 - d_loss0) / abs(f_loss0)
    compute = ftlab.compute_s

    rows = [
        ("samples/s, wall (measured iters / time)", f"{f_wall:9.2f}", f"{d_wall:9.2f}", f"{f_wall / d_wall:7.3f}"),
        ("samples/s, median iteration", f"{f_med:9.2f}", f"{d_med:9.2f}", f"{f_med / d_med:7.3f}"),
        ("iteration s, wall mean", f"{sum(ftlab.elapsed_s) / sum(ftlab.iterations):9.4f}",
         f"{sum(deepspeed.elapsed_s) / sum(deepspeed.iterations):9.4f}", ""),
        ("iteration s, median", f"{statistics.median(ftlab.iter_s):9.4f}",
         f"{statistics.median(deepspeed.iter_s):9.4f}", ""),
        ("iteration s, min", f"{min(ftlab.iter_s):9.4f}", f"{min(deepspeed.iter_s):9.4f}", ""),
        ("loss at step 0", f"{f_loss0:9.5f}", f"{d_loss0:9.5f}", ""),
        ("startup s (launch to step 0 done)", f"{statistics.mean(ftlab.startup_s):9.1f}",
         f"{statistics.mean(deepspeed.startup_s):9.1f}", ""),
    ]  # fmt: skip
    print()
    print(f"{'':42s} {'ftlab':>9s} {'deepspeed':>9s} {'ratio':>7s}")
    for label, a, b, c in rows:
        print(f"{label:42s} {a:>9s} {b:>9s} {c:>7s}")
    if compute:
        print(f"ftlab slowest-worker compute share (median compute_s / iter_s): "
              f"{statistics.median(compute) / statistics.median(ftlab.iter_s):.2f}")  # fmt: skip
    print(f"per-round wall ratios: {', '.join(f'{x:.3f}' for x in round_ratios)}")
    print(f"loss |ftlab - deepspeed|: step 0 {abs(f_loss0 - d_loss0):.2e} (relative {loss0_rel:.2e}, tolerance "
          f"{LOSS_TOLERANCE[args.precision]:.0e}), max over all steps {max(step_diffs):.2e}")  # fmt: skip

    summary = {
        "ftlab_samples_per_s": round(f_wall, 3),
        "deepspeed_samples_per_s": round(d_wall, 3),
        "ratio": round(f_wall / d_wall, 4),
        "ratio_basis": "wall: measured iterations x global batch / wall time, pooled over rounds",
        "ftlab_median_samples_per_s": round(f_med, 3),
        "deepspeed_median_samples_per_s": round(d_med, 3),
        "median_ratio": round(f_med / d_med, 4),
        "round_ratios": [round(x, 4) for x in round_ratios],
        "loss_step0_ftlab": f_loss0,
        "loss_step0_deepspeed": d_loss0,
        "loss_step0_abs_diff": abs(f_loss0 - d_loss0),
        "loss_step0_rel_diff": loss0_rel,
        "loss_step0_tolerance": LOSS_TOLERANCE[args.precision],
        "loss_max_abs_diff": max(step_diffs),
        "model": args.model,
        "precision": args.precision,
        "layout": {"stages": args.stages, "replicas": args.world // args.stages, "processes": args.world},
        "global_batch": args.global_batch,
        "micro_batch": args.micro_batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "load_avg_1min": [round(x, 2) for x in load],  # before the first round, after the last
    }
    print(json.dumps(summary), flush=True)
    if loss0_rel > LOSS_TOLERANCE[args.precision]:
        raise SystemExit(f"bench_runtime: step 0's losses differ by {loss0_rel:.2e} (relative), over the "
                         f"{args.precision} tolerance {LOSS_TOLERANCE[args.precision]:.0e}: the sides train apart")
    if args.write_docs:
        from ftlab.experiments import results_doc

        # fp32 keeps the section it always had; each other precision writes its own beside it.
        fp32 = args.precision == "fp32"
        section = "bench_runtime" if fp32 else f"bench_runtime_{args.precision}"
        title = "The runtime against DeepSpeed's PipelineEngine" + ("" if fp32 else f" in {args.precision}")
        results_doc.write_section(section, title, {
            f"{args.model} in {args.precision}, {layout}, global batch {gb} in micro-batches of {args.micro_batch}, "
            f"{args.rounds} rounds of {args.steps} measured iterations a side": [
                {"": label, "ftlab": a.strip(), "DeepSpeed": b.strip(), "ratio": c.strip()} for label, a, b, c in rows
            ],
        }, argv, note=f"Round by round (wall): {', '.join(f'{x:.3f}' for x in round_ratios)}; losses differ by at "
                      f"most {max(step_diffs):.2e} over all steps (step 0: relative {loss0_rel:.2e}, tolerance "
                      f"{LOSS_TOLERANCE[args.precision]:.0e}). The host's 1-minute load average: {load[0]:.1f} before "
                      f"the first round, {load[1]:.1f} after the last.", module="bench_runtime")  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
