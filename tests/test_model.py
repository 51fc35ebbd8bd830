import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ftlab.runtime.core.config import ClusterConfig
from ftlab.runtime.core.costs import CostModel, profile_from_specs
from ftlab.runtime.core.devices import node_spec
from ftlab.runtime.training.model import StageModule, build_layer
from ftlab.runtime.core.model_spec import LayerSpec, ModelConfig, available_models, layer_specs, load_model_config, num_layers

MODELS = [
    "bert-large",
    "gpt2-medium",
    "gpt2-small",
    "gpt2-tiny",
    "gpt3-2.7b",
    "gpt3-3.35b",
    "gpt3-6.7b",
    "gpt3-medium",
    "llama2-1.3b",
    "llama2-6.7b",
    "llama3-405b",
]


def tiny(family: str) -> ModelConfig:
    """A few-thousand-parameter model of each family; llama with grouped-query attention."""
    return ModelConfig(
        name=f"{family}-test",
        family=family,
        num_blocks=3,
        hidden=32,
        heads=4,
        vocab_size=50,
        seq_len=12,
        kv_heads=2 if family == "llama" else None,
    )


FAMILIES = ["gpt2", "llama", "bert"]


def total_params(cfg: ModelConfig) -> int:
    return sum(spec.params for spec in layer_specs(cfg))


def test_every_model_config_loads_and_is_named_after_its_file():
    assert available_models() == MODELS
    for name in MODELS:
        cfg = load_model_config(name)
        assert cfg.name == name
        specs = layer_specs(cfg)
        assert [s.index for s in specs] == list(range(num_layers(cfg))) and len(specs) == cfg.num_blocks + 2
        assert [s.kind for s in specs] == ["embedding"] + ["block"] * cfg.num_blocks + ["head"]
        assert [s.output_bytes_per_token for s in specs] == [4 * cfg.hidden] * (cfg.num_blocks + 1) + [0]


def test_unknown_model_lists_the_available_ones():
    with pytest.raises(ValueError, match="gpt2-tiny.*llama2-6.7b|llama2-6.7b.*gpt2-tiny") as error:
        load_model_config("gpt5")
    assert "gpt5" in str(error.value)


def test_invalid_shapes_are_rejected_with_the_setting_to_change():
    with pytest.raises(ValueError, match="model.hidden=100 does not split into model.heads=3.*hidden=102"):
        ModelConfig(hidden=100, heads=3).check()
    with pytest.raises(ValueError, match="model.family='t5'"):
        ModelConfig(family="t5").check()
    with pytest.raises(ValueError, match="kv_heads"):
        ModelConfig(family="gpt2", kv_heads=2).check()
    with pytest.raises(ValueError, match="model.hidden=0"):
        ModelConfig(hidden=0).check()


def test_gpt2_small_is_gpt2_124m_plus_an_untied_head():
    cfg = load_model_config("gpt2-small")
    untied_head = cfg.vocab_size * cfg.hidden  # 38,597,376: the LM head GPT-2 shares with its token embedding
    assert total_params(cfg) - untied_head == 124_439_808  # GPT-2 small's published parameter count
    assert abs(total_params(cfg) - untied_head - 124e6) / 124e6 < 0.03


def test_6_7b_models_have_their_published_sizes():
    gpt3 = load_model_config("gpt3-6.7b")
    assert abs(total_params(gpt3) - gpt3.vocab_size * gpt3.hidden - 6.7e9) / 6.7e9 < 0.03
    # Llama 2 7B unties its head already: its count is exact.
    assert total_params(load_model_config("llama2-6.7b")) == 6_738_415_616


def test_other_models_are_near_their_nominal_sizes():
    # GPT-3 and BERT tie their heads: their published sizes leave out vocab * hidden.
    for name, size in {"gpt3-medium": 350e6, "gpt3-2.7b": 2.7e9, "gpt3-3.35b": 3.35e9, "bert-large": 335e6}.items():
        cfg = load_model_config(name)
        assert abs(total_params(cfg) - cfg.vocab_size * cfg.hidden - size) / size < 0.03, name
    # Sheared-LLaMA-1.3B's shape: 1.35B with its untied head (named "1.3B" by its authors).
    assert total_params(load_model_config("llama2-1.3b")) == 1_345_423_360


