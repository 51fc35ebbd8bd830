"""``model=hf``: Hugging Face decoders trained from their own config.json and safetensors.

Tiny Llama, Mistral, Qwen2 and GPT-2 models are made with ``AutoModelForCausalLM.from_config`` (random weights) and
saved with ``save_pretrained``, as a user's checkpoint would be. ftlab builds each one as its layer list and must
compute the loss the HF model computes on the same batch: the blocks are the architecture's own modules and run the
same fp32 kernels in the same order (sdpa, no mask but ``is_causal``, where HF's model passes the same), so the loss
is the same number, a stage boundary included; the tolerance of 1e-6 relative only admits the order of the sum of
the micro-batches' means in the job's step loss. A layer's tensors come from the checkpoint by name, each layer's
alone; without weights every layer is drawn from the seed like a built-in family's. Bad checkpoints are refused
before any worker starts, and the check needs no torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, PreTrainedConfig, Qwen2Config

from ftlab.experiments.job import JobResult
from ftlab.runtime.core import hf_checkpoint
from ftlab.runtime.core.contract import ConfigError
from ftlab.runtime.core.model_spec import ModelConfig, dims, layer_kind, layer_specs, num_layers, parameter_shapes
from ftlab.runtime.processes import cluster as cluster_module
from ftlab.runtime.training.data import Batches, load_tokens, tokenize_corpus
from ftlab.runtime.training.model import StageModule, build_layer
from tests.oracle import assert_on_fault_free_trajectory
from tests.support import analytic_profiles, explicit, node

VOCAB, SEQ = 256, 16
SHAPE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
CONFIGS: dict[str, PreTrainedConfig] = {
    "llama": LlamaConfig(**SHAPE, attention_bias=True),  # biases on q, k, v and o: the table's rule for Llama
    "mistral": MistralConfig(**SHAPE, sliding_window=32),
    "qwen2": Qwen2Config(**SHAPE),
    "gpt2": GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=64, bos_token_id=None,
                       eos_token_id=None),  # ties its head to the token table, as GPT-2 does  # fmt: skip
}
ARCHS = list(CONFIGS)


def save_model(config: PreTrainedConfig, directory: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {arch: save_model(config, tmp_path_factory.mktemp(arch)) for arch, config in CONFIGS.items()}


def hf_model(directory: Path, weights: bool = True) -> ModelConfig:
    return ModelConfig(name="hf", family="hf", config=str(directory), weights=str(directory) if weights else None,
                       seq_len=SEQ)  # fmt: skip


def hf_loss(directory: Path, ids: torch.Tensor, labels: torch.Tensor) -> float:
    """The HF model's own loss (its loss function, given labels already shifted), dropout off."""
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa").eval()
    with torch.no_grad():
        return model(input_ids=ids, labels=labels, shift_labels=labels).loss.item()


@pytest.mark.parametrize("arch", ARCHS)
def test_layers_are_the_models_own_modules_with_the_specified_parameters(checkpoints, arch: str) -> None:  # noqa: ANN001
    cfg = hf_model(checkpoints[arch])
    specs = layer_specs(cfg)
    assert [s.kind for s in specs] == ["embedding", "block", "block", "block", "head"]
    saved = load_file(checkpoints[arch] / "model.safetensors")
    for spec in specs:
        layer = build_layer(cfg, spec.index, seed=0)
        shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
        assert shapes == parameter_shapes(dims(cfg), spec.kind)
        assert sum(p.numel() for p in layer.parameters()) == spec.params
    block = build_layer(cfg, 2, seed=0)  # the second block: the checkpoint's block 1, read by name
    prefix = "transformer.h.1." if arch == "gpt2" else "model.layers.1."
    for name, param in block.named_parameters():
        assert torch.equal(param, saved[prefix + name.removeprefix("layer.")]), name


