"""Per-request sampling parameters (OpenAI's names and ranges). Pure pydantic: no torch, no numpy."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, field_validator

from miaohui.config import Frozen
from miaohui.errors import InputError

MAX_STOP_SEQUENCES = 16


class SamplingParams(Frozen):
    """How one request's tokens are chosen and when its generation ends."""

    max_tokens: int = Field(default=256, ge=1, le=32_768)
    """Most tokens to generate (the context length may end a sequence earlier, reason ``length``)."""
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    """Softmax temperature; 0 means greedy (argmax), which ignores ``top_p`` and ``seed``."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches ``top_p``."""
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    """Seed of this request's own random generator: same seed, prompt and parameters ⇒ same tokens."""
    stop: tuple[str, ...] = ()
    """Strings that end generation when they appear in the generated text; they are not returned."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (besides the model's end-of-sequence tokens)."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence token (benchmarks use it for fixed lengths)."""
    json_schema: str | None = None
    """A JSON schema (as JSON text) the generated text must follow, by constrained decoding
    (:mod:`miaohui.generation.engine.structured`); ``{"type": "object"}`` is any JSON object. None: free text."""
    logprobs: int | None = Field(default=None, ge=0, le=20)
    """Return each generated token's log-probability (log-softmax of the model's logits) with this many most
    likely alternatives (0: the token's only). None: none (they cost a softmax over the vocabulary per token)."""

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: object) -> object:
        if v is None:
            return ()
        if isinstance(v, str):
            return (v,)
        return v

    @field_validator("stop")
    @classmethod
    def _stop_ok(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(v) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(v)}")
        if any(s == "" for s in v):
            raise ValueError("stop sequences must not be empty strings")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    @classmethod
    def create(cls, **kwargs: Any) -> SamplingParams:
        """Build from request fields; invalid values raise :class:`InputError` (HTTP 400) naming them."""
        try:
            return cls(**kwargs)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'params'}={err.get('input')!r}: {err['msg']}"
                for err in exc.errors()
            )
            raise InputError(
                f"invalid sampling parameters: {problems}",
                "use max_tokens >= 1, 0 <= temperature <= 2, 0 < top_p <= 1, seed >= 0, "
                f"at most {MAX_STOP_SEQUENCES} non-empty stop strings",
            ) from None
