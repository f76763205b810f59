"""Compile a Triton kernel for the H200 (CUDA, compute capability 9.0) on a machine without a GPU: Triton's whole
pipeline (TTIR → TTGIR → LLVM IR → PTX → cubin with its bundled ptxas) runs on the CPU. The interpreter runs a
kernel's arithmetic but not its compilation, where some mistakes only show (a global a ``@jit`` function may not
read, a type ``tl.dot`` refuses): these tests catch them before GPU time is spent."""

from __future__ import annotations

from typing import Any


def compile_for_h200(fn: Any, types: list[str], constexprs: dict[str, Any]) -> Any:
    """``fn``'s runtime arguments typed in order by ``types`` (``*bf16``, ``i32``, ``fp32``, ...), then
    ``constexprs`` by name; returns the compiled kernel (its ``asm`` holds the cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    runtime = [name for name in fn.arg_names if name not in constexprs]
    if len(runtime) != len(types):
        raise ValueError(f"{fn.__name__}: {len(runtime)} runtime arguments {runtime}, {len(types)} types given")
    signature = dict(zip(runtime, types, strict=True)) | dict.fromkeys(constexprs, "constexpr")
    kernel = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32)
    )
    assert "cubin" in kernel.asm, list(kernel.asm)
    return kernel
