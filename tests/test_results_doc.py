"""``docs/results.md`` is written section by section: replacing one keeps the others, and writing the same figures
twice changes nothing."""

from __future__ import annotations

from pathlib import Path

from ftlab.experiments import results_doc


def test_replacing_a_section_keeps_the_others_and_is_idempotent() -> None:
    text = results_doc.replace_section("# Results\n", "bench_a", "## A\n\nold")
    text = results_doc.replace_section(text, "bench_b", "## B\n\nkept")
    replaced = results_doc.replace_section(text, "bench_a", "## A\n\nnew")
    assert "new" in replaced and "old" not in replaced
    assert replaced.index("bench_a") < replaced.index("bench_b"), "a replaced section keeps its place"
    assert replaced.replace("new", "old") == text, "nothing outside the section moved"
    assert results_doc.replace_section(replaced, "bench_a", "## A\n\nnew") == replaced


def test_a_section_whose_name_begins_another_is_its_own() -> None:
    text = results_doc.replace_section("# Results\n", "bench_simulator_scale", "scale")
    text = results_doc.replace_section(text, "bench_simulator", "validation")
    text = results_doc.replace_section(text, "bench_simulator", "validation again")
    assert "scale" in text and "validation again" in text and text.count("<!-- bench_simulator -->") == 1


def test_write_section_gives_the_table_the_command_and_the_commit(tmp_path: Path) -> None:
    path = tmp_path / "results.md"
    rows = [{"nodes": 8, "seconds": 0.012345, "optimal": True, "nested": {"left": "out"}, "rounds": [1.5, 2.0]}]
    results_doc.write_section("bench_x", "X", {"Templates": rows}, ["--quick"], path=path)
    results_doc.write_section("bench_y", "Y", {"": {"ratio": 1.0, "model": "gpt2-tiny"}}, [], path=path)
    first = path.read_text()
    results_doc.write_section("bench_x", "X", {"Templates": rows}, ["--quick"], path=path)
    assert path.read_text() == first
    assert first.startswith("# Results")
    assert "| nodes | seconds | optimal | rounds |" in first and "| 8 | 0.01235 | yes | 1.5 / 2 |" in first
    assert "`python -m ftlab.experiments.bench_x --quick`" in first
    assert f"(commit {results_doc.commit()}" in first
    assert "| ratio | 1 |" in first and "| model | gpt2-tiny |" in first


def test_the_commit_is_unknown_outside_a_checkout(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(results_doc, "REPO", tmp_path)
    assert results_doc.commit() == "unknown"
