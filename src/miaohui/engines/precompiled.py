"""Compiled graphs made at build and called at serve without Dynamo: ``torch.compile``'s output saved per graph.

A GPU engine compiles a few small functions (an encoder's or decoder's per-layer pieces) with
``torch.compile(dynamic=True, fullgraph=True)``. Even with every Inductor cache hit, a fresh process pays Dynamo's
tracing and AOTAutograd for each graph again (20 s for a 1.5B decoder's 14 graphs on an H100), because only Dynamo
knows which compiled graph fits a call. This module removes that from the start:

- **At build**, :class:`Recorder` is the engine's compile function. Each graph Dynamo makes is compiled by
  ``torch._inductor.standalone_compile`` and kept as a :class:`Variant`: the artifact (Inductor's code, its Triton
  kernels, the AOTAutograd wrapper), where each of the graph's inputs comes from in the Python call (Dynamo's
  sources: ``L['args'][0].size()[1]``), the shape guards it was compiled under (``ShapeEnv``'s guard expression over
  sizes, strides and offsets) and the inputs' dtypes and devices. The first call of each variant is run again
  through the saved form and compared with Dynamo's output: a variant whose outputs do not map one to one is not
  saved. :meth:`Recorder.save` writes ``index.json`` and one ``.bin`` per variant.
- **At serve**, :class:`Precompiled` is the compile function: each piece becomes a :class:`PrecompiledFn` that
  builds the graph's flat inputs from the call's arguments, picks the first variant whose guards hold (remembered
  per argument shapes) and calls it, loading its artifact at that first call. A call no variant fits is compiled
  by ``torch.compile`` as before (logged once with the shapes); a missing, corrupt or other-version file leaves the
  whole engine to ``torch.compile``.

vLLM's compile cache does the same with ``standalone_compile`` but still runs Dynamo at start to find its graphs;
Dynamo's own precompile (``TORCH_CACHING_PRECOMPILE``) would also skip it, but on torch 2.11 its guard unpickling
fails on functions with default arguments (``DefaultsSource``).
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from miaohui.models.tuning import digest

log = logging.getLogger(__name__)

INDEX_FILE = "index.json"
CompileFn = Callable[[Callable[..., Any]], Callable[..., Any]]
Getter = Callable[[dict[str, Any]], Any]

_ROOT = re.compile(r"L\['([^']+)'\]")
_STEP = re.compile(r"\[(\d+)\]|\['([^']+)'\]|\.size\(\)\[(\d+)\]|\.stride\(\)\[(\d+)\]|\.storage_offset\(\)")


class VariantSpec(BaseModel):
    """One compiled graph of a piece (``index.json``)."""

    file: str
    sha256: str
    sources: list[str]
    """Where each graph input comes from in the call (Dynamo's source names, rooted at the bound arguments)."""
    guards: str
    """The shape guards the graph was compiled under, over the flat inputs ``L['t0']`` … (``ShapeEnv``'s form)."""
    tensors: dict[int, str]
    """Flat input index → ``dtype/device type`` of each tensor input (the shape guards do not check these)."""
    wrapped: dict[int, str] = {}
    """Flat input index → dtype of a Python number Dynamo passes as a 0-d CPU tensor (an unspecialised float)."""
    returns_tuple: bool
    """The piece returns a tuple of the graph's outputs (else its one output)."""


class PieceSpec(BaseModel):
    name: str
    """Order of the engine's compile calls and the function's qualified name: ``03-attn_proj_mlp``."""
    variants: list[VariantSpec]


class PrecompiledIndex(BaseModel):
    """``index.json``: every piece the build compiled, in the engine's order."""

    pieces: list[PieceSpec]
    skipped: dict[str, str] = {}
    """Pieces the build could not save, and why (serve compiles them)."""


def parse_source(name: str) -> Getter:
    """A Dynamo source name (``L['args'][3].size()[0]``, ``L['kwargs']['kv_len']``, ``L['x'].stride()[1]``) as a
    function of the bound arguments; ValueError for any other form (globals, attributes, defaults)."""
    root = _ROOT.match(name)
    if root is None:
        raise ValueError(f"unsupported graph input {name!r}")
    steps: list[tuple[str, int | str]] = []
    pos = root.end()
    while pos < len(name):
        m = _STEP.match(name, pos)
        if m is None:
            raise ValueError(f"unsupported graph input {name!r} (at {name[pos:]!r})")
        index, key, size, stride = m.groups()
        if index is not None:
            steps.append(("item", int(index)))
        elif key is not None:
            steps.append(("item", key))
        elif size is not None:
            steps.append(("size", int(size)))
        elif stride is not None:
            steps.append(("stride", int(stride)))
        else:
            steps.append(("offset", 0))
        pos = m.end()
    first = root.group(1)

    def get(arguments: dict[str, Any]) -> Any:
        value: Any = arguments[first]
        for kind, arg in steps:
            if kind == "item":
                value = value[arg]
            elif kind == "size":
                value = value.size(arg)
            elif kind == "stride":
                value = value.stride(arg)
            else:
                value = value.storage_offset()
        return value

    return get


def _binder(fn: Callable[..., Any]) -> Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]]:
    sig = inspect.signature(fn)

    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    return bind


