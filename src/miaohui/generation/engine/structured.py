"""Constrained decoding: a request's tokens follow a JSON schema (``SamplingParams.json_schema``).

The grammar engine is llguidance (chosen by ``benchmarks/bench_structured_cpu.py``: the lowest per-token mask cost
of xgrammar, llguidance and outlines-core on our tokenizers, numpy-native). Per step, for every constrained row
of a batch, :class:`TokenMasks` computes the allowed-token bitmask from the row's matcher and sets every other
logit to -inf before sampling; the sampled token is then consumed by the matcher. When the document is complete the
matcher allows only the end-of-sequence token, so the sequence ends with ``stop``; ``max_tokens`` can still cut a
document short, and then the request finishes with ``length`` as any other.

An object that lists ``properties`` and says nothing of other keys (no ``additionalProperties``,
``patternProperties``, ``unevaluatedProperties`` or sibling ``allOf`` / ``anyOf`` / ``oneOf`` / ``$ref``) is closed:
only its listed keys may appear (:func:`closed_objects`), as xgrammar's default (vLLM's) does and as OpenAI's
``strict`` schemas must say explicitly. llguidance and llama.cpp's server (as shipped here) would follow JSON
Schema's open default, where SmolLM2 adds keys nobody asked for to one answer in a few; the llamacpp engine sends
the closed schema too, so both chat backends agree. An open schema says so with ``"additionalProperties": true``.

JSON whitespace is fixed (``", "`` between items, ``": "`` after keys, none elsewhere): a small model can then
not loop on blank lines inside a document. Unconstrained rows are untouched and cost nothing.

The llguidance tokenizer (~1 s for a 49k vocabulary) is made on the first constrained request of an engine.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from miaohui.errors import InputError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from miaohui.generation.engine.params import SamplingParams

JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON compile options (see the module docstring)."""
SCHEMA_FIX = "send a JSON schema object (draft 2020-12 keywords: type, properties, required, enum, ...)"


_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema that lists ``properties`` and does not say whether other
    keys may appear gets ``"additionalProperties": false`` (see the module docstring). Only schema positions are
    walked (a property *named* ``properties`` is a name, not a keyword); anything else is returned as it is."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [closed_objects(sub) for sub in value]
        elif key in _SCHEMA_ONE:
            out[key] = [closed_objects(s) for s in value] if isinstance(value, list) else closed_objects(value)
        else:
            out[key] = value
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def schema_grammar(schema: str) -> str:
    """The llguidance grammar of a JSON schema given as JSON text, its objects closed (:func:`closed_objects`);
    InputError (HTTP 400) when it is not one llguidance can compile."""
    import llguidance

    try:
        closed = json.dumps(closed_objects(json.loads(schema)))
        grammar = llguidance.LLMatcher.grammar_from_json_schema(closed, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    except ValueError as exc:
        raise InputError(f"the JSON schema is not valid JSON: {exc}", SCHEMA_FIX) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InputError(f"the JSON schema cannot be enforced: {error}", SCHEMA_FIX)
    return grammar


def check_schema(schema: str) -> None:
    """InputError unless ``schema`` compiles (the server calls it at admission, so a bad one fails alone)."""
    schema_grammar(schema)


def check_supported(params: SamplingParams, supported: bool, engine: str) -> None:
    """InputError naming the field when ``params`` ask for constrained decoding or log-probabilities of an
    ``engine`` that cannot honour them (``supported`` False)."""
    if supported:
        return
    for field, asked in (("json_schema", params.json_schema is not None), ("logprobs", params.logprobs is not None)):
        if asked:
            raise InputError(
                f"{field} is not supported by {engine}",
                "serve the model on the onnxruntime or llamacpp backend for structured output and log-probabilities",
            )


class TokenMasks:
    """Each constrained sequence's llguidance matcher; masks logits rows and consumes sampled tokens.

    Not thread-safe: one model runner (one worker thread) owns it.
    """

    def __init__(self, tokenizer: Tokenizer, vocab: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab = vocab
        self._eos = [int(t) for t in eos_token_ids]
        self._ll: Any = None
        self._lock = threading.Lock()
        self._matchers: dict[int, Any] = {}
        self._grammars: dict[str, str] = {}

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                import llguidance

                self._ll = llguidance.LLTokenizer(
                    self._tokenizer.to_str(), n_vocab=self._vocab, eos_token=self._eos[0] if self._eos else None
                )
            return self._ll

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def start(self, seq_id: int, schema: str) -> None:
        """A matcher for a newly prefilled sequence."""
        import llguidance

        grammar = self._grammars.get(schema)
        if grammar is None:
            grammar = self._grammars[schema] = schema_grammar(schema)
            if len(self._grammars) > 256:  # a small cache of compiled schemas, oldest out
                self._grammars.pop(next(iter(self._grammars)))
        self._matchers[seq_id] = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)

    def drop(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def reset(self) -> None:
        self._matchers.clear()

    def mask(self, logits: np.ndarray, seq_ids: Sequence[int]) -> np.ndarray:
        """``logits`` [rows, vocab] with the disallowed tokens of each constrained row at -inf (a copy when any
        row is constrained; the engine's own buffer is never written)."""
        rows = [(i, self._matchers[s]) for i, s in enumerate(seq_ids) if s in self._matchers]
        if not rows:
            return logits
        out = np.array(logits, dtype=np.float32, copy=True)
        words = (out.shape[1] + 31) // 32
        bits = np.empty(words, dtype=np.int32)
        for i, m in rows:
            m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[: out.shape[1]]
            out[i, allowed == 0] = -np.inf
        return out

    def consume(self, seq_id: int, token: int) -> None:
        """Advance a constrained sequence's matcher by its sampled token (a no-op for an unconstrained one)."""
        m = self._matchers.get(seq_id)
        if m is None:
            return
        if not m.consume_token(int(token)) and not m.is_stopped():
            error = m.get_error()
            self._matchers.pop(seq_id, None)
            raise RuntimeError(f"the grammar refused token {token} of sequence {seq_id}: {error}")


def parse_json(text: str) -> Any:
    """``json.loads`` that returns None for text that is not JSON (a request cut by ``length``)."""
    try:
        return json.loads(text)
    except ValueError:
        return None
