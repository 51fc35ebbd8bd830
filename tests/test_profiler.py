"""Profiles: the cache key, the cache, analytic profiles from the device table, and a real measurement."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time

import pytest

from ftlab.experiments.check_device_profile import matching_spec
from ftlab.runtime.processes import profiler
from ftlab.runtime.core.config import ClusterConfig
from ftlab.runtime.core.devices import DEVICES, node_spec
from ftlab.runtime.core.model_spec import layer_specs, load_model_config
from ftlab.runtime.core.costs import LayerProfile
from ftlab.runtime.processes.profiler import ProfileKey, analytic_profile, measure_links, measure_profile

TINY = load_model_config("gpt2-tiny")


def a_key(**change: object) -> ProfileKey:
    key = ProfileKey(
        model=json.dumps(dataclasses.asdict(TINY), sort_keys=True), micro_batch=2, seq_len=64, dtype="float32",
        device="cpu", torch_version="2.13.0", workers_per_node=1, repeats=3, warmup=1, links=False,
    )
    return dataclasses.replace(key, **change)


@pytest.mark.parametrize(
    "field, value",
    [
        ("model", json.dumps(dataclasses.asdict(dataclasses.replace(TINY, hidden=256)), sort_keys=True)),
        ("micro_batch", 4), ("seq_len", 32), ("dtype", "bfloat16"), ("device", "cuda: A100"),
        ("torch_version", "2.14.0"), ("workers_per_node", 2), ("repeats", 5), ("warmup", 2), ("links", True),
    ],
)
def test_every_field_changes_the_cache_key(field: str, value: object) -> None:
    assert {f.name for f in dataclasses.fields(ProfileKey)} >= {field}
    assert a_key(**{field: value}).digest() != a_key().digest()


@pytest.fixture
def counted_measurements(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Replace the per-layer measurement by a fast fake that records (layer, micro-batch) it was asked for."""
    calls: list[tuple[int, int]] = []

    def fake(cfg, index, micro_batch, seq_len, dtype, device, repeats, warmup, clock) -> LayerProfile:  # noqa: ANN001
        calls.append((index, micro_batch))
        return LayerProfile(1e-3 * micro_batch, 1e-3, 1e-3, 4, 12, 8 * micro_batch, 16 * micro_batch)

    monkeypatch.setattr(profiler, "measure_layer", fake)
    return calls


def test_a_cached_profile_is_reused_for_the_same_setting(tmp_path, counted_measurements) -> None:
    first = measure_profile(TINY, 2, 32, links=False, cache_dir=tmp_path)
    measured = len(counted_measurements)
    assert measured == len(first.layers) > 0
    again = measure_profile(TINY, 2, 32, links=False, cache_dir=tmp_path)
    assert again == first and len(counted_measurements) == measured


def test_a_cached_profile_is_never_used_for_another_setting(tmp_path, counted_measurements) -> None:
    first = measure_profile(TINY, 2, 32, links=False, cache_dir=tmp_path)
    other = measure_profile(TINY, 4, 32, links=False, cache_dir=tmp_path)
    assert other.micro_batch == 4 and other.layers[0].fwd_s == pytest.approx(2 * first.layers[0].fwd_s)
    assert {mb for _, mb in counted_measurements} == {2, 4}


