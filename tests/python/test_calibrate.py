"""sagekit.calibrate on a two-layer model whose right answer is known by construction."""
import json

import pytest

np = pytest.importorskip("numpy", reason="needs numpy")
import sagekit  # noqa: E402


def _layer(rng, k_bias):
    q = rng.standard_normal((2, 2, 128, 64)).astype(np.float16)
    k = (rng.standard_normal((2, 2, 128, 64)) + k_bias).astype(np.float16)
    v = rng.standard_normal((2, 2, 128, 64)).astype(np.float16)
    return q, k, v


def test_fastest_passing_recipe_per_layer(tmp_path):
    rng = np.random.default_rng(0)
    # Layer 0: plain Gaussian inputs, both candidates are accurate, so the faster one wins.
    # Layer 1: K carries a large per-channel bias. It leaves exact attention unchanged, and
    # sage2_8b's K smoothing removes it, but int_flash_q (per-token INT8, no smoothing) loses
    # most of the scores' precision to it and falls below the threshold.
    bias = 60.0 * rng.standard_normal(64)
    layers = [_layer(rng, 0.0), _layer(rng, bias)]
    speeds = [dict(recipe="int_flash_q", d=64, causal=False, n=128, tops=900.0),
              dict(recipe="sage2_8b", d=64, causal=False, n=128, tops=500.0)]
    out = tmp_path / "choices.json"
    cal = sagekit.calibrate(layers, speeds, recipes=["sage2_8b", "int_flash_q"], threshold=0.99,
                            out=out)
    chosen = [layer["recipe"] for layer in cal["layers"]]
    assert chosen == ["int_flash_q", "sage2_8b"], cal
    assert all(layer["passed"] for layer in cal["layers"])
    assert json.loads(out.read_text()) == cal
    assert sagekit.load_layer_choices(out) == chosen


def test_no_candidate_passes_is_reported_not_hidden():
    rng = np.random.default_rng(1)
    speeds = [dict(recipe="sage2_8b", d=64, causal=False, n=128, tops=500.0)]
    cal = sagekit.calibrate([_layer(rng, 0.0)], speeds, recipes=["sage2_8b"], threshold=1.0 - 1e-12)
    assert cal["layers"][0]["passed"] is False
    assert cal["layers"][0]["recipe"] == "sage2_8b"


def test_errors_name_the_argument():
    rng = np.random.default_rng(2)
    with pytest.raises(ValueError, match="threshold"):
        sagekit.calibrate([_layer(rng, 0.0)], [], recipes=["sage2_8b"], threshold=1.5)
    with pytest.raises(ValueError, match="candidates"):
        sagekit.calibrate([_layer(rng, 0.0)], [], recipes=["int_flash"])
    with pytest.raises(ValueError, match="layers"):
        sagekit.calibrate([(1, 2)], [])


def test_float32_samples_are_rounded_like_the_cli():
    # `sage calibrate` rounds float32 .npy files to float16; sagekit.calibrate used to refuse
    # float32 arrays instead. Both now score the float16 values the kernels would be given.
    rng = np.random.default_rng(3)
    layer = _layer(rng, 0.0)
    speeds = [dict(recipe="sage2_8b", d=64, causal=False, n=128, tops=500.0)]
    f16 = sagekit.calibrate([layer], speeds, recipes=["sage2_8b"])
    f32 = sagekit.calibrate([tuple(x.astype(np.float32) for x in layer)], speeds,
                            recipes=["sage2_8b"])
    assert f32 == f16


@pytest.mark.parametrize("tensor, value, word", [(0, np.nan, "NaN"), (2, np.inf, "Inf")])
def test_non_finite_samples_are_refused_by_name(tensor, value, word):
    # A layer holding NaN/Inf used to get a recipe with cosine 0 or None.
    rng = np.random.default_rng(4)
    layer = list(_layer(rng, 0.0))
    layer[tensor] = layer[tensor].copy()
    layer[tensor][1, 0, 7, 5] = value
    with pytest.raises(sagekit.ArgumentError) as info:
        sagekit.calibrate([_layer(rng, 0.0), tuple(layer)], [], recipes=["sage2_8b"])
    assert info.value.argument == "layers"
    name = "qkv"[tensor]
    where = "[batch, head, token, channel] = [1, 0, 7, 5]"
    assert f"layer 1: {name}: holds {word} at {where}" in str(info.value)


def test_scale_errors_name_scale():
    rng = np.random.default_rng(5)
    with pytest.raises(sagekit.ArgumentError) as info:
        sagekit.calibrate([_layer(rng, 0.0)], [], recipes=["sage2_8b"], scale=0)
    assert info.value.argument == "scale"