def _tensor_kind(t: Any) -> str:
    return f"{t.dtype}/{t.device.type}"


def _piece_name(index: int, fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", type(fn).__name__).replace("<locals>.", "")
    return f"{index:02d}-{re.sub(r'[^A-Za-z0-9_.]+', '_', name)}"


class _Recorded:
    """A variant at build: the artifact and what :class:`VariantSpec` records."""

    def __init__(
        self, artifact: Any, sources: list[str], guards: str, tensors: dict[int, str], wrapped: dict[int, str]
    ) -> None:
        self.artifact = artifact
        self.sources = sources
        self.guards = guards
        self.tensors = tensors
        self.wrapped = wrapped
        self.returns_tuple = False
        self.problem: str | None = None


class Recorder:
    """The engine's compile function at build (see the module docstring); ``mode`` as ``torch.compile``'s."""

    def __init__(self, mode: str | None = None) -> None:
        self.mode = mode
        self.pieces: list[tuple[str, list[_Recorded]]] = []

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        name = _piece_name(len(self.pieces), fn)
        variants: list[_Recorded] = []
        self.pieces.append((name, variants))
        options = torch._inductor.list_mode_options(self.mode, dynamic=True) if self.mode else {}
        bind = _binder(fn)

        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            try:
                placeholders = list(gm.graph.find_nodes(op="placeholder"))
                fake_mode = torch._guards.TracingContext.get().fake_mode
                assert fake_mode is not None  # Dynamo always traces under one
                fakes = [n.meta["example_value"] for n in placeholders]
                guards = _guards_expression(fake_mode.shape_env, fakes)
                sources = [str(n.meta["grapharg"].source.name) for n in placeholders]
                tensors = {i: _tensor_kind(f) for i, f in enumerate(fakes) if isinstance(f, torch.Tensor)}
                wrapped = {
                    i: str(fakes[i].dtype).removeprefix("torch.")
                    for i, n in enumerate(placeholders)
                    if getattr(n.meta["grapharg"], "pass_arg_as_tensor", False)
                }
                artifact = torch._inductor.standalone_compile(
                    gm, example_inputs, dynamic_shapes="from_graph", options=options
                )
            except Exception as exc:  # not saveable: the build still compiles it as torch.compile would
                failed = _Recorded(None, [], "", {}, {})
                failed.problem = f"standalone_compile failed: {type(exc).__name__}: {str(exc)[:200]}"
                variants.append(failed)
                from torch._inductor.compile_fx import compile_fx

                return compile_fx(gm, example_inputs, config_patches=options)
            variants.append(_Recorded(artifact, sources, guards, tensors, wrapped))
            return artifact

        compiled = torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)

        def call(*args: Any, **kwargs: Any) -> Any:
            before = len(variants)
            out = compiled(*args, **kwargs)
            if len(variants) > before:
                _check_variant(variants[-1], bind(args, kwargs), out)
            return out

        return call

    def save(self, folder: Path) -> PrecompiledIndex:
        """Write every checked variant into ``folder`` (made if missing): one ``.bin`` each and ``index.json``."""
        folder.mkdir(parents=True, exist_ok=True)
        pieces, skipped = [], {}
        for name, variants in self.pieces:
            bad = next((v.problem for v in variants if v.problem), None)
            if bad is not None or not variants:
                skipped[name] = bad or "never called at build"
                continue
            specs = []
            for i, v in enumerate(variants):
                file = f"{name}.{i}.bin"
                v.artifact.save(path=str(folder / file), format="binary")
                specs.append(
                    VariantSpec(
                        file=file,
                        sha256=digest(folder / file),
                        sources=v.sources,
                        guards=v.guards,
                        tensors=v.tensors,
                        wrapped=v.wrapped,
                        returns_tuple=v.returns_tuple,
                    )
                )
            pieces.append(PieceSpec(name=name, variants=specs))
        index = PrecompiledIndex(pieces=pieces, skipped=skipped)
        (folder / INDEX_FILE).write_text(index.model_dump_json(indent=1))
        return index


