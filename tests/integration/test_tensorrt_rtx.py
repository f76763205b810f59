"""Real TensorRT-RTX builds on CPU (ahead of time, no GPU needed) of a tiny BERT intent-style model.

Each build of the 2-layer model takes well under a second here, so nothing is marked slow; the
build seconds are printed (``pytest -s``) and kept in the returned facts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

pytest.importorskip("tensorrt_rtx")

from miaohui.config import BuildConfig, InputRange
from miaohui.engines import tensorrt as trt_engine
from miaohui.engines import tensorrt_builder as trt_builder
from miaohui.engines import tensorrt_runtime as trt_runtime
from miaohui.engines.base import BuildInfo, FileInfo, Manifest, Target, TensorSpec
from miaohui.engines.tensorrt import Flavor
from miaohui.errors import (
    ArtifactError,
    BackendUnavailableError,
    BuildError,
    ConfigError,
    UnsupportedOperatorError,
)

FLAVOR: Flavor = "tensorrt-rtx"
RANGE = InputRange(min=(1, 1), opt=(8, 16), max=(32, 64))
SHAPES = {"input_ids": RANGE, "attention_mask": RANGE}
VOCAB, LABELS = 100, 5


class TinyIntent(torch.nn.Module):
    """2-layer BERT encoder + linear head on [CLS] → logits."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        cfg = BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
        )
        self.bert = BertModel(cfg)
        self.head = torch.nn.Linear(32, LABELS)

    def forward(self, input_ids: Any, attention_mask: Any) -> Any:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden[:, 0])


def _export(path: Path, dynamo: bool) -> Path:
    torch.manual_seed(0)
    model = TinyIntent().eval()
    ids = torch.randint(0, VOCAB, (2, 8))
    dynamic = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "sequence"},
        "logits": {0: "batch"},
    }
    torch.onnx.export(
        model,
        (ids, torch.ones_like(ids)),
        str(path),
        input_names=["input_ids", "attention_mask"],
        output_names=["logits"],
        opset_version=17,
        dynamic_axes=dynamic,
        dynamo=dynamo,
    )
    return path


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TorchScript exporter: one self-contained .onnx file."""
    return _export(tmp_path_factory.mktemp("onnx") / "tiny.onnx", dynamo=False)


@pytest.fixture(scope="module")
def tiny_onnx_external(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torch.export-based exporter: weights in an external ``.onnx.data`` file."""
    path = _export(tmp_path_factory.mktemp("onnx_ext") / "tiny.onnx", dynamo=True)
    assert path.with_name("tiny.onnx.data").exists(), "expected external data from the dynamo exporter"
    return path