def test_gpt2_block_flops_are_its_matmuls_plus_attention():
    cfg = load_model_config("gpt2-small")
    h, s = cfg.hidden, cfg.seq_len
    specs = layer_specs(cfg)
    assert specs[1].fwd_flops_per_token == 2 * 12 * h * h + 4 * s * h  # qkv, proj, 2 MLP matrices; QK^T and AV
    assert specs[-1].fwd_flops_per_token == 2 * h * cfg.vocab_size
    assert specs[0].fwd_flops_per_token == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_built_layers_have_the_specified_parameter_counts(family):
    cfg = tiny(family)
    for spec in layer_specs(cfg):
        layer = build_layer(cfg, spec.index, seed=0)
        assert sum(p.numel() for p in layer.parameters()) == spec.params
        assert all(p.dtype == torch.float32 for p in layer.parameters())


def test_build_layer_depends_on_seed_and_index_only():
    cfg = load_model_config("gpt2-tiny")
    first = build_layer(cfg, 3, seed=7).state_dict()
    torch.manual_seed(123)  # a different global random state ...
    for index in (5, 1, 0):  # ... and other layers built before it
        build_layer(cfg, index, seed=7)
    again = build_layer(cfg, 3, seed=7).state_dict()
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    other_seed = build_layer(cfg, 3, seed=8).state_dict()
    other_block = build_layer(cfg, 4, seed=7).state_dict()
    weight = "layer.attn.c_attn.weight"
    assert not torch.equal(first[weight], other_seed[weight])
    assert not torch.equal(first[weight], other_block[weight])


def test_build_layer_leaves_the_global_random_stream_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    build_layer(load_model_config("gpt2-tiny"), 2, seed=0)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_is_causal(family):
    cfg = tiny(family)
    body = StageModule(cfg, {i: build_layer(cfg, i, seed=0) for i in range(num_layers(cfg) - 1)})
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    changed = ids.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % cfg.vocab_size
    before, after = body(ids), body(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7], rtol=0, atol=1e-6)
    assert (before[:, 7:] - after[:, 7:]).abs().max() > 1e-3  # the later positions do see the change