def _guards_expression(shape_env: Any, fakes: list[Any]) -> str:
    """The shape guards over the flat inputs ``L['t0']``…, each parenthesised (``ShapeEnv.produce_guards_expression``
    joins them with ``and`` as they are, and a guard that is an ``or`` then binds wrongly)."""
    from torch._dynamo.source import LocalSource

    guards = shape_env.produce_guards(fakes, [LocalSource(f"t{i}") for i in range(len(fakes))], ignore_static=False)
    return " and ".join(f"({g})" for g in guards) or "True"


def _check_variant(v: _Recorded, arguments: dict[str, Any], want: Any) -> None:
    """Run ``v``'s artifact on the flat inputs its sources give and compare with Dynamo's output ``want``; a mismatch
    (a piece that returns an input or a non-tensor, outputs in another order) marks the piece unsaveable."""
    import torch

    if v.problem is not None:
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        v.problem = "first compiled during a CUDA graph capture (cannot be checked)"
        return
    v.returns_tuple = isinstance(want, tuple)
    wanted = list(want) if v.returns_tuple else [want]
    if not all(isinstance(w, torch.Tensor) for w in wanted):
        v.problem = "returns something other than tensors"
        return
    try:
        flat = _wrap([parse_source(s)(arguments) for s in v.sources], v.wrapped)
    except (ValueError, KeyError, IndexError) as exc:
        v.problem = f"its inputs cannot be found from the call: {exc}"
        return
    got = list(v.artifact(*flat))
    if len(got) != len(wanted) or not all(
        g.shape == w.shape and g.dtype == w.dtype and torch.allclose(g.float(), w.float(), rtol=1e-3, atol=1e-3)
        for g, w in zip(got, wanted, strict=False)
    ):
        v.problem = "the saved graph's outputs do not match what the compiled function returned"


def _wrap(flat: list[Any], wrapped: dict[int, str]) -> list[Any]:
    """``flat`` with the numbers Dynamo passes as 0-d tensors made into them."""
    if wrapped:
        import torch

        for i, dtype in wrapped.items():
            flat[i] = torch.tensor(flat[i], dtype=getattr(torch, dtype))
    return flat


class _Loaded:
    """A saved variant at serve: its guards at once, its artifact at its first call (:meth:`Precompiled.load`)."""

    def __init__(self, spec: VariantSpec, path: Path, owner: Precompiled) -> None:
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        self.spec = spec
        self.path = path
        self.owner = owner
        self.artifact: Any = None
        self.getters = [parse_source(s) for s in spec.sources]
        # ShapeEnv.evaluate_guards_expression's eval, with the expression compiled once (it is kilobytes long)
        self._guards = compile(spec.guards, f"<guards of {spec.file}>", "eval")
        self._globals = dict(SYMPY_INTERP)

    def flat(self, arguments: dict[str, Any]) -> list[Any]:
        return _wrap([get(arguments) for get in self.getters], self.spec.wrapped)

    def fits(self, flat: list[Any]) -> bool:
        for i, kind in self.spec.tensors.items():
            if i >= len(flat) or not hasattr(flat[i], "dtype") or _tensor_kind(flat[i]) != kind:
                return False
        return bool(eval(self._guards, self._globals, {"L": {f"t{i}": a for i, a in enumerate(flat)}}))

    def __call__(self, flat: list[Any]) -> Any:
        artifact = self.artifact if self.artifact is not None else self.owner.load(self)
        out = artifact(*flat)
        return tuple(out) if self.spec.returns_tuple else out[0]