@pytest.mark.parametrize("arch", ARCHS)
def test_a_two_stage_pipeline_computes_the_hf_models_loss_and_gradients(checkpoints, arch: str) -> None:  # noqa: ANN001
    cfg = hf_model(checkpoints[arch])
    windows = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(1))
    ids, labels = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    first = StageModule(cfg, {i: build_layer(cfg, i, seed=0) for i in range(0, 2)})
    last = StageModule(cfg, {i: build_layer(cfg, i, seed=0) for i in range(2, num_layers(cfg))})
    loss = last(first(ids), labels)
    loss.backward()
    model = AutoModelForCausalLM.from_pretrained(checkpoints[arch], attn_implementation="sdpa").eval()
    reference = model(input_ids=ids, labels=labels, shift_labels=labels).loss
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    # Each ftlab gradient lands on the HF parameter it was read from; GPT-2's tied table gets its two uses' sum.
    arch_entry, config = hf_checkpoint.architecture(cfg.config), hf_checkpoint.read_config(cfg.config)
    stored = hf_checkpoint.stored_tensors(cfg.weights)
    grads: dict[str, torch.Tensor] = {}
    for stage in (first, last):
        for index in range(stage.start, stage.stop):
            for local, param in stage.layer(index).named_parameters():
                name = hf_checkpoint.tensor_name(arch_entry, config, layer_kind(cfg, index), index - 1, local, stored)
                grads[name] = grads[name] + param.grad if name in grads else param.grad
    expected = {name: p.grad for name, p in model.named_parameters()}
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_layer_reads_its_own_tensors_and_no_others(checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from ftlab.runtime.training import hf_weights

    read: list[str] = []

    class Recording:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.file = safe_open(*args, **kwargs)

        def __enter__(self) -> Recording:
            self.file.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.__exit__(*exc)

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self.file.get_tensor(name)

    monkeypatch.setattr(hf_weights, "safe_open", Recording)
    cfg = hf_model(checkpoints["gpt2"])
    build_layer(cfg, 2, seed=0)
    assert sorted(read) == sorted(f"transformer.h.1.{n.removeprefix('layer.')}" for n in parameter_shapes(dims(cfg), "block"))
    read.clear()
    build_layer(cfg, num_layers(cfg) - 1, seed=0)  # the head: the final norm, and the token table GPT-2 ties to
    assert sorted(read) == ["transformer.ln_f.bias", "transformer.ln_f.weight", "transformer.wte.weight"]


def test_a_sharded_checkpoint_gives_the_same_layers(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS["llama"]).save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    whole, sharded = hf_model(checkpoints["llama"]), hf_model(tmp_path)
    for index in range(num_layers(whole)):
        expected, got = build_layer(whole, index, seed=0).state_dict(), build_layer(sharded, index, seed=0).state_dict()
        assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_bf16_weights_start_fp32_master_weights_of_their_values(tmp_path: Path) -> None:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS["qwen2"]).to(torch.bfloat16).save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    block = build_layer(hf_model(tmp_path), 1, seed=0)
    for name, param in block.named_parameters():
        stored = saved["model.layers.0." + name.removeprefix("layer.")]
        assert stored.dtype == torch.bfloat16 and param.dtype == torch.float32
        assert torch.equal(param, stored.float()), name


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_without_weights_each_layer_is_drawn_from_the_seed_and_its_index(checkpoints, arch: str) -> None:  # noqa: ANN001
    cfg = hf_model(checkpoints[arch], weights=False)
    first = build_layer(cfg, 2, seed=7).state_dict()
    torch.manual_seed(123)
    for index in (3, 0, 4):  # other layers built before it: another stage's worker
        build_layer(cfg, index, seed=7)
    again = build_layer(cfg, 2, seed=7).state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    other_seed, other_block = build_layer(cfg, 2, seed=8).state_dict(), build_layer(cfg, 3, seed=7).state_dict()
    weight = next(k for k in first if first[k].ndim == 2)
    assert not torch.equal(first[weight], other_seed[weight])
    assert not torch.equal(first[weight], other_block[weight])
    saved = load_file(checkpoints[arch] / "model.safetensors")
    assert not any(torch.equal(first[weight], t) for t in saved.values() if t.shape == first[weight].shape)


LLAMA_2_7B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}  # fmt: skip
"""Llama 2 7B's config.json, in the keys that shape it."""


def test_an_hf_config_plans_and_simulates_as_the_built_in_model_of_its_shape(job_overrides: list[str], tmp_path: Path) -> None:
    """Costs, memory fit, planner and simulator read an HF model's layers as they read llama2-6.7b's: the same
    specs, the same refusal of stages that do not fit, the same simulated steps once they do."""
    from omegaconf import OmegaConf

    from ftlab.experiments.job import compose_config
    from ftlab.experiments.simulate import simulate
    from ftlab.runtime.core.model_spec import load_model_config

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_2_7B))
    model = ["model=hf", f"model.config={tmp_path}", "model.seq_len=4096"]
    hf_specs = layer_specs(OmegaConf.to_object(compose_config([*job_overrides, *model])).model)
    assert hf_specs == layer_specs(load_model_config("llama2-6.7b"))
    base = [*job_overrides, *model, "cluster=a100-16x8", "cluster.nodes=1", "train.stages=8", "train.global_batch=16",
            "train.micro_batch=2", "mode=simulate"]  # fmt: skip
    with pytest.raises(ConfigError, match="train.activation_checkpointing=true"):
        simulate(OmegaConf.to_object(compose_config(base)))
    result = simulate(OmegaConf.to_object(compose_config([*base, "train.steps=3", "train.activation_checkpointing=true"])))
    assert len(result.result.steps) == 3


