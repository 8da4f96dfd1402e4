"""Presets and recipe options through the bindings (no NumPy or torch needed)."""

import pytest

import sagekit

OPTION_KEYS = {"qk_format", "qk_granularity", "smooth_k", "k_mean_stride", "smooth_q", "smooth_v",
               "pv_format", "p_scale", "v_scale", "pv_accum", "p_range", "v_range", "row_sum",
               "inputs"}


def test_presets_list_the_papers_configurations():
    presets = sagekit.presets()
    names = [p["name"] for p in presets]
    for expected in ("sage1_t", "sage1_b", "sage1_vt", "sage1_vb", "sage2_8b", "sage2_4b",
                     "sage2pp_8b", "sage3_fp4", "int_flash"):
        assert expected in names
    assert len(set(names)) == len(names)
    for p in presets:
        assert OPTION_KEYS <= set(p), p
        assert p["paper"] and p["summary"]
        assert isinstance(p["smooth_k"], bool) and isinstance(p["p_range"], float)


def test_presets_match_the_papers():
    by_name = {p["name"]: p for p in sagekit.presets()}
    s2 = by_name["sage2_8b"]
    assert (s2["qk_format"], s2["qk_granularity"], s2["pv_format"], s2["pv_accum"]) == \
        ("int8", "per_thread", "e4m3", "two_level")
    # K smoothing's mean over every 8th key in the Hopper default (and the balanced one built
    # on it) only; the papers' every key elsewhere.
    assert s2["k_mean_stride"] == 8
    sampled = ("sage2_8b", "sage2_8b_balanced")
    assert all(p["k_mean_stride"] == 1 for p in by_name.values() if p["name"] not in sampled)
    balanced = by_name["sage2_8b_balanced"]
    assert balanced["qk_channel_balance"] and not any(
        p["qk_channel_balance"] for p in by_name.values() if p["name"] != "sage2_8b_balanced")
    own = ("name", "qk_channel_balance", "paper", "summary")
    assert {k: v for k, v in balanced.items() if k not in own} == \
        {k: v for k, v in s2.items() if k not in own}
    pp = by_name["sage2pp_8b"]
    assert pp["pv_accum"] == "fp16x2_fp32" and pp["p_range"] == 112.0 and pp["v_range"] == 4.5
    assert by_name["sage3_fp4"]["qk_format"] == "nvfp4"
    assert by_name["int_flash"]["inputs"] == "prequantized_int8"


def test_every_preset_round_trips_as_dict_and_as_spec():
    for p in sagekit.presets():
        assert sagekit.recipe(p["name"]) == p
        assert sagekit.recipe(dict(p)) == p  # descriptive keys are accepted back
        spec = sagekit._C.recipe_spec(p["name"])
        assert sagekit.recipe(spec) == p


def test_recipe_overrides_and_naming():
    r = sagekit.recipe("sage2_8b", pv_accum="fp32")
    assert r["pv_accum"] == "fp32" and r["qk_format"] == "int8"
    assert r["name"] == "custom"
    # A dict that spells out a preset's options is that preset.
    assert sagekit.recipe({"base": "sage2_8b", "pv_accum": "two_level"})["name"] == "sage2_8b"
    assert sagekit.recipe({"qk_granularity": "per_block"})["qk_granularity"] == "per_block"
    assert sagekit.recipe("sage2_8b", name="mine", smooth_k=False)["name"] == "mine"
    # Spec strings: a bare item is the base preset, key=value items override it.
    r = sagekit.recipe("sage2pp_8b, p_range=100, smooth_v=true")
    assert r["p_range"] == 100.0 and r["smooth_v"] is True and r["pv_accum"] == "fp16x2_fp32"
    # K smoothing's stride: an option like the others, and lapsing with smoothing turned off.
    r = sagekit.recipe("sage2_8b, k_mean_stride=1")
    assert r["k_mean_stride"] == 1 and r["name"] == "custom"
    assert sagekit.recipe({"base": "sage1_b", "k_mean_stride": 4})["k_mean_stride"] == 4
    off = sagekit.recipe({"base": "sage2_8b", "smooth_k": False})
    assert off["smooth_k"] is False and off["k_mean_stride"] == 1  # the base's stride lapses
    assert sagekit.recipe("sage2_8b", smooth_k=False)["k_mean_stride"] == 1
    assert sagekit.recipe("sage2_8b", smooth_k="false")["k_mean_stride"] == 1  # the library's spelling
    assert sagekit.recipe("sage1_b", smooth_k=True)["k_mean_stride"] == 1  # the base's own stride
    # PScale's enumerator name and its printed name are both accepted.
    assert sagekit.recipe("sage2_8b,p_scale=static_max")["p_scale"] == "static"


def test_recipe_key_is_parsed_by_the_library():
    from sagekit._recipes import recipe_key

    d = {"base": "sage2pp_8b", "p_range": 100, "smooth_v": True, "paper": "ignored"}
    assert sagekit.recipe(recipe_key(d)) == sagekit.recipe(d)
    assert recipe_key("sage1_b") == "sage1_b"