def run_pipeline(cfg: ModelConfig, cuts: list[int], ids: torch.Tensor, labels: torch.Tensor):
    """Loss and gradients of a model split into stages at `cuts`, each stage built in its own pass."""
    bounds = [0, *cuts, num_layers(cfg)]
    stages = [
        StageModule(cfg, {i: build_layer(cfg, i, seed=3) for i in range(start, stop)})
        for start, stop in zip(bounds, bounds[1:])
    ]
    x = ids
    for stage in stages[:-1]:
        x = stage(x)
    loss = stages[-1](x, labels)
    loss.backward()
    grads = {
        (i, name): p.grad for s in stages for i in range(s.start, s.stop) for name, p in s.layer(i).named_parameters()
    }
    return loss.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_every_split_trains_like_the_whole_model(family):
    cfg = load_model_config("gpt2-tiny") if family == "gpt2" else tiny(family)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    whole_loss, whole_grads = run_pipeline(cfg, [], ids, labels)
    assert abs(whole_loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.5  # near uniform
    for cuts in ([1], [3], [1, 2, num_layers(cfg) - 1], [num_layers(cfg) - 1]):
        loss, grads = run_pipeline(cfg, cuts, ids, labels)
        torch.testing.assert_close(loss, whole_loss, rtol=1e-6, atol=1e-6)
        assert grads.keys() == whole_grads.keys()
        for key in grads:
            torch.testing.assert_close(grads[key], whole_grads[key], rtol=1e-5, atol=1e-7, msg=str(key))


def test_stage_module_checks_its_layers_and_labels():
    cfg = tiny("gpt2")
    with pytest.raises(ValueError, match="contiguous"):
        StageModule(cfg, {1: build_layer(cfg, 1, 0), 3: build_layer(cfg, 3, 0)})
    with pytest.raises(ValueError, match="out of range"):
        StageModule(cfg, {num_layers(cfg): build_layer(cfg, 1, 0)})
    last = StageModule(cfg, {i: build_layer(cfg, i, 0) for i in range(3, num_layers(cfg))})
    assert (last.start, last.stop, last.layer(4) is last.layers["4"]) == (3, 5, True)
    with pytest.raises(ValueError, match="labels"):
        last(torch.zeros(1, cfg.seq_len, cfg.hidden))


def saved_bytes(module: torch.nn.Module, *args: torch.Tensor) -> int:
    """Bytes of the non-parameter float tensors autograd keeps for backward, each storage counted once."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.is_floating_point() and storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    # sdpa's fused CPU kernel, as the fused estimate assumes (a GPU's flash or memory-efficient attention keeps the
    # same); eager attention ignores it.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        module(*args)
    return sum(kept.values())


@pytest.mark.parametrize("attention", ["fused", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_saved_activation_estimate_matches_autograd(family, attention):
    cfg = ModelConfig(name="t", family=family, num_blocks=2, hidden=64, heads=4, vocab_size=300, seq_len=32,
                      attention=attention)  # fmt: skip
    batch, tokens = 2, cfg.seq_len
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens))
    hidden = torch.randn(batch, tokens, cfg.hidden, requires_grad=True)
    for spec in layer_specs(cfg):
        args = {"embedding": (ids,), "block": (hidden,), "head": (hidden, ids)}[spec.kind]
        measured = saved_bytes(build_layer(cfg, spec.index, seed=0), *args) / (batch * tokens)
        # The estimate leaves out per-token scalars (norm statistics) and Llama's shared rotary tables.
        assert spec.saved_bytes_per_token <= measured <= spec.saved_bytes_per_token * 1.03 + 64, spec


A100 = node_spec(ClusterConfig(device="A100-80GB"))


def test_stage_memory_counts_optimizer_state_and_in_flight_activations():
    specs = [
        LayerSpec(0, "embedding", 10, 0.0, 8, 0),
        LayerSpec(1, "block", 100, 1.0, 8, 40),
        LayerSpec(2, "head", 1000, 1.0, 0, 7),
    ]
    costs = CostModel(profile_from_specs("t", specs, A100, micro_batch=2, seq_len=5))
    assert costs.stage_memory(1, 3, in_flight=3) == 16 * 1100 + 3 * 2 * 5 * 47
    assert costs.stage_memory(0, 1, in_flight=3) == 160
    cfg = load_model_config("llama2-6.7b")
    llama = CostModel(profile_from_specs(cfg.name, layer_specs(cfg), A100, micro_batch=1, seq_len=cfg.seq_len))
    # 202M parameters x 16 B = 3.24 GB, plus 4096 tokens x 340 kB of activations = 1.39 GB
    assert 4.5e9 < llama.stage_memory(1, 2, in_flight=1) < 4.8e9


def test_eager_attention_keeps_the_probabilities_and_with_dropout_its_mask_too():
    """Per block and token, beyond fused attention's: a row of probabilities per head (less the log-sum-exp), and
    with dropout the dropped probabilities and the mask's byte per head and position (Korthikanti et al.'s 5as/h
    bytes in half precision)."""
    cfg = ModelConfig(name="t", num_blocks=1, hidden=64, heads=4, vocab_size=300, seq_len=32)
    fused, eager, dropout = (layer_specs(ModelConfig(**{**cfg.__dict__, "attention": a}))[1]
                             for a in ("fused", "eager", "eager_dropout"))  # fmt: skip
    row = cfg.heads * cfg.seq_len
    assert eager.saved_bytes_per_token - fused.saved_bytes_per_token == 4 * (row - cfg.heads)
    assert dropout.saved_bytes_per_token - fused.saved_bytes_per_token == 4 * (2 * row - cfg.heads)
    assert (fused.saved_mask_bytes_per_token, eager.saved_mask_bytes_per_token) == (0, 0)
    assert dropout.saved_mask_bytes_per_token == row
    half = CostModel(profile_from_specs("t", [dropout], A100, micro_batch=1, seq_len=cfg.seq_len, precision="bf16"))
    assert half.profile.layers[0].saved_bytes == cfg.seq_len * (dropout.saved_bytes_per_token // 2 + row)
    with pytest.raises(ValueError, match="model.attention='flash'"):
        ModelConfig(name="t", attention="flash").check()