def test_the_run_records_the_sizes_the_config_json_gave(job_overrides: list[str], tmp_path: Path) -> None:
    """The MLflow run's model.* params are the model the job trained, not the schema's defaults it started from."""
    from mlflow.tracking import MlflowClient

    from ftlab.experiments.job import compose_config
    from ftlab.experiments.simulate import simulate_job

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_2_7B))
    result = simulate_job(compose_config([
        *job_overrides, "model=hf", f"model.config={tmp_path}", "model.seq_len=4096", "cluster=a100-16x8",
        "cluster.nodes=1", "train.stages=8", "train.global_batch=16", "train.micro_batch=2", "train.steps=1",
        "train.activation_checkpointing=true", "mode=simulate",
    ]))  # fmt: skip
    params = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(result.run_id).data.params
    assert (params["model.hidden"], params["model.num_blocks"], params["model.vocab_size"]) == ("4096", "32", "32000")


def step0_batch(token_cache: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The job's first global batch (train.global_batch 16, train.micro_batch 2, train.seed 0)."""
    batches = Batches(load_tokens(tokenize_corpus(None, VOCAB, token_cache)), SEQ, 16, 2, seed=0)
    parts = [batches.microbatch(0, m) for m in range(batches.num_microbatches)]
    return torch.from_numpy(np.concatenate([p[0] for p in parts])), torch.from_numpy(np.concatenate([p[1] for p in parts]))


def hf_job(directory: Path, weights: bool = True) -> list[str]:
    return ["model=hf", f"model.config={directory}", f"model.seq_len={SEQ}",
            *([f"model.weights={directory}"] if weights else [])]  # fmt: skip


@pytest.mark.parametrize("arch", ARCHS)
def test_trains_on_real_processes_from_the_hf_models_loss(run, checkpoints, token_cache: Path, arch: str) -> None:  # noqa: ANN001
    result = run(*hf_job(checkpoints[arch]), "cluster=local-4", "train.stages=2", "train.steps=2")
    assert [len(p.stages) for p in result.plans[0].pipelines] == [2, 2]
    losses = [s.loss for s in result.steps]
    assert losses[0] == pytest.approx(hf_loss(checkpoints[arch], *step0_batch(token_cache)), rel=1e-6)
    assert losses[1] < losses[0]


def test_a_node_killed_under_checkpoint_restart_stays_on_the_fault_free_trajectory(run, checkpoints) -> None:  # noqa: ANN001
    steps = 6
    job = [*hf_job(checkpoints["qwen2"]), "cluster=local-4", "train.stages=2", f"train.steps={steps}",
           "policy=checkpoint_restart", "protection=storage", "protection.every=3"]  # fmt: skip
    fault_free = run(*job)  # its checkpoints go to a folder of its own run's
    result: JobResult = run(*job, *explicit(node(1, 4, "backward")))
    (fault,) = result.faults
    assert fault.kind == "node" and fault.recover_s is not None
    assert_on_fault_free_trajectory(result, fault_free, steps)


@pytest.mark.slow
def test_oobleck_copies_hf_layers_in_place_on_the_fault_free_trajectory(run, tmp_path: Path) -> None:  # noqa: ANN001
    """A Qwen2 of 3M parameters on six nodes granted 40 MB each: every pipeline spans two nodes, so the node killed
    leaves a stage that another pipeline's survivors get by copying its layers (rotary blocks among them)."""
    big = Qwen2Config(**{**SHAPE, "vocab_size": 8192, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4})
    model = save_model(big, tmp_path / "qwen2-3m")
    job = [*hf_job(model), "policy=oobleck", "policy.fault_threshold=1", "cluster.nodes=6", "cluster.device_memory_gb=0.04",
           "train.steps=6", "protection=storage", "protection.every=6"]  # fmt: skip
    with analytic_profiles():  # plans from an A100's costs: the same every run
        fault_free = run(*job)
        result: JobResult = run(*job, *explicit(node(3, 3, "backward")))
    assert [[len(p.stages) for p in plan.pipelines] for plan in result.plans] == [[2, 2, 2], [3, 2]]
    assert [r.step for r in result.steps] == list(range(6)) and result.faults[0].transfer_bytes > 0
    assert_on_fault_free_trajectory(result, fault_free, 6)


# -- bad checkpoints, refused before any worker ---------------------------------------------------------------------
@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a node was started for a job that should have been refused")

    monkeypatch.setattr(cluster_module.LocalCluster, "start_node", refuse)


def test_unsupported_architecture_names_the_supported_ones(run, tmp_path: Path, no_workers: None) -> None:  # noqa: ANN001
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 32}))
    with pytest.raises(ConfigError, match="model_type 't5' is not supported; model=hf trains the decoders gpt2, llama, mistral, qwen2"):
        run("model=hf", f"model.config={tmp_path / 't5'}")


