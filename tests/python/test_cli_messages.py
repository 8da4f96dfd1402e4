"""The `sage` command's messages name what the user typed.

The binary comes from $SAGE_CLI, else the newest build*/cli/sage of this checkout (scripts/
test.sh builds build/cli/sage before running pytest); without one these tests skip visibly.
"""

import math
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _find_sage():
    given = os.environ.get("SAGE_CLI")
    if given:
        return given
    built = sorted(ROOT.glob("build*/cli/sage"), key=lambda p: p.stat().st_mtime)
    return str(built[-1]) if built else None


SAGE = _find_sage()
pytestmark = pytest.mark.skipif(SAGE is None, reason="no sage binary: set SAGE_CLI or build "
                                "build/cli/sage (scripts/test.sh does)")


def sage(*args):
    res = subprocess.run([SAGE, *args], capture_output=True, text=True, timeout=300)
    return res.returncode, res.stdout + res.stderr


def test_docs_out_error_names_out(tmp_path):
    rc, out = sage("docs", "--out", str(tmp_path / "missing" / "recipes.md"))
    assert rc == 2
    assert "sage docs: --out " in out and "--json" not in out, out


def test_check_help_lists_every_row_sum():
    rc, out = sage("check", "--help")
    assert rc == 0
    line = next(l for l in out.splitlines() if l.strip().startswith("--row-sum"))
    assert "float_p|quantized_p|pv_mma" in line, line


def test_check_p_range_outside_the_format_names_the_flag_and_the_range():
    rc, out = sage("check", "--device", "cpu", "--recipe", "sage2_8b", "--p-range", "1000")
    assert rc == 2
    assert "--p-range does not suit sage2_8b" in out and "recipe.p_range" in out, out
    assert "from 1 to 448" in out and "(got 1000)" in out, out


def test_calibrate_refuses_nan_samples_by_name(tmp_path):
    np = pytest.importorskip("numpy", reason="needs numpy")
    rng = np.random.default_rng(0)
    for name in "qkv":
        x = rng.standard_normal((1, 2, 64, 64)).astype(np.float32)
        if name == "k":
            x[0, 1, 3, 2] = math.nan
        np.save(tmp_path / f"layer0_{name}.npy", x)
    speeds = tmp_path / "speeds.json"
    speeds.write_text('[{"impl": "sagekit", "recipe": "sage2_8b", "d": 64, "causal": false, '
                      '"n": 64, "tops": 100.0}]')
    rc, out = sage("calibrate", "--inputs", str(tmp_path), "--speeds", str(speeds),
                   "--recipes", "sage2_8b", "--out", str(tmp_path / "choice.json"))
    assert rc == 2
    assert "--inputs layer 0: k: holds NaN at [batch, head, token, channel] = [0, 1, 3, 2]" in out, out
    assert not (tmp_path / "choice.json").exists()


def test_bench_schedule_flags_name_the_flag():
    rc, out = sage("bench", "--order", "fastest")
    assert rc == 2
    assert "--order" in out and "fastest" in out and "strided" in out, out
    rc, out = sage("bench", "--items-per-cta", "-1")
    assert rc == 2
    assert "--items-per-cta" in out, out