@pytest.mark.parametrize("spec, argument", [
    ("nope", "recipe"),
    ({"foo": 1}, "recipe"),
    ({"pv_accum": "fp99"}, "recipe.pv_accum"),
    ({"smooth_k": "maybe"}, "recipe.smooth_k"),
    ({"p_range": "wide"}, "recipe.p_range"),
    ({"p_range": [1]}, "recipe.p_range"),
    ({"qk_format": "nvfp4"}, "recipe.qk_granularity"),          # validate_recipe
    ({"pv_format": "fp16"}, "recipe.p_scale"),                   # validate_recipe
    ({"base": "sage2_8b", "pv_accum": "fp16"}, "recipe.pv_accum"),
    ({"p_range": -1.0}, "recipe.p_range"),
    ({"k_mean_stride": 0}, "recipe.k_mean_stride"),
    ({"k_mean_stride": 2.5}, "recipe.k_mean_stride"),
    ({"k_mean_stride": "every"}, "recipe.k_mean_stride"),
    ({"base": "sage2_8b", "smooth_k": False, "k_mean_stride": 4}, "recipe.k_mean_stride"),
    ({}, "recipe"),
    ("sage2_8b,pv_accum=fp32,pv_accum=fp16", "recipe.pv_accum"),
    ("sage2_8b,sage1_b", "recipe"),
    (42, "recipe"),
    # A bare option name lacks its value; it used to read as a second base ("gives base twice").
    ("sage2_8b,pv_accum", "recipe.pv_accum"),
    ("pv_accum", "recipe.pv_accum"),
    # Numeric ranges (validate_recipe): the values, refused under the option's name.
    ("sage2_8b,p_range=1e40", "recipe.p_range"),
    ("sage2_8b,p_range=1000", "recipe.p_range"),
    ("sage2_8b,p_range=1e-45", "recipe.p_range"),
    ("sage2_8b,v_range=1e40", "recipe.v_range"),
    ({"base": "sage2_8b", "v_range": 500.0}, "recipe.v_range"),
    ({"base": "sage1_vb", "p_range": 128}, "recipe.p_range"),
    ({"base": "sage2pp_8b", "p_range": 448}, "recipe.p_range"),  # 64 * 448 * 4.5 > 65504
    ({"base": "sage2_8b", "k_mean_stride": 2 ** 20 + 1}, "recipe.k_mean_stride"),
])
def test_recipe_errors_name_the_option(spec, argument):
    with pytest.raises(ValueError) as info:
        sagekit.recipe(spec)
    err = info.value
    assert isinstance(err, sagekit.ArgumentError)
    assert err.argument == argument
    assert str(err).startswith(argument + ":"), str(err)


def test_range_errors_say_the_range_and_the_value():
    with pytest.raises(sagekit.ArgumentError) as info:
        sagekit.recipe("sage2_8b", p_range=1000)
    assert "from 1 to 448" in str(info.value) and "(got 1000)" in str(info.value)
    with pytest.raises(sagekit.ArgumentError) as info:
        sagekit.recipe("sage2_8b,pv_accum")
    assert "pv_accum=VALUE" in str(info.value) and "twice" not in str(info.value)
    assert sagekit.recipe("sage2_8b", p_range=448, v_range=1)["p_range"] == 448.0


def test_python_md_recipe_example_is_current():
    # docs/python.md shows a recipe summary; it must be what the library prints today.
    import pathlib
    import re

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "python.md").read_text()
    m = re.search(r'>>> (sagekit\.recipe\("sage2_8b", qk_granularity="per_block"\)\["summary"\])\n'
                  r"'(.*)'\n", doc)
    assert m, "docs/python.md lost its recipe summary example"
    assert m.group(2) == sagekit.recipe("sage2_8b", qk_granularity="per_block")["summary"]


def test_unknown_preset_error_lists_the_presets():
    with pytest.raises(sagekit.ArgumentError) as info:
        sagekit.recipe("sage9")
    assert "sage2_8b" in str(info.value) and "sage9" in str(info.value)


def test_recipe_key_errors_name_the_option():
    from sagekit._recipes import recipe_key

    with pytest.raises(sagekit.ArgumentError) as info:
        recipe_key({"name": "a,b"})
    assert info.value.argument == "recipe.name"
    with pytest.raises(sagekit.ArgumentError) as info:
        recipe_key(3.0)
    assert info.value.argument == "recipe"


def test_build_facts_are_reported():
    assert isinstance(sagekit.cuda_built, bool)
    assert isinstance(sagekit.gpu_available(), bool)
    dims = sagekit.gpu_head_dims()
    assert isinstance(dims, list) and all(isinstance(d, int) for d in dims)
    if not sagekit.cuda_built:
        assert sagekit.gpu_available() is False
    assert sagekit.__version__.count(".") >= 1