class PrecompiledFn:
    """A piece at serve: the saved variants, then ``torch.compile`` for calls none of them fits."""

    def __init__(self, name: str, fn: Callable[..., Any], variants: list[_Loaded], fallback: CompileFn) -> None:
        self.name = name
        self.fn = fn
        self.variants = variants
        self.fallback = fallback
        self.bind = _binder(fn)
        self._chosen: dict[tuple[Any, ...], _Loaded | None] = {}
        self._compiled: Callable[..., Any] | None = None
        self.fallbacks = 0
        """Argument shapes that no saved variant fitted (compiled by ``torch.compile`` instead)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arguments = self.bind(args, kwargs)
        key = _shape_key(arguments)
        chosen = self._chosen.get(key, ...)
        if chosen is ...:
            chosen = next((v for v in self.variants if v.fits(v.flat(arguments))), None)
            self._chosen[key] = chosen
            if chosen is None:
                self.fallbacks += 1
                log.warning("precompiled %s: no saved graph fits %s; compiling it with torch.compile", self.name, key)
        if chosen is None:
            if self._compiled is None:
                self._compiled = self.fallback(self.fn)
            return self._compiled(*args, **kwargs)
        return chosen(chosen.flat(arguments))


def _shape_key(value: Any) -> tuple[Any, ...]:
    """What decides a variant: tensors' dtype, device, shape, stride and offset; ints and other values as is."""
    if hasattr(value, "stride") and hasattr(value, "dtype"):
        return (str(value.dtype), value.device.type, tuple(value.shape), value.stride(), value.storage_offset())
    if isinstance(value, dict):
        return tuple((k, _shape_key(v)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return tuple(_shape_key(v) for v in value)
    return (value,) if isinstance(value, (int, float, str, bool, type(None))) else (type(value).__name__,)


class Precompiled:
    """The engine's compile function at serve: the pieces of ``index`` in the engine's call order, from ``folder``;
    a piece the build skipped, or another function at that place, goes to ``fallback``.

    A variant's artifact (Inductor's module and its Triton kernels, ~0.15 s each for a 1.5B decoder's on an H100) is
    loaded at its first call, so a start loads only what its warm-up runs before ready; :meth:`load_all` loads the
    rest (the engine calls it after ready, before it captures the other buckets)."""

    def __init__(self, folder: Path, index: PrecompiledIndex, fallback: CompileFn) -> None:
        self.folder = folder
        self.pieces = {p.name: p for p in index.pieces}
        self.fallback = fallback
        self.calls = 0
        self.loaded: list[PrecompiledFn] = []
        self.compiled_instead: list[str] = []
        self.seconds = 0.0
        """Spent loading artifacts so far."""
        self.artifacts_loaded = 0
        self._lock = threading.Lock()

    @property
    def variants(self) -> list[_Loaded]:
        return [v for piece in self.loaded for v in piece.variants]

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        name = _piece_name(self.calls, fn)
        self.calls += 1
        spec = self.pieces.get(name)
        if spec is None:
            self.compiled_instead.append(name)
            return self.fallback(fn)
        variants = [_Loaded(v, self.folder / v.file, self) for v in spec.variants]
        piece = PrecompiledFn(name, fn, variants, self.fallback)
        self.loaded.append(piece)
        return piece

    def load(self, variant: _Loaded) -> Any:
        """``variant``'s artifact, loaded now if it is not yet (once, whichever thread asks first)."""
        from torch._inductor import CompiledArtifact

        with self._lock:
            if variant.artifact is None:
                started = time.perf_counter()
                variant.artifact = CompiledArtifact.load(path=str(variant.path), format="binary")
                self.seconds += time.perf_counter() - started
                self.artifacts_loaded += 1
        return variant.artifact

    def load_all(self) -> None:
        """Load every artifact not loaded yet."""
        for v in self.variants:
            if v.artifact is None:
                self.load(v)

    def summary(self) -> str:
        """How many artifacts are loaded and the time it took, for a log line."""
        return f"{self.artifacts_loaded} of {len(self.variants)} precompiled graphs loaded in {self.seconds:.2f}s"


def read_index(folder: Path) -> tuple[PrecompiledIndex | None, str]:
    """``folder``'s index with every file's digest checked, or None and why not."""
    try:
        index = PrecompiledIndex.model_validate_json((folder / INDEX_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"cannot read {folder / INDEX_FILE} ({exc})"
    for piece in index.pieces:
        for v in piece.variants:
            try:
                found = digest(folder / v.file)
            except OSError as exc:
                return None, f"cannot read {folder / v.file} ({exc})"
            if found != v.sha256:
                return None, f"{folder / v.file} has sha256 {found[:12]}…, the build wrote {v.sha256[:12]}…"
    return index, "ok"