def test_a_cache_file_whose_key_differs_is_ignored(tmp_path, counted_measurements) -> None:
    measure_profile(TINY, 2, 32, links=False, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.json")
    stored = json.loads(path.read_text())
    stored["key"]["micro_batch"] = 3  # as if another setting had landed on this file name
    path.write_text(json.dumps(stored))
    before = len(counted_measurements)
    measure_profile(TINY, 2, 32, links=False, cache_dir=tmp_path)
    assert len(counted_measurements) == 2 * before


def test_measured_again_the_cache_keeps_each_layers_fastest(tmp_path) -> None:
    """``again`` measures even where a profile is cached and caches, per layer, the faster of the two: a cached
    layer made a million times faster stays as cached, one made a million times slower takes the new measurement."""
    setting = dict(micro_batch=1, seq_len=16, repeats=1, warmup=0, links=False, cache_dir=tmp_path)
    measure_profile(TINY, **setting)
    (path,) = tmp_path.glob("*.json")
    stored = json.loads(path.read_text())
    fast, slow = stored["profile"]["layers"][0], stored["profile"]["layers"][1]
    fast["fwd_s"] *= 1e-6
    slow["fwd_s"] *= 1e6
    path.write_text(json.dumps(stored))
    again = measure_profile(TINY, again=True, **setting)
    assert again.layers[0].fwd_s == fast["fwd_s"]
    assert 0 < again.layers[1].fwd_s < slow["fwd_s"] * 1e-3
    assert measure_profile(TINY, **setting) == again  # what it cached


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_analytic_profiles_are_positive_and_scale_with_the_micro_batch(name: str) -> None:
    cfg = load_model_config("gpt3-2.7b")
    node = node_spec(ClusterConfig(device=name))
    one, two = analytic_profile(cfg, node, 1, 2048), analytic_profile(cfg, node, 2, 2048)
    assert one.device_memory_bytes == DEVICES[name].memory_bytes > 0
    assert min(one.p2p_bytes_per_s, one.intra_node_allreduce_bytes_per_s, one.inter_node_allreduce_bytes_per_s) > 0
    for a, b in zip(one.layers, two.layers):
        assert min(a.fwd_s, a.bwd_input_s, a.bwd_weight_s, a.param_bytes, a.optimizer_bytes) > 0
        assert b.fwd_s == pytest.approx(2 * a.fwd_s) and b.saved_bytes == 2 * a.saved_bytes
        assert b.param_bytes == a.param_bytes and b.bwd_input_s + b.bwd_weight_s == pytest.approx(2 * b.fwd_s)
    assert one.layers[-1].output_bytes == 0 and one.layers[1].output_bytes == 4 * cfg.hidden * 2048


def test_faster_gpus_give_faster_profiles() -> None:
    cfg = load_model_config("gpt3-medium")
    v100, h100 = (analytic_profile(cfg, node_spec(ClusterConfig(device=name)), 1, 2048)
                  for name in ("V100-16GB", "H100-80GB"))  # fmt: skip
    assert h100.layers[1].fwd_s < v100.layers[1].fwd_s


@pytest.mark.parametrize(
    ("reported", "spec"),
    [("NVIDIA H200", "H200-141GB"), ("NVIDIA H100 80GB HBM3", "H100-80GB"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
     ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA A40", "A40"), ("Tesla V100-SXM2-16GB", "V100-16GB")],
)  # fmt: skip
def test_the_device_check_compares_a_gpu_with_its_own_datasheet_entry(reported: str, spec: str) -> None:
    assert matching_spec(reported) == spec


def test_the_device_check_refuses_a_gpu_with_no_entry_and_says_what_to_pass() -> None:
    with pytest.raises(SystemExit, match="pass --spec"):
        matching_spec("NVIDIA GeForce RTX 4090")


def test_measuring_gpt2_tiny_gives_positive_times_and_true_sizes() -> None:
    profile = measure_profile(TINY, micro_batch=1, seq_len=16, repeats=1, warmup=0, links=False, cache_dir=None)
    specs = layer_specs(TINY)
    assert len(profile.layers) == len(specs)
    for layer, spec in zip(profile.layers, specs):
        assert layer.fwd_s > 0 and layer.bwd_weight_s > 0 and layer.optimizer_s > 0
        assert layer.param_bytes == 4 * spec.params and layer.optimizer_bytes == 12 * spec.params
    assert all(layer.bwd_input_s > 0 for layer in profile.layers[1:])  # the embedding's input is token ids
    assert all(layer.output_bytes == 4 * 16 * TINY.hidden for layer in profile.layers[:-1])
    assert all(layer.saved_bytes > 0 for layer in profile.layers[1:])
    assert math.isinf(profile.p2p_bytes_per_s)  # links=False: communication not measured


def test_a_layers_checkpoint_bytes_are_what_the_runtime_writes_of_it() -> None:
    from ftlab.runtime.training.layer_state import encode, layer_state
    from ftlab.runtime.training.model import build_layer
    from ftlab.runtime.training.optim import OptimSettings, layer_optimizer

    profile = analytic_profile(TINY, node_spec(ClusterConfig(device="A100-40GB")), 1, 16)
    for index, costed in enumerate(profile.layers):
        layer = build_layer(TINY, index, seed=0)
        optimizer = layer_optimizer(layer, OptimSettings(1e-3, 1e-4, 1, 10, 0.01, 0.9, 0.95))
        for p in layer.parameters():
            p.grad = p.detach().clone()
        optimizer.step()  # the moments exist, as in a trained layer
        written = len(encode(layer_state(layer, optimizer)))
        assert written == pytest.approx(costed.checkpoint_bytes, rel=0.02), index
        assert costed.state_bytes > 1.3 * written  # what the layer holds: its gradient too


NEIGHBOUR = """
import sys, time
turn_s = float(sys.argv[1])
while sys.stdin.readline():
    end = time.thread_time() + turn_s
    while time.thread_time() < end:
        pass
    print(flush=True)
"""
"""A process beside the layer: on each line it reads, it computes for ``turn_s`` of its own CPU time, then answers."""


class SharedCore:
    """A layer clock (the wall clock with ``wall``, else the thread's CPU clock): after each reading, a process
    beside the layer takes its turn of ``turn_s`` CPU seconds while the layer's thread waits for it, as the scheduler
    makes a thread wait while another process has its core. Every span between two readings therefore holds one such
    turn. Each reading is noted on both clocks."""

    def __init__(self, turn_s: float, wall: bool) -> None:
        self.turn_s, self.wall = turn_s, wall
        self.readings: list[tuple[float, float]] = []
        self.neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(turn_s)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True)  # fmt: skip

    def __call__(self) -> float:
        cpu, wall = time.thread_time(), time.perf_counter()
        self.readings.append((cpu, wall))
        assert self.neighbour.stdin is not None and self.neighbour.stdout is not None
        self.neighbour.stdin.write("\n")
        self.neighbour.stdin.flush()
        self.neighbour.stdout.readline()  # back once the neighbour's turn is over
        return wall if self.wall else cpu

    def spans(self) -> list[tuple[float, float]]:
        """(CPU seconds, wall seconds) between each two readings in a row."""
        return [(c1 - c0, w1 - w0) for (c0, w0), (c1, w1) in zip(self.readings, self.readings[1:])]

    def close(self) -> None:
        self.neighbour.kill()
        self.neighbour.wait()


def test_a_one_thread_cpu_layer_is_not_charged_for_a_process_beside_it_on_its_core() -> None:
    """On a shared machine, the time another process takes of the core is not the layer's: the one-thread CPU clock
    leaves it out, where the wall clock counts it. The neighbour takes a known turn inside every timed span, so what
    each clock charges follows from the turn alone, however fast or busy the machine is."""
    import torch

    assert profiler.layer_clock("cpu", 1) is time.thread_time
    assert profiler.layer_clock("cpu", 0) is time.perf_counter and profiler.layer_clock("cuda:0", 1) is time.perf_counter
    turn_s, threads = 0.05, torch.get_num_threads()
    cpu_clock, wall_clock = SharedCore(turn_s, wall=False), SharedCore(turn_s, wall=True)
    torch.set_num_threads(1)
    try:
        cpu = profiler.measure_layer(TINY, 1, 2, 16, torch.float32, "cpu", 2, 0, cpu_clock)
        wall = profiler.measure_layer(TINY, 1, 2, 16, torch.float32, "cpu", 2, 0, wall_clock)
    finally:
        cpu_clock.close()
        wall_clock.close()
        torch.set_num_threads(threads)
    spans = cpu_clock.spans()
    assert cpu.fwd_s in [cpu_s for cpu_s, _ in spans]  # the layer's forward is one of these spans ...
    for cpu_s, wall_s in spans:
        assert 0 < cpu_s <= wall_s - turn_s  # ... and none charges the layer for the neighbour's turn
    assert min(wall.fwd_s, wall.optimizer_s) >= turn_s  # where the wall clock charges it for all of it


def test_link_bandwidths_and_latency_between_two_gloo_processes_are_positive() -> None:
    p2p, allreduce, latency = measure_links(nbytes=1 << 20, rounds=2)
    assert 0 < p2p < math.inf and 0 < allreduce < math.inf and 0 < latency < math.inf


def test_two_workers_at_half_their_speed_alone_are_one_cores_worth_whatever_a_busy_machine_did_to_a_sweep() -> None:
    """``cores_by_load`` counts what the workers' layers get side by side, against each alone: two sharing one core
    at half their solo rates each are one core's worth together, whatever those rates are. One sweep whose solo
    reference other load slowed moves no median, and a process starved side by side still counts a little."""
    half = ((10.0, 4.0), (5.0, 2.0))
    spoiled = ((5.0, 4.0), (5.0, 2.0))  # the first process's solo run at half speed: 1.5 cores' worth
    load = profiler.HostLoad((half, spoiled, half))
    assert load.worth == (1.0, 1.0)
    assert load.alone == (10.0, 4.0)
    assert profiler.HostLoad((spoiled,)).worth == (1.0, 1.5)
    assert profiler.HostLoad((((10.0, 4.0), (0.0, 0.0)),)).worth == (1.0, 0.05)


def test_every_sweep_times_each_process_alone_then_side_by_side() -> None:
    """Each sweep gives every process's rate alone and the worth of each number side by side, counted against those
    rates: one alone is worth 1 by construction (how fast it runs against its charge is the caller's to count, from
    ``alone``)."""
    ranges = [(0, 2), (2, len(layer_specs(TINY)))]
    load = profiler.cores_by_load(TINY, ranges, micro_batch=2, seq_len=16, seconds=0.5, sweeps=2)
    assert load.worth[0] == 1.0 and all(rate > 0 for rate in load.alone) and load.worth[1] >= 0.05
    assert all(rate > 0 for sweep in load.sweeps for rates in sweep for rate in rates)  # each computed at least once
    assert len(load.sweeps) == 2 and all(len(sweep) == len(ranges) for sweep in load.sweeps)