@pytest.fixture(scope="module")
def custom_op_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Relu → com.acme:MagicNorm (no TensorRT importer or plugin) → Sigmoid."""
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu0"),
        helper.make_node("MagicNorm", ["a"], ["c"], name="magic", domain="com.acme"),
        helper.make_node("Sigmoid", ["c"], ["y"], name="sig"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.acme", 1)])
    path = tmp_path_factory.mktemp("custom") / "custom.onnx"
    onnx.save(model, str(path))
    return path


def _build(onnx_path: Path, out: Path, **cfg: Any) -> tuple[dict[str, Any], float]:
    config = BuildConfig(backend=FLAVOR, **{"target": "sm86", "shapes": SHAPES, **cfg})
    start = time.perf_counter()
    facts = trt_builder.build_engine(onnx_path, out, config, FLAVOR, progress=False)
    seconds = time.perf_counter() - start
    print(
        f"\n[build] {onnx_path.name} {config.precision} {config.target}: {seconds:.2f} s wall, "
        f"{facts['build_seconds']:.2f} s builder, {facts['engine_bytes']} bytes"
    )
    return facts, seconds


def _no_leftovers(directory: Path) -> None:
    assert not [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


# ----------------------------------------------------------------------------------- builds


def test_build_sm86_fp32(tiny_onnx: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.engine"
    facts, seconds = _build(tiny_onnx, out)
    assert out.is_file() and out.stat().st_size == facts["engine_bytes"] > 100_000
    _no_leftovers(tmp_path)
    assert facts["backend"] == FLAVOR
    assert facts["backend_version"] == trt_engine.backend_version(FLAVOR)
    assert facts["target"] == {"device": "cuda", "compute_capability": "sm86", "gpu_name": None}
    assert facts["precision"] == "fp32" and facts["strongly_typed"] is True
    assert facts["unsupported_nodes"] == []
    assert facts["network_layers"] > 10
    assert 0 < facts["build_seconds"] <= seconds < 120
    assert facts["profile"]["input_ids"] == {"min": [1, 1], "opt": [8, 16], "max": [32, 64]}
    assert [(t["name"], t["dtype"], t["dims"]) for t in facts["inputs"]] == [
        ("input_ids", "int64", ["batch", "sequence"]),
        ("attention_mask", "int64", ["batch", "sequence"]),
    ]
    assert [(t["name"], t["dtype"], t["dims"][-1]) for t in facts["outputs"]] == [("logits", "float32", LABELS)]
    # the facts fit the manifest models
    Target(**facts["target"])
    TensorSpec(**facts["inputs"][0], profile=RANGE)


def test_build_external_data_and_inherited_profile(tiny_onnx_external: Path, tmp_path: Path) -> None:
    """parse_from_file resolves external weights; attention_mask inherits input_ids' named axes."""
    facts, _ = _build(tiny_onnx_external, tmp_path / "ext.engine", shapes={"input_ids": RANGE})
    assert facts["profile"]["attention_mask"] == facts["profile"]["input_ids"]
    assert trt_builder.unsupported_nodes(tiny_onnx_external, FLAVOR) == []
    assert (tmp_path / "ext.engine").stat().st_size > 100_000


def test_build_fp16_casts_graph(tiny_onnx: Path, tmp_path: Path) -> None:
    before = tiny_onnx.read_bytes()
    facts, _ = _build(tiny_onnx, tmp_path / "fp16.engine", precision="fp16")
    assert facts["precision"] == "fp16" and "cast to fp16" in facts["precision_from"]
    assert tiny_onnx.read_bytes() == before, "the source ONNX must not be modified"
    assert trt_runtime.inspect_engine(tmp_path / "fp16.engine", FLAVOR)["compute_capabilities"] == ["sm86"]


def test_build_sm89_and_sm120(tiny_onnx: Path, tmp_path: Path) -> None:
    for target in ("sm89", "sm120"):
        _build(tiny_onnx, tmp_path / f"{target}.engine", target=target)
        info = trt_runtime.inspect_engine(tmp_path / f"{target}.engine", FLAVOR)
        assert info["compute_capabilities"] == [target]


def test_int8_without_qdq_is_refused(tiny_onnx: Path, tmp_path: Path) -> None:
    out = tmp_path / "int8.engine"
    with pytest.raises(BuildError, match="no QuantizeLinear") as err:
        _build(tiny_onnx, out, precision="int8")
    assert "calibration" in (err.value.fix or "")
    assert not out.exists()


def test_int8_with_qdq_builds(tiny_onnx: Path, tmp_path: Path) -> None:
    """Explicit QDQ (ONNX Runtime static quantization; TensorRT needs unquantized biases)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            self.batches = iter(
                [
                    {"input_ids": rng.integers(0, VOCAB, (2, 8)), "attention_mask": np.ones((2, 8), np.int64)}
                    for _ in range(4)
                ]
            )

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    qdq = tmp_path / "tiny.qdq.onnx"
    quantize_static(
        str(tiny_onnx),
        str(qdq),
        Reader(),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        per_channel=True,
        op_types_to_quantize=["MatMul", "Gemm"],
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False},
    )
    facts, _ = _build(qdq, tmp_path / "int8.engine", precision="int8")
    assert facts["precision"] == "int8" and "QDQ" in facts["precision_from"]


def test_failed_build_leaves_nothing(tiny_onnx: Path, tmp_path: Path) -> None:
    """sm75 (Turing) has no fp32 GEMM in TensorRT-RTX 1.7: the library's reason is quoted, no file written."""
    out = tmp_path / "turing.engine"
    try:
        _build(tiny_onnx, out, target="sm75")
    except BuildError as exc:
        assert "sm75" in str(exc)
        assert not out.exists()
        _no_leftovers(tmp_path)
    else:
        pytest.skip("this TensorRT-RTX version builds fp32 GEMMs for Turing")


