"""``llamacpp`` causal-LM versions: the GGUF itself, served by llama.cpp
(:mod:`miaohui.generation.engine.llamacpp_engine`).

Layout of a version::

    <repository>/<name>/<version>/
      causal_lm.json     # backend "llamacpp", precision = the GGUF's quantization type (e.g. "q4_1")
      llamacpp.json      # LlamaCppMeta: the GGUF's sha256, file type, eos ids, vocabulary, trained context
      model.gguf         # the source GGUF, hard-linked (or copied) unchanged: llama.cpp's kernels run it as it is;
                         # with --precision q8_0|f16: written from the fp32 HF model
                         # (miaohui.generation.build.gguf_writer)
      tokenizer.json     # from the GGUF's fp32 HF conversion: miaohui templates and tokenizes, llama.cpp takes ids

No ONNX export: the build only checks the file, converts it once to fp32 HF (the gate's reference, the tokenizer and
the chat template, exactly as for the other backends) and copies it — or, with ``--precision q8_0|f16``, writes a
GGUF of that precision from the fp32 HF model (a Hugging Face directory, or a GGUF's conversion). Building needs no
``xllamacpp``; serving does.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from miaohui.errors import ArtifactError, ConfigError

if TYPE_CHECKING:
    from miaohui.generation.build.sources import DecoderSource

META_NAME = "llamacpp.json"
GGUF_NAME = "model.gguf"
GGUF_PRECISION = "gguf"
"""``--precision`` of the llamacpp backend: the GGUF's own quantization (llama.cpp runs the file unchanged);
``q8_0`` / ``f16`` write a GGUF of that type from the fp32 HF model instead."""
BUILD_FORMAT = 1
"""Bumped when the layout of a llamacpp version changes (part of the build key)."""


class LlamaCppMeta(BaseModel):
    """``llamacpp.json``: what the server needs to run the GGUF of a version without loading the HF model."""

    model_config = ConfigDict(extra="forbid")

    gguf_file: str = GGUF_NAME
    sha256: str
    file_type: str
    """The GGUF's ``general.file_type`` in llama.cpp's words, lower case (``q4_1``, ``q8_0``, ``f16``, ...)."""
    architecture: str
    """``general.architecture`` (``llama``, ``qwen2``, ``gemma3``)."""
    eos_token_ids: list[int]
    """The tokens that end a sequence (``generation_config.json``'s ``eos_token_id`` plus the tokenizer's EOS)."""
    vocab: int
    """Token ids a prompt may hold: [0, vocab)."""
    max_positions: int
    """The trained context length: ``max_model_len`` is capped at it."""


def gguf_file_type(path: Path) -> str:
    """The quantization type of a GGUF (``general.file_type``; ``q4_1`` for ``MOSTLY_Q4_1``). ArtifactError when
    the file cannot be read; files without the field report the type most of their weight tensors have."""
    from gguf import GGUFReader, LlamaFileType

    try:
        reader = GGUFReader(str(path))
        field = reader.fields.get("general.file_type")
        if field is not None:
            name = LlamaFileType(int(field.parts[field.data[0]][0])).name
            return name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()
        kinds = [t.tensor_type.name for t in reader.tensors if len(t.shape) > 1]
    except (OSError, ValueError, KeyError, IndexError, EOFError) as exc:
        raise ArtifactError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})",
            "check the file (a complete .gguf, e.g. from llama.cpp's convert_hf_to_gguf.py)",
        ) from exc
    return max(set(kinds), key=kinds.count).lower() if kinds else "unknown"


def llamacpp_build_key(src: DecoderSource, precision: str = GGUF_PRECISION) -> str:
    """sha256 over the source's digest and the layout version (a GGUF served unchanged: nothing else counts), plus
    the precision and the writer's version for a written GGUF."""
    from miaohui.generation.build.gguf_writer import GGUF_PRECISIONS, WRITER_VERSION

    facts: dict[str, object] = {"source": src.digest, "backend": "llamacpp", "format": BUILD_FORMAT}
    if precision in GGUF_PRECISIONS:
        facts |= {"precision": precision, "writer": WRITER_VERSION}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def check_llamacpp_source(src: DecoderSource, precision: str) -> None:
    """ConfigError when the llamacpp backend cannot build ``src`` at ``precision``: ``q8_0`` / ``f16`` need a model
    the GGUF writer takes; otherwise a GGUF file served as it is (``precision`` is ``gguf`` or the file's type)."""
    from miaohui.generation.build.gguf_writer import GGUF_PRECISIONS, check_writable

    if precision in GGUF_PRECISIONS:
        check_writable(src.folder, src.architecture, src.label)
        return
    gguf = Path(src.path)
    if src.format != "gguf" or not gguf.is_file():
        raise ConfigError(
            f"the llamacpp backend serves GGUF files; {src.label} is a Hugging Face directory",
            "pass --precision q8_0 or f16 (miaohui writes the GGUF), convert it with llama.cpp's "
            "convert_hf_to_gguf.py, or use --backend onnxruntime",
        )
    if precision not in (GGUF_PRECISION, gguf_file_type(gguf)):
        raise ConfigError(
            f"--precision {precision!r}: the llamacpp backend runs the GGUF as it is ({gguf_file_type(gguf)}) or "
            f"writes {list(GGUF_PRECISIONS)}",
            "leave --precision out (or pass gguf, q8_0 or f16); quantize another way with llama.cpp's llama-quantize",
        )


def write_llamacpp_files(
    out: Path, src: DecoderSource, model: Any, tokenizer: Any, precision: str = GGUF_PRECISION
) -> str:
    """Put the GGUF (the source's, hard link or copy; or written at ``precision`` q8_0 / f16), ``tokenizer.json`` and
    ``llamacpp.json`` into ``out``; the GGUF's type."""
    from miaohui.generation.build.export import eos_ids
    from miaohui.generation.build.gguf_writer import GGUF_PRECISIONS, write_gguf
    from miaohui.generation.build.sources import gguf_architecture
    from miaohui.zoo.gguf import file_digest

    tokenizer_json = src.folder / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ArtifactError(f"{src.label} has no tokenizer.json ({src.folder})", "rebuild with --force")
    gguf = out / GGUF_NAME
    if precision in GGUF_PRECISIONS:
        write_gguf(gguf, src.folder, src.architecture, model, tokenizer, precision)
        sha256 = str(file_digest(gguf)["sha256"])
    else:
        try:
            os.link(src.path, gguf)
        except OSError:  # another file system, or links not allowed
            shutil.copyfile(src.path, gguf)
        sha256 = src.digest.rpartition("@sha256:")[2]
    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    file_type = gguf_file_type(gguf)
    meta = LlamaCppMeta(
        sha256=sha256,
        file_type=file_type,
        architecture=gguf_architecture(gguf),
        eos_token_ids=eos_ids(model, tokenizer),
        vocab=int(model.config.vocab_size),
        max_positions=int(getattr(model.config, "max_position_embeddings", 2048)),
    )
    (out / META_NAME).write_text(meta.model_dump_json(indent=2), encoding="utf-8")
    return file_type


def read_llamacpp_meta(folder: Path) -> LlamaCppMeta:
    path = folder / META_NAME
    try:
        return LlamaCppMeta.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ArtifactError(
            f"cannot read {path}: {exc}", "rebuild it with `miaohui build-llm --backend llamacpp`"
        ) from exc
