"""The analytic GPU profile the simulator studies at paper scale, against the same layers timed on a real GPU.

    python -m experiments.check_device_profile                       # on a machine with CUDA
    python -m experiments.check_device_profile --models gpt3-medium --micro-batches 1 2 4

A paper-scale simulation (``experiments/sim_paper.py``, ``cluster.device=A100-80GB`` and the like) costs every layer
by ``runtime.core.costs.profile_from_specs``: its FLOPs over the datasheet's peak in the job's precision at
``cluster.device_efficiency``, a backward twice the forward, an optimizer step bound by memory. Nothing in CI can
check that against hardware. This times the runtime's own layers of each model
(``runtime.processes.profiler.measure_layer``: the embedding, one transformer block and the head, since a model's
blocks are alike) on the GPU at hand in bf16 (fp16 on a GPU without bf16), and prints, beside the analytic profile of
the matching ``runtime.core.devices`` entry (``--spec`` names another) at ``--efficiency`` (the default of
``cluster.device_efficiency`` unless given), per layer and for the whole model's forward and backward (the
embedding, every block, the head), measured over analytic, and the fraction of the peak the blocks reached. A ratio
above 1: the GPU is slower than the simulator assumes.

The last line printed is one JSON object: ``device``, ``spec``, ``utilisation_assumed`` (the efficiency) and per
model and micro-batch the ratios and the blocks' utilisation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ftlab.runtime.core.config import ClusterConfig
from ftlab.runtime.core.costs import LayerProfile
from ftlab.runtime.core.devices import DEVICES, NodeSpec, node_spec
from ftlab.runtime.core.model_spec import layer_specs, load_model_config, num_layers
from ftlab.runtime.processes.profiler import analytic_profile, device_name, measure_layer

MODELS = ("gpt3-medium", "gpt3-2.7b", "gpt3-6.7b", "llama2-6.7b")
SPEC_BY_NAME = (("H200", "H200-141GB"), ("H100", "H100-80GB"), ("A100-SXM4-80GB", "A100-80GB"),
                ("A100", "A100-40GB"), ("A40", "A40"), ("V100", "V100-16GB"))  # fmt: skip
"""A substring of ``torch.cuda.get_device_name`` -> the ``runtime.core.devices`` entry of that GPU; the first match wins."""


def matching_spec(name: str) -> str:
    for part, spec in SPEC_BY_NAME:
        if part in name:
            return spec
    raise SystemExit(f"no runtime.core.devices entry matches GPU {name!r}: pass --spec, one of {', '.join(DEVICES)}")


def whole_model(layers: dict[int, LayerProfile], blocks: int) -> tuple[float, float]:
    """(forward, backward) seconds of a micro-batch through every layer, from the embedding, one block and the head."""
    embedding, block, head = (layers[i] for i in sorted(layers))
    fwd = embedding.fwd_s + blocks * block.fwd_s + head.fwd_s
    bwd = sum(layer.bwd_input_s + layer.bwd_weight_s for layer in (embedding, head)) + blocks * (
        block.bwd_input_s + block.bwd_weight_s
    )
    return fwd, bwd


def half_precision(node: NodeSpec) -> str:
    """The half precision the GPU is timed in: bf16, or fp16 where it has no bf16."""
    return "bf16" if node.gpu.bf16 else "fp16"


def check(model: str, micro_batch: int, node: NodeSpec, repeats: int, on: str) -> dict[str, Any]:
    import torch

    from ftlab.runtime.training.mixed import DTYPES

    cfg = load_model_config(model)
    precision = half_precision(node)
    indices = (0, 1, num_layers(cfg) - 1)
    measured = {
        i: measure_layer(cfg, i, micro_batch, cfg.seq_len, DTYPES[precision], on, repeats, warmup=3)
        for i in indices
    }  # fmt: skip
    if on.startswith("cuda"):
        torch.cuda.empty_cache()
    analytic = analytic_profile(cfg, node, micro_batch, cfg.seq_len, precision).layers
    ratios: dict[str, dict[str, float]] = {}
    for i, kind in zip(indices, ("embedding", "block", "head"), strict=True):
        m, a = measured[i], analytic[i]
        ratios[kind] = {
            "fwd": m.fwd_s / a.fwd_s,
            "bwd": (m.bwd_input_s + m.bwd_weight_s) / (a.bwd_input_s + a.bwd_weight_s),
            "optimizer": m.optimizer_s / a.optimizer_s,
        }
    real_fwd, real_bwd = whole_model(measured, cfg.num_blocks)
    sim_fwd, sim_bwd = whole_model({i: analytic[i] for i in indices}, cfg.num_blocks)
    block_flops = 3 * layer_specs(cfg)[1].fwd_flops_per_token * micro_batch * cfg.seq_len  # forward and backward
    block = measured[1]
    reached = block_flops / block.time_s / node.gpu.peak_flops(precision)
    row = {
        "layers": ratios,
        "model_fwd": real_fwd / sim_fwd,
        "model_bwd": real_bwd / sim_bwd,
        "model_fwd_bwd": (real_fwd + real_bwd) / (sim_fwd + sim_bwd),
        "block_utilisation": reached,
        "block_fwd_s": block.fwd_s,
        "block_bwd_s": block.bwd_input_s + block.bwd_weight_s,
    }
    print(
        f"[{model} micro-batch {micro_batch}] measured / analytic: "
        + "  ".join(f"{k} fwd {r['fwd']:.2f} bwd {r['bwd']:.2f} opt {r['optimizer']:.2f}" for k, r in ratios.items())
        + f"  | model fwd {row['model_fwd']:.2f} bwd {row['model_bwd']:.2f} fwd+bwd {row['model_fwd_bwd']:.2f}"
        + f"  | a block reached {100 * reached:.1f}% of peak (assumed {100 * node.efficiency:.0f}%)",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="model configs under conf/model")
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[1, 2, 4], help="sequences per micro-batch")
    parser.add_argument("--spec", choices=list(DEVICES), help="the runtime.core.devices entry to compare against")
    parser.add_argument("--efficiency", type=float, default=ClusterConfig.device_efficiency,
                        help="the fraction of peak the analytic profile assumes (cluster.device_efficiency)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measure (the fastest is kept)")
    parser.add_argument("--device", default="cuda", help="the torch device to time on (cpu: a smoke run of the script)")
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/results.md")
    parser.add_argument("--from-run", metavar="JSON", help="the last line an earlier run printed on a GPU machine: "
                        "write its table (with --write-docs) without timing anything here")  # fmt: skip
    args = parser.parse_args()
    if args.from_run:
        saved = json.loads(Path(args.from_run).read_text().strip().splitlines()[-1])
        if args.write_docs:
            write_docs(saved["device"], saved["spec"], saved["utilisation_assumed"], saved["models"],
                       source=args.from_run)
        return

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: this check times layers on a GPU (--device cpu for a smoke run)")
    name = device_name(args.device)
    spec = args.spec or matching_spec(name)
    node = node_spec(ClusterConfig(device=spec, device_efficiency=args.efficiency))
    print(f"GPU {name!r} against runtime.core.devices {spec!r} at device efficiency {node.efficiency}", flush=True)
    rows = {
        f"{model}/mb{micro_batch}": check(model, micro_batch, node, args.repeats, args.device)
        for model in args.models
        for micro_batch in args.micro_batches
    }  # fmt: skip
    if args.write_docs:
        write_docs(name, spec, node.efficiency, rows)
    print(json.dumps({"device": name, "spec": spec, "utilisation_assumed": node.efficiency, "models": rows}))


def write_docs(
    name: str, spec: str, efficiency: float, rows: dict[str, dict[str, Any]], source: str | None = None
) -> None:
    from ftlab.experiments.results_doc import write_section

    table = {
        label: {
            "block fwd": row["layers"]["block"]["fwd"],
            "block bwd": row["layers"]["block"]["bwd"],
            "embedding fwd": row["layers"]["embedding"]["fwd"],
            "embedding bwd": row["layers"]["embedding"]["bwd"],
            "head fwd": row["layers"]["head"]["fwd"],
            "model fwd+bwd": row["model_fwd_bwd"],
            "block share of peak": row["block_utilisation"],
        }
        for label, row in rows.items()
    }
    write_section(
        "check_device_profile", "The analytic GPU profile against a real GPU",
        {f"Measured over analytic time per layer on {name} (bf16, or fp16 without it), against `{spec}` at "
         f"{efficiency:.0%} of its peak; above 1: the GPU is slower than the simulator assumes": table},
        note="The embedding's cost is a gather, not FLOPs, so the analytic profile underrates it by the ratio shown; "
        "a block's share of the peak grows with the micro-batch, which one fixed utilisation cannot follow."
        + (f" Timed on the GPU machine; written here from the line that run printed (`{source}`), so the commit "
           "below is the one the GPU run checked out." if source else ""),
    )  # fmt: skip


if __name__ == "__main__":
    main()
