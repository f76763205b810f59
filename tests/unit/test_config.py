"""Shape profiles and build configs: parsing, consistency errors (exact messages), build-key hashing."""

from __future__ import annotations

import pytest

from miaohui.config import BuildConfig, CalibrationConfig, InputRange, format_shapes, parse_shapes
from miaohui.errors import ConfigError


def test_parse_profile_min_opt_max() -> None:
    shapes = parse_shapes("input_ids:1x1,8x64,32x128")
    assert shapes == {"input_ids": InputRange(min=(1, 1), opt=(8, 64), max=(32, 128))}
    assert format_shapes(shapes) == "input_ids:1x1,8x64,32x128"


def test_parse_several_inputs() -> None:
    shapes = parse_shapes("input_ids:1x1,8x64,32x128; attention_mask:1x1,8x64,32x128")
    assert set(shapes) == {"input_ids", "attention_mask"}


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("input_ids:1x1,8x64", "cannot read shape profile 'input_ids:1x1,8x64'"),
        ("input_ids:1xA,8x64,32x128", "cannot read shape '1xA'"),
        ("input_ids:1x1,8x64,4x128", "shape profile is not ordered: min=1x1 opt=8x64 max=4x128"),
        ("input_ids:1x1,8x64x2,32x128", "shape profile ranks differ"),
        ("input_ids:0x1,8x64,32x128", "has a dimension 0 < 1"),
        ("", "empty shape profile"),
    ],
)
def test_bad_profiles_name_the_value(spec: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_shapes(spec)
    assert fragment in str(err.value)


def test_contains() -> None:
    r = InputRange(min=(1, 1), opt=(8, 64), max=(32, 128))
    assert r.contains((32, 128)) and r.contains((1, 1))
    assert not r.contains((33, 1)) and not r.contains((1, 129)) and not r.contains((4,))


def test_cross_field_errors() -> None:
    with pytest.raises(ConfigError, match="precision fp16 with backend onnxruntime"):
        BuildConfig(backend="onnxruntime", precision="fp16")
    with pytest.raises(ConfigError, match="--target sm86 with backend onnxruntime"):
        BuildConfig(backend="onnxruntime", target="sm86")
    with pytest.raises(ConfigError, match="unknown target 'x9'"):
        BuildConfig(backend="tensorrt-rtx", target="x9")
    assert BuildConfig(backend="tensorrt-rtx", target="8.6").target == "sm86"
    with pytest.raises(ConfigError, match="inductor_format exported-program with backend onnxruntime"):
        BuildConfig(backend="onnxruntime", inductor_format="exported-program")


def test_hash_covers_only_graph_changing_fields() -> None:
    base = BuildConfig(backend="onnxruntime", precision="fp32")
    # calibration does not change an fp32 graph
    assert (
        base.compute_hash()
        == base.model_copy(update={"calibration": CalibrationConfig(method="minmax")}).compute_hash()
    )
    int8 = BuildConfig(backend="onnxruntime", precision="int8")
    assert (
        int8.compute_hash()
        != int8.model_copy(update={"calibration": CalibrationConfig(method="minmax")}).compute_hash()
    )
    assert base.compute_hash() != int8.compute_hash()
    # dynamic int8: calibration ranges do not count, the fp32 fallback (ranked on calibration text) does
    dyn = CalibrationConfig(mode="dynamic")
    d0 = int8.model_copy(update={"calibration": dyn})
    assert (
        d0.compute_hash()
        == int8.model_copy(update={"calibration": dyn.model_copy(update={"method": "minmax"})}).compute_hash()
    )
    d1 = int8.model_copy(update={"calibration": dyn.model_copy(update={"fp32_fallback": 1})})
    assert d1.compute_hash() != d0.compute_hash()
    more_text = dyn.model_copy(update={"fp32_fallback": 1, "num_samples": 512})
    assert int8.model_copy(update={"calibration": more_text}).compute_hash() != d1.compute_hash()
    # SmoothQuant scales (measured on calibration text): how many MatMuls and alpha count
    s2 = int8.model_copy(update={"calibration": dyn.model_copy(update={"smooth": 2})})
    assert len({d0.compute_hash(), d1.compute_hash(), s2.compute_hash()}) == 3
    alpha = dyn.model_copy(update={"smooth": 2, "smooth_alpha": 0.75})
    assert int8.model_copy(update={"calibration": alpha}).compute_hash() != s2.compute_hash()
    # alpha alone (nothing smoothed) changes nothing
    assert int8.model_copy(update={"calibration": dyn.model_copy(update={"smooth_alpha": 0.75})}).compute_hash() == (
        d0.compute_hash()
    )
    shaped = base.model_copy(update={"shapes": parse_shapes("input_ids:1x1,8x64,32x128")})
    assert shaped.compute_hash() != base.compute_hash()


def test_fp32_fallback_and_smooth_need_dynamic_int8() -> None:
    with pytest.raises(ConfigError, match="--smooth 2 with --int8-mode static") as err:
        CalibrationConfig(smooth=2)
    assert "add --int8-mode dynamic" in err.value.fix
    with pytest.raises(ConfigError, match="--fp32-fallback 1 with --int8-mode static"):
        CalibrationConfig(fp32_fallback=1)
    assert CalibrationConfig(mode="dynamic", smooth=2, fp32_fallback=1).smooth == 2


def test_static_shapes_parse_sort_and_validate() -> None:
    cfg = BuildConfig(backend="inductor", static_shapes="1x128, 1x16,1x128")  # type: ignore[arg-type]
    assert cfg.static_shapes == ((1, 16), (1, 128))
    assert BuildConfig(backend="inductor", static_shapes=[(8, 64)]).static_shapes == ((8, 64),)
    for bad in ("1x", "0x16", "ax16", "1x16x2"):
        with pytest.raises(ConfigError, match=f"static shape '{bad}'"):
            BuildConfig(backend="inductor", static_shapes=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--backend inductor"):
        BuildConfig(backend="onnxruntime", static_shapes="1x16")  # type: ignore[arg-type]
    # an empty list leaves the build key of an inductor artifact as it was before the option existed
    plain = BuildConfig(backend="inductor", precision="fp16")
    assert "static_shapes" in plain.model_dump()
    assert plain.compute_hash() == BuildConfig(backend="inductor", precision="fp16", static_shapes="").compute_hash()  # type: ignore[arg-type]
    assert (
        plain.compute_hash() != BuildConfig(backend="inductor", precision="fp16", static_shapes="1x16").compute_hash()
    )  # type: ignore[arg-type]


def test_gpu_kernels_is_one_choice_tuned_or_library() -> None:
    """The build's GPU kernels are one choice; the former A/B switches are not fields any more."""
    plain = BuildConfig(backend="inductor", precision="fp16")
    assert plain.gpu_kernels == "tuned"
    assert plain.compute_hash() != plain.model_copy(update={"gpu_kernels": "library"}).compute_hash()
    for gone in ("pdl", "ln_fusion", "cublaslt"):
        with pytest.raises(ValueError, match=gone):
            BuildConfig.model_validate({"backend": "inductor", gone: "off"})
    with pytest.raises(ValueError, match="'tuned' or 'library'"):
        BuildConfig.model_validate({"backend": "inductor", "gpu_kernels": "triton"})


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("inductor_format", "exported-program", "inductor_format exported-program"),
        ("gpu_kernels", "library", "gpu_kernels library"),
        ("static_shapes", "1x16", "static_shapes"),
    ],
)
def test_every_inductor_only_field_is_refused_for_other_backends(field: str, value: str, shown: str) -> None:
    with pytest.raises(ConfigError, match=f"{shown} with backend tensorrt-rtx") as err:
        BuildConfig.model_validate({"backend": "tensorrt-rtx", "precision": "fp16", field: value})
    assert "drop --" + field.replace("_", "-") in str(err.value) and "use --backend inductor" in str(err.value)