# ----------------------------------------------------------------------------------- profiles


def test_profile_missing_for_dynamic_input(tiny_onnx: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="input 'input_ids' has dynamic dimensions"):
        _build(tiny_onnx, tmp_path / "x.engine", shapes={})
    # a fixed-rank partial profile cannot cover the sequence axis of the other input either
    partial = {"input_ids": InputRange(min=(1, 1), opt=(1, 1), max=(1, 1))}
    facts, _ = _build(tiny_onnx, tmp_path / "y.engine", shapes=partial)
    assert facts["profile"]["attention_mask"]["max"] == [1, 1]


def test_profile_min_greater_than_max(tiny_onnx: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not ordered"):
        InputRange(min=(4, 64), opt=(8, 16), max=(1, 1))
    # also refused by the builder when the range bypassed validation
    bad = InputRange.model_construct(min=(4, 64), opt=(8, 16), max=(1, 1))
    with pytest.raises(ConfigError, match="not ordered"):
        _build(tiny_onnx, tmp_path / "x.engine", shapes={"input_ids": bad, "attention_mask": RANGE})


def test_profile_unknown_input_and_rank(tiny_onnx: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="token_type_ids"):
        _build(tiny_onnx, tmp_path / "x.engine", shapes={**SHAPES, "token_type_ids": RANGE})
    rank3 = InputRange(min=(1, 1, 1), opt=(1, 1, 1), max=(1, 1, 1))
    with pytest.raises(ConfigError, match="rank 3"):
        _build(tiny_onnx, tmp_path / "x.engine", shapes={"input_ids": rank3})


# ----------------------------------------------------------------------------------- ops / targets


def test_unsupported_custom_op_is_named(custom_op_onnx: Path, tiny_onnx: Path, tmp_path: Path) -> None:
    assert trt_builder.unsupported_nodes(custom_op_onnx, FLAVOR) == [("magic", "com.acme:MagicNorm")]
    assert trt_builder.unsupported_nodes(tiny_onnx, FLAVOR) == []
    with pytest.raises(UnsupportedOperatorError, match=r"magic \(com.acme:MagicNorm\)"):
        trt_builder.build_engine(
            custom_op_onnx,
            tmp_path / "c.engine",
            BuildConfig(backend=FLAVOR, target="sm86"),
            FLAVOR,
            progress=False,
        )
    assert not (tmp_path / "c.engine").exists()


def test_target_sm90_is_refused(tiny_onnx: Path, tmp_path: Path) -> None:
    """TensorRT-RTX has no ComputeCapability for 9.0 (Hopper data-center GPUs): a clear ConfigError."""
    assert "sm90" not in trt_engine.rtx_targets(trt_engine.trt_module(FLAVOR))
    with pytest.raises(ConfigError, match="cannot build for sm90") as err:
        _build(tiny_onnx, tmp_path / "x.engine", target="sm90")
    assert "sm86" in str(err.value) and "--backend tensorrt" in (err.value.fix or "")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_no_target_without_gpu(tiny_onnx: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no --target"):
        _build(tiny_onnx, tmp_path / "x.engine", target=None)


# ----------------------------------------------------------------------------------- artifacts / runtime


def test_inspect_and_truncation(tiny_onnx: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.engine"
    facts, _ = _build(tiny_onnx, out)
    info = trt_runtime.inspect_engine(out, FLAVOR)
    assert info["bytes"] == facts["engine_bytes"]
    assert info["format"] == "TensorRT-RTX plan" and info["compute_capabilities"] == ["sm86"]
    assert info["built_with"] == facts["backend_version"] and info["matches_runtime_version"]
    if not torch.cuda.is_available():
        assert info["deserialized"] is False and "GPU" in info["note"]
    cut = tmp_path / "cut.engine"
    cut.write_bytes(out.read_bytes()[: facts["engine_bytes"] // 2])
    with pytest.raises(ArtifactError, match="truncated"):
        trt_runtime.inspect_engine(cut, FLAVOR)
    with pytest.raises(ArtifactError, match="does not exist"):
        trt_runtime.inspect_engine(tmp_path / "missing.engine", FLAVOR)


def _manifest(facts: dict[str, Any], engine_file: str) -> Manifest:
    specs = [TensorSpec(**t, profile=RANGE) for t in facts["inputs"]]
    return Manifest(
        name="tiny",
        version=1,
        task="intent",
        backend=FLAVOR,
        backend_version=facts["backend_version"],
        precision=facts["precision"],
        engine_file=engine_file,
        inputs=specs,
        outputs=[TensorSpec(**t) for t in facts["outputs"]],
        source_digest="0" * 64,
        options_digest="0" * 64,
        build_key="0" * 64,
        build_config=BuildConfig(backend=FLAVOR, target="sm86", shapes=SHAPES),
        target=Target(**facts["target"]),
        build=BuildInfo(
            created_at="2026-01-01T00:00:00Z", seconds=facts["build_seconds"], host="ci", miaohui_version="0"
        ),
        files={engine_file: FileInfo(size=facts["engine_bytes"], sha256="0" * 64)},
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_runtime_without_gpu_is_a_clear_error(tiny_onnx: Path, tmp_path: Path) -> None:
    facts, _ = _build(tiny_onnx, tmp_path / "model.engine")
    with pytest.raises(BackendUnavailableError, match="no CUDA GPU found") as err:
        trt_runtime.TensorRTEngine(_manifest(facts, "model.engine"), tmp_path)
    assert "8.6" in str(err.value) and "sm86" in str(err.value)


def test_compatibility_check_messages() -> None:
    """The pre-deserialization check (pure, so it runs here; on a GPU it runs before deserializing)."""
    runnable = list(trt_engine.rtx_targets(trt_engine.trt_module(FLAVOR)))
    check = trt_runtime._check_compatibility
    check(FLAVOR, "sm86", "1.7.1.116", "sm86", "NVIDIA A10", "1.7.1.116", runnable)  # same: no error
    with pytest.raises(ArtifactError, match=r"built for sm86 with TensorRT-RTX 1\.7\.1\.116; this GPU is sm89") as e:
        check(FLAVOR, "sm86", "1.7.1.116", "sm89", "NVIDIA L4", "1.7.1.116", runnable)
    assert "--target sm89" in (e.value.fix or "")
    with pytest.raises(ArtifactError, match=r"TensorRT-RTX 1\.6\.0"):
        check(FLAVOR, "sm86", "1.6.0.1", "sm86", "NVIDIA A10", "1.7.1.116", runnable)
    with pytest.raises(BackendUnavailableError, match=r"sm90 .*cannot run on"):
        check(FLAVOR, "sm86", "1.7.1.116", "sm90", "NVIDIA H200", "1.7.1.116", runnable)
    with pytest.raises(ArtifactError, match="this GPU is sm90"):  # full TensorRT: any GPU, but not another's plan
        check("tensorrt", "sm86", "10.9.0", "sm90", "NVIDIA H200", "10.9.0", None)


def test_backend_modules() -> None:
    assert trt_engine.backend_version(FLAVOR).startswith("1.")
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailableError, match="pip install tensorrt"):
            trt_engine.trt_module("tensorrt")
    with pytest.raises(ConfigError):
        trt_engine.trt_module("tensorrt-llm")  # type: ignore[arg-type]
