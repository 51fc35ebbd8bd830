"""The staggered optimizer against the default commit-then-step, side by side on the same fault-free job.

    .venv/bin/python -m ftlab.experiments.bench_staggered                        # gpt2-tiny, 2 stages x 2 replicas
    .venv/bin/python -m ftlab.experiments.bench_staggered --rounds 1 --steps 6   # a smoke run

Both sides run ``policy=recycle`` fault-free on the same layout, batch and data; they differ only in
``policy.staggered_optimizer`` (``OptimizerStep(early=True)``: each worker steps right after its Ready and undoes
the step on Abort, instead of stepping on Commit). Their losses must be equal step for step: the same steps are
taken, only earlier. Rounds go in ABBA order (default, staggered | staggered, default | ...) so that a drift in
machine load (this machine is shared) hits both alike.

Throughput after ``--warmup`` iterations, as in ``experiments.bench_runtime``: wall (measured iterations x global
batch / coordinator time from the end of the last warm-up step to the end of the last step, everything between
steps included) and median (global batch / median step time). The ratio staggered / default is from the wall
figures pooled over rounds. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

SIDES = {"default": "false", "staggered": "true"}


def run_side(args: argparse.Namespace, staggered: str, workdir: Path, index: int) -> dict:
    from ftlab.experiments.job import compose_config, run_job

    steps = args.warmup + args.steps
    overrides = [
        "experiment=plain", "policy=recycle", f"policy.staggered_optimizer={staggered}", "faults=none",
        f"model={args.model}", f"train.steps={steps}", "progress=false", "cluster=local-4", f"cluster.nodes={args.world}",
        "cluster.device_memory_gb=1024", f"train.stages={args.stages}", f"train.global_batch={args.global_batch}",
        f"train.micro_batch={args.micro_batch}", f"tracking.uri=sqlite:///{workdir}/mlflow.db",
        f"tracking.run_name=bench-staggered-{index}", f"train.cache_dir={args.cache_dir}",
        f"train.checkpoint_dir={workdir}/checkpoints",
    ]  # fmt: skip
    records = run_job(compose_config(overrides)).steps
    assert [r.step for r in records] == list(range(steps)), "a fault-free run commits every step once"
    ends = {r.step: r.at for r in records}
    measured = records[args.warmup :]
    return {
        "elapsed_s": ends[steps - 1] - ends[args.warmup - 1],
        "iterations": len(measured),
        "iter_s": [r.iter_s for r in measured],
        "losses": [r.loss for r in records],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA: each round runs both sides once")
    parser.add_argument("--cache-dir", default=str(Path(__file__).resolve().parents[1] / ".ftlab" / "cache"))
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/results.md")
    args = parser.parse_args(argv)

    runs: dict[str, list[dict]] = {name: [] for name in SIDES}
    with tempfile.TemporaryDirectory(prefix="ftlab-bench-staggered-") as tmp:
        for index in range(args.rounds):
            order = list(SIDES) if index % 2 == 0 else list(reversed(SIDES))
            for name in order:
                print(f"round {index}: {name}", flush=True)
                runs[name].append(run_side(args, SIDES[name], Path(tmp), index))

    report: dict[str, object] = {"model": args.model, "world": args.world, "stages": args.stages,
                                 "global_batch": args.global_batch, "rounds": args.rounds}  # fmt: skip
    print(f"\n{'side':<10}{'wall samples/s':>16}{'median samples/s':>18}{'median iter s':>15}")
    for name, side in runs.items():
        wall = sum(r["iterations"] for r in side) * args.global_batch / sum(r["elapsed_s"] for r in side)
        median_iter = statistics.median(t for r in side for t in r["iter_s"])
        report[name] = {"wall_samples_per_s": wall, "median_samples_per_s": args.global_batch / median_iter,
                        "median_iter_s": median_iter}  # fmt: skip
        print(f"{name:<10}{wall:>16.2f}{args.global_batch / median_iter:>18.2f}{median_iter:>15.4f}")
    ratio = report["staggered"]["wall_samples_per_s"] / report["default"]["wall_samples_per_s"]  # type: ignore[index]
    same = all(
        a == b for x, y in zip(runs["default"], runs["staggered"]) for a, b in zip(x["losses"], y["losses"])
    )
    report["ratio_staggered_over_default"] = ratio
    report["losses_identical"] = same
    print(f"staggered / default (wall): {ratio:.3f}; losses identical step for step: {same}")
    print(json.dumps(report))
    if args.write_docs:
        from ftlab.experiments import results_doc

        results_doc.write_section("bench_staggered", "The staggered optimizer against commit-then-step", {
            f"{args.model}, {args.stages} stages x {args.world // args.stages} replicas, fault-free, {args.rounds} "
            f"rounds of {args.steps} measured iterations a side": {name: report[name] for name in SIDES},
            "": {"ratio_staggered_over_default": ratio, "losses_identical": same},
        }, argv)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