@pytest.mark.parametrize(("setting", "advice"), [
    ("model.config", "no such file: give a Hugging Face model directory"),
    ("model.weights", "no such directory: give the directory save_pretrained wrote"),
])  # fmt: skip
def test_a_missing_path_is_refused(run, checkpoints, no_workers: None, setting: str, advice: str) -> None:  # noqa: ANN001
    overrides = {"model.config": str(checkpoints["llama"]), "model.weights": str(checkpoints["llama"])}
    overrides[setting] = "/nonexistent/model"
    with pytest.raises(ConfigError, match=f"{setting}=/nonexistent/model: {advice}"):
        run("model=hf", *(f"{k}={v}" for k, v in overrides.items()), f"model.seq_len={SEQ}")


def test_a_config_without_its_sizes_is_refused(run, tmp_path: Path, no_workers: None) -> None:  # noqa: ANN001
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "hidden_size": 32}))
    with pytest.raises(ConfigError, match="config.json lacks 'num_attention_heads', which sizes the model"):
        run("model=hf", f"model.config={tmp_path}")


def test_model_hf_without_a_config_says_what_to_give(run, no_workers: None) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match="model=hf needs model.config="):
        run("model=hf")


def test_weights_of_another_shape_name_the_tensor_and_both_shapes(run, checkpoints, tmp_path: Path, no_workers: None) -> None:  # noqa: ANN001
    wider = save_model(Qwen2Config(**{**SHAPE, "intermediate_size": 64}), tmp_path / "wider")
    with pytest.raises(ConfigError, match=r"tensor model.layers.0.mlp.gate_proj.weight has shape \[64, 32\] but "
                                          r"model.config=\S+ makes it \[48, 32\]"):  # fmt: skip
        run(*hf_job(checkpoints["qwen2"], weights=False), f"model.weights={wider}")


def test_weights_missing_a_layer_name_the_layer_and_its_tensors(run, checkpoints, tmp_path: Path, no_workers: None) -> None:  # noqa: ANN001
    tensors = load_file(checkpoints["llama"] / "model.safetensors")
    (tmp_path / "partial").mkdir()
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.2.")}, tmp_path / "partial" / "model.safetensors")
    with pytest.raises(ConfigError, match=r"lacks layer 3's \(block\) tensors model.layers.2.input_layernorm.weight, "):
        run(*hf_job(checkpoints["llama"], weights=False), f"model.weights={tmp_path / 'partial'}")


@pytest.mark.parametrize(("arch", "overrides", "advice"), [
    ("gpt2", ["model.seq_len=65"], "longer than the 64 learned positions of model.config=.*: use model.seq_len<=64"),
    ("mistral", ["model.seq_len=33"], "longer than the sliding_window=32 of model.config=.*use model.seq_len<=32"),
    ("llama", ["model.hidden=64"], "model.hidden=64 but model.config=.* makes it 32: remove model.hidden"),
])  # fmt: skip
def test_settings_the_checkpoint_cannot_take_are_refused(run, checkpoints, no_workers: None, arch, overrides, advice) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match=advice):
        run("model=hf", f"model.config={checkpoints[arch]}", *overrides)


def test_every_architecture_preflight_accepts_has_its_layers() -> None:
    from ftlab.runtime.training.model_families import FAMILIES

    assert set(hf_checkpoint.ARCHITECTURES) <= set(FAMILIES)
    assert set(hf_checkpoint.ARCHITECTURES) == set(CONFIGS), "a supported architecture without a test model"


def test_checking_a_checkpoint_imports_no_torch(checkpoints) -> None:  # noqa: ANN001
    code = (
        "import sys\n"
        "from ftlab.runtime.core.model_spec import ModelConfig, layer_specs\n"
        f"cfg = ModelConfig(name='hf', family='hf', config={str(checkpoints['gpt2'])!r}, weights={str(checkpoints['gpt2'])!r}, seq_len=16)\n"
        "cfg.check(); print(sum(s.params for s in layer_specs(cfg)))\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'preflight imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == sum(s.params for s in layer_specs(hf_model(checkpoints["gpt2"])))
