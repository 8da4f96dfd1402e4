"""bench/records.py: one grid from several runs of bench_sdpa.py, and its Markdown table
(no GPU, no torch)."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("records", ROOT / "bench" / "records.py")
records = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(records)


def rec(impl, ms, n=1024, whole_call=True, ops=1e12):
    return {"impl": impl, "recipe": "sage2_8b", "d": 128, "causal": False, "n": n, "batch": 32,
            "heads": 32, "dtype": "float16", "whole_call": whole_call, "ms": ms,
            "tops": ops / (ms * 1e-3) / 1e12, "device": "GPU"}


def run(sage_ms, kernel_ms, cudnn_ms):
    return [rec("sagekit", sage_ms), rec("sagekit", kernel_ms, whole_call=False),
            rec("torch-cudnn", cudnn_ms)]


def test_median_per_point_and_implementation():
    runs = [run(1.0, 0.8, 1.2), run(1.3, 0.7, 0.9), run(1.1, 0.9, 1.0)]
    merged = records.median_of_runs(runs)
    assert [(r["impl"], r["whole_call"]) for r in merged] == \
        [("sagekit", True), ("sagekit", False), ("torch-cudnn", True)]
    assert [r["ms"] for r in merged] == [1.1, 0.8, 1.0]
    assert merged[0]["runs_ms"] == [1.0, 1.3, 1.1]
    # TOPS follow the median time, from the same operation count (1e12 ops here).
    for r in merged:
        assert r["tops"] == pytest.approx(1e12 / (r["ms"] * 1e-3) / 1e12)
    # The inputs are left as they were.
    assert runs[0][0]["ms"] == 1.0 and "runs_ms" not in runs[0][0]


def test_even_run_count_takes_the_mean_of_the_middle_two():
    merged = records.median_of_runs([run(1.0, 1.0, 1.0), run(2.0, 1.0, 1.0)])
    assert merged[0]["ms"] == 1.5


def test_a_point_missing_from_a_run_is_an_error():
    short = run(1.0, 0.8, 1.2)[:2]
    with pytest.raises(ValueError, match="missing from runs \\[1\\]"):
        records.median_of_runs([run(1.0, 0.8, 1.2), short])
    with pytest.raises(ValueError, match="missing from run 0"):
        records.median_of_runs([short, run(1.0, 0.8, 1.2)])


def test_a_point_twice_in_a_run_is_an_error():
    doubled = run(1.0, 0.8, 1.2) + [rec("sagekit", 0.5)]
    with pytest.raises(ValueError, match="twice"):
        records.median_of_runs([doubled, run(1.0, 0.8, 1.2)])


def test_markdown_names_the_runs_and_ratios():
    merged = records.median_of_runs([run(1.0, 0.8, 1.2), run(1.0, 0.8, 1.2), run(1.0, 0.8, 1.2)])
    lines = records.markdown_table(merged, "GPU", 10, "sage2_8b", runs=3)
    assert "median of 10 CUDA-event timings, then the median of 3 runs" in lines[0]
    # sagekit 1000 TOPS, kernel-only 1250, no flash record, cuDNN 833: vs cuDNN 1.20.
    assert lines[-1] == "| float16 | 128 | no | 1024 | 1000 | 1250 | nan | 833 | nan | 1.20 |"
    single = records.markdown_table(merged, "GPU", 10, "sage2_8b")
    assert "then the median" not in single[0]
