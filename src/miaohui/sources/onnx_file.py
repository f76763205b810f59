"""A plain ONNX file, the way ``trtexec --onnx`` takes one: inputs, outputs, dtypes and dynamic axes come from the
graph. With ``--tokenizer`` and ``--labels`` it is a text classifier (task ``intent``: inputs ``input_ids`` and
``attention_mask``, int64 ``[batch, sequence]``; its first output is the logits)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from miaohui.config import InputRange
from miaohui.errors import ArtifactError, ConfigError
from miaohui.models.checkpoint import ModelMeta
from miaohui.sources.detect import Source

TEXT_INPUTS = ("input_ids", "attention_mask")
DEFAULT_MAX_LENGTH = 512
"""Longest sequence of a text ONNX model whose graph has a symbolic sequence axis (no other limit is known)."""


@dataclass(frozen=True)
class GraphTensor:
    name: str
    dtype: str
    """numpy dtype name."""
    dims: tuple[str | int, ...]
    """Fixed sizes, or the symbolic name (``?`` where the graph leaves it unnamed)."""


@dataclass(frozen=True)
class OnnxGraph:
    inputs: tuple[GraphTensor, ...]
    outputs: tuple[GraphTensor, ...]


def read_graph(path: Path) -> OnnxGraph:
    import onnx
    from onnx import helper

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ArtifactError(f"{path} is not a readable ONNX file: {exc}", "export the model again") from None
    initializers = {i.name for i in model.graph.initializer}

    def tensor(value: onnx.ValueInfoProto) -> GraphTensor:
        ttype = value.type.tensor_type
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(ttype.elem_type)).name
        except (KeyError, TypeError):
            dtype = f"onnx:{ttype.elem_type}"
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in ttype.shape.dim)
        return GraphTensor(name=value.name, dtype=dtype, dims=dims)

    inputs = tuple(tensor(v) for v in model.graph.input if v.name not in initializers)
    return OnnxGraph(inputs=inputs, outputs=tuple(tensor(v) for v in model.graph.output))


def read_labels(spec: str | None) -> list[str]:
    """``a,b,c`` or a file with one label a line."""
    if not spec:
        return []
    file = Path(spec)
    if file.is_file():
        labels = [line.strip() for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        labels = [x.strip() for x in spec.split(",") if x.strip()]
    if len(labels) < 2 or len(set(labels)) != len(labels):
        raise ConfigError(f"--labels {spec!r} gives {labels}", "give at least two distinct labels: a,b,c or a file")
    return labels


def open_onnx(path: Path, tokenizer: Path | None, labels: list[str] | None) -> Source:
    graph = read_graph(path)
    if tokenizer is None and not labels:  # served as its own tensors (task tensor)
        return Source(path=path, format="onnx", meta=None, digest=_digest([path]), onnx=graph)
    if tokenizer is None or not labels:
        missing = "--tokenizer" if tokenizer is None else "--labels"
        raise ConfigError(f"{path} has {missing} missing", "a text model needs both --tokenizer and --labels")
    check_text_graph(path, graph, len(labels))
    tok_file = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
    if not tok_file.is_file():
        raise ArtifactError(f"{tok_file} does not exist", "pass the tokenizer.json file or the directory holding it")
    try:
        Tokenizer.from_file(str(tok_file))
    except Exception as exc:
        raise ArtifactError(f"cannot read tokenizer {tok_file}: {exc}", "pass a Hugging Face tokenizer.json") from None
    seq = graph.inputs[0].dims[1]
    meta = ModelMeta(
        kind="intent",
        base=f"onnx:{path.name}",
        bert_config={},
        labels=labels,
        max_length=seq if isinstance(seq, int) else DEFAULT_MAX_LENGTH,
        source_format="onnx",
        architecture=None,
    )
    digest = _digest([path, tok_file], "\n".join(labels))
    return Source(path=path, format="onnx", meta=meta, digest=digest, onnx=graph, tokenizer_file=tok_file)


def _digest(files: list[Path], extra: str = "") -> str:
    h = hashlib.sha256()
    for file in files:
        with open(file, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    h.update(extra.encode())
    return h.hexdigest()


def check_text_graph(path: Path, graph: OnnxGraph, num_labels: int) -> None:
    names = [t.name for t in graph.inputs]
    if sorted(names) != sorted(TEXT_INPUTS):
        raise ArtifactError(
            f"{path} has inputs {names}; a text model needs exactly {list(TEXT_INPUTS)}",
            "export the model with input_names=['input_ids', 'attention_mask'] (token_type_ids folded in), "
            "or drop --tokenizer/--labels",
        )
    for t in graph.inputs:
        if t.dtype != "int64" or len(t.dims) != 2:
            shape = "x".join(map(str, t.dims))
            raise ArtifactError(
                f"{path}: input {t.name!r} is {t.dtype} [{shape}]; token inputs must be int64 [batch, sequence]",
                "export the token inputs as int64 tensors of rank 2",
            )
    out = graph.outputs[0]
    if len(out.dims) != 2 or (isinstance(out.dims[1], int) and out.dims[1] != num_labels):
        raise ArtifactError(
            f"{path}: output {out.name!r} has dims {list(out.dims)}; logits of {num_labels} labels are "
            f"[batch, {num_labels}]",
            "give one label per logit column with --labels, in column order",
        )


def graph_shapes(path: Path, graph: OnnxGraph, given: dict[str, InputRange], max_length: int) -> dict[str, InputRange]:
    """The profile of each input: ``--shapes`` where given (one of ``input_ids``/``attention_mask`` gives both),
    the graph's fixed sizes, and for the text inputs' symbolic axes batch 1..64 and sequence 1..max_length. Any
    other symbolic dimension needs ``--shapes``."""
    shapes: dict[str, InputRange] = {}
    given = dict(given)
    names = {t.name for t in graph.inputs}
    for a, b in (TEXT_INPUTS, TEXT_INPUTS[::-1]):  # the token inputs share their batch and sequence axes
        if a in given and b in names and b not in given:
            given[b] = given[a]
    unknown = sorted(set(given) - names)
    if unknown:
        raise ConfigError(
            f"--shapes names {unknown}, which {path.name} does not have",
            f"its inputs are {[t.name for t in graph.inputs]}",
        )
    for t in graph.inputs:
        fixed = tuple(d if isinstance(d, int) else None for d in t.dims)
        if t.name in given:
            rng = given[t.name]
            bad = [i for i, d in enumerate(fixed) if d is not None and not rng.min[i] == rng.max[i] == d]
            if len(rng.min) != len(fixed) or bad:
                raise ConfigError(
                    f"--shapes {t.name}:{rng} does not fit the graph's dims {list(t.dims)}",
                    "give one size per dimension; fixed dimensions must keep their size",
                )
            shapes[t.name] = rng
            continue
        defaults = (64, max_length) if t.name in TEXT_INPUTS else ()
        dims: list[tuple[int, int, int]] = []
        for i, d in enumerate(fixed):
            if d is not None:
                dims.append((d, d, d))
            elif i < len(defaults):
                dims.append((1, min(8 if i == 0 else 32, defaults[i]), defaults[i]))
            else:
                raise ConfigError(
                    f"{path.name}: input {t.name!r} has symbolic dimension {i} ({t.dims[i]!r}) and no profile",
                    f"give its range with --shapes '{t.name}:MIN,OPT,MAX', e.g. {t.name}:"
                    + ",".join("x".join(str(d if isinstance(d, int) else n) for d in t.dims) for n in (1, 8, 32)),
                )
        shapes[t.name] = InputRange(
            min=tuple(d[0] for d in dims), opt=tuple(d[1] for d in dims), max=tuple(d[2] for d in dims)
        )
    return shapes


def check_runs(path: Path, graph: OnnxGraph, shapes: dict[str, InputRange]) -> dict[str, list[int]]:
    """Run the file itself on ONNX Runtime at the profile's min and max shapes: it loads, it runs, its outputs
    are finite. Returns the output shapes at the max profile."""
    import onnxruntime as ort

    try:
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ArtifactError(f"ONNX Runtime cannot load {path}: {exc}", "check the file with onnx.checker") from None
    rng = np.random.default_rng(0)
    got: dict[str, list[int]] = {}
    for which in ("min", "max"):
        feeds = {}
        for t in graph.inputs:
            shape = getattr(shapes[t.name], which)
            if t.name == "attention_mask":
                feeds[t.name] = np.ones(shape, dtype=np.int64)
            elif np.dtype(t.dtype).kind in "iu":
                feeds[t.name] = rng.integers(0, 100, size=shape).astype(t.dtype)
            else:
                feeds[t.name] = rng.standard_normal(shape).astype(t.dtype)
        try:
            outs = sess.run(None, feeds)
        except Exception as exc:
            raise ArtifactError(
                f"ONNX Runtime cannot run {path} at the profile's {which} shapes: {str(exc).splitlines()[0]}",
                "check the --shapes ranges against what the graph accepts",
            ) from None
        for t, out in zip(graph.outputs, outs, strict=True):
            if np.asarray(out).dtype.kind == "f" and not np.all(np.isfinite(out)):
                raise ArtifactError(f"{path}: output {t.name!r} is not finite at the {which} shapes", "fix the model")
            got[t.name] = list(np.asarray(out).shape)
    return got
