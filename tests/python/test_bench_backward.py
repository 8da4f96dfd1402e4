"""bench/bench_backward.py's gradient-accuracy rows from the CPU simulator (torch, no GPU):
sagebwd and its INT8-dP ablation on the GPU rows' inputs; and the records in bench/results."""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import needs_torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "h100_backward_accuracy.json"
SIMULATOR_IMPLS = ("simulator", "simulator-int8dp")


def _bench():
    sys.path.insert(0, str(ROOT / "bench"))  # its sibling modules (cuda_timing)
    spec = importlib.util.spec_from_file_location("bench_backward", ROOT / "bench" / "bench_backward.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_backward"] = module
    spec.loader.exec_module(module)
    return module


def _args(**kw):
    args = dict(distributions="normal,v_bias", acc_n=256, acc_heads=1, recipe="sagebwd",
                accuracy_impls=",".join(SIMULATOR_IMPLS))
    args.update(kw)
    return argparse.Namespace(**args)


@needs_torch
def test_simulator_rows_have_the_gpu_rows_keys_and_show_the_ablation():
    bb = _bench()
    rows = bb.accuracy(_args())
    assert [(r["distribution"], r["impl"]) for r in rows] == \
        [(d, i) for d in ("normal", "v_bias") for i in SIMULATOR_IMPLS]
    gpu_keys = set(json.loads(RESULTS.read_text())[0])
    by = {(r["distribution"], r["impl"]): r for r in rows}
    for r in rows:
        assert set(r) == gpu_keys | {"heads"}  # the GPU records predate the key
        assert r["recipe"] == "sagebwd" + ("" if r["impl"] == "simulator" else ",dp_format=int8")
        assert (r["n"], r["d"], r["heads"], r["dtype"]) == (256, 128, 1, "bfloat16")
        assert not (r["dq_nan"] or r["dk_nan"] or r["dv_nan"])
        assert min(r["dq_cosine"], r["dk_cosine"]) > 0.99 and r["dv_cosine"] > 0.999
    for dist in ("normal", "v_bias"):
        fp16, int8 = by[(dist, SIMULATOR_IMPLS[0])], by[(dist, SIMULATOR_IMPLS[1])]
        # dV = P^T dO never sees dP, so the ablation leaves it bit for bit as it was.
        assert int8["dv_rel_l1"] == fp16["dv_rel_l1"]
        assert int8["dq_rel_l1"] > fp16["dq_rel_l1"]
    # V's channel bias makes dP a large common part that dP - D cancels: INT8 dO and V lose the rest.
    fp16, int8 = by[("v_bias", SIMULATOR_IMPLS[0])], by[("v_bias", SIMULATOR_IMPLS[1])]
    assert int8["dq_rel_l1"] > 1.3 * fp16["dq_rel_l1"]


@needs_torch
def test_gpu_rows_are_skipped_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present, so the GPU rows would run")
    bb = _bench()
    rows = bb.accuracy(_args(distributions="normal", accuracy_impls="sagekit,simulator"))
    assert [r["impl"] for r in rows] == ["simulator"]
    with pytest.raises(ValueError, match="unknown --accuracy-impls"):
        bb.accuracy(_args(accuracy_impls="sagebwd-int4"))


@needs_torch
def test_merge_keeps_the_other_records_grouped_by_distribution():
    bb = _bench()
    old = [{"distribution": d, "impl": i, "x": 0} for d in ("a", "b") for i in ("gpu", "sim")]
    new = [{"distribution": d, "impl": "sim", "x": 1} for d in ("a", "b")] + \
        [{"distribution": "c", "impl": "sim", "x": 1}]
    merged = bb.merged_records(old, new)
    assert [(r["distribution"], r["impl"], r["x"]) for r in merged] == \
        [("a", "gpu", 0), ("a", "sim", 1), ("b", "gpu", 0), ("b", "sim", 1), ("c", "sim", 1)]


def test_recorded_simulator_rows_match_the_gpu_rows():
    """The committed records: the simulator's sagebwd rows reproduce the H100's (same inputs, the
    kernel's quantization bit for bit), so the ablation's rows are read against the same inputs."""
    rows = json.loads(RESULTS.read_text())
    by = {(r["distribution"], r["impl"]): r for r in rows}
    dists = sorted({r["distribution"] for r in rows})
    assert len(dists) == 5
    for dist in dists:
        gpu, sim, int8 = (by[(dist, i)] for i in ("sagekit",) + SIMULATOR_IMPLS)
        assert gpu["recipe"] == sim["recipe"] == "sagebwd"  # the records' kernel: dS per token
        assert (sim["n"], sim["d"], sim["heads"]) == (int8["n"], int8["d"], int8["heads"]) == (4096, 128, 2)
        for g in ("dq", "dk", "dv"):
            assert sim[f"{g}_cosine"] == pytest.approx(gpu[f"{g}_cosine"], abs=1e-5)
            assert sim[f"{g}_rel_l1"] == pytest.approx(gpu[f"{g}_rel_l1"], rel=0.01)
        assert int8["dq_rel_l1"] > sim["dq_rel_l1"] and int8["dv_rel_l1"] == sim["dv_rel_l1"]
    assert by[("v_bias", SIMULATOR_IMPLS[1])]["dq_rel_l1"] > 2 * by[("v_bias", SIMULATOR_IMPLS[0])]["dq_rel_l1"]
