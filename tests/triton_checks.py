"""Checking miaohui's Triton kernels without a GPU, two ways:

* :func:`run_interpreted`: a script run in a child process under Triton's interpreter (``TRITON_INTERPRET=1`` must be
  set before Triton is imported), which runs a kernel's arithmetic on the CPU;
* :func:`compile_for_h200`: Triton's whole pipeline (TTIR → TTGIR → LLVM IR → PTX → cubin with its bundled ptxas) for
  the H200 (CUDA, compute capability 9.0), also on the CPU. The interpreter does not compile, and some mistakes only
  show there (a global a ``@jit`` function may not read, a type ``tl.dot`` refuses): caught before GPU time is spent.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

INTERPRETER_FIX = """
import triton.runtime.interpreter as _interp

_patch_tensor = _interp._patch_lang_tensor


def _with_scalar_index(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interp._patch_lang_tensor = _with_scalar_index
"""
"""Triton 3.6's interpreter turns a scalar into a Python int with ``int(array)``, which numpy 2.x refuses for the
one-element 1-D arrays the interpreter keeps scalars in: a loop whose bounds are runtime values (``range(lo, hi)``,
as the prompt attention's) fails there, not on the GPU. Prepended to every interpreted script."""


def run_interpreted(script: str) -> str:
    """Run ``script`` (Python source) under Triton's interpreter in a child process; its stdout, stripped. Fails the
    calling test with the child's stderr when it exits non-zero."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    source = INTERPRETER_FIX + script
    done = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def compile_for_h200(
    fn: Any,
    types: list[str],
    constexprs: dict[str, Any],
    divisible: tuple[str, ...] = (),
    options: dict[str, Any] | None = None,
) -> Any:
    """``fn``'s runtime arguments typed in order by ``types`` (``*bf16``, ``i32``, ``fp32``, ...), then
    ``constexprs`` by name; returns the compiled kernel (its ``asm`` holds the PTX and the cubin). Pointers and
    ``stride*`` integers are marked divisible by 16, as a launch marks torch's allocations and the models' strides
    (hidden sizes are multiples of 16), and so are the integers named in ``divisible`` (sizes that masks compare
    against), so the loads are the vectorized ones the GPU compiles: without the marks the decode attention's K/V
    loads compile to 2-byte loads, with them to 16-byte ones. ``options``: ``num_warps``, ``num_stages``, …"""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    runtime = [name for name in fn.arg_names if name not in constexprs]
    if len(runtime) != len(types):
        raise ValueError(f"{fn.__name__}: {len(runtime)} runtime arguments {runtime}, {len(types)} types given")
    signature = dict(zip(runtime, types, strict=True)) | dict.fromkeys(constexprs, "constexpr")
    aligned = {
        (fn.arg_names.index(name),): [["tt.divisibility", 16]]
        for name, kind in zip(runtime, types, strict=True)
        if kind.startswith("*") or name.startswith("stride") or name in divisible
    }
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert "cubin" in kernel.asm, list(kernel.asm)
    return kernel
