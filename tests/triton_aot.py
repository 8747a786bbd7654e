"""Compile Triton kernels for an H100 / H200 (sm_90) on a machine without a GPU. A kernel's wrapper
(kvmesh.kernels.*) is called on CPU tensors inside `captured_launches()`: its launches are recorded
instead of run, and `compile_sm90` compiles each through Triton's ahead-of-time path (ASTSource +
GPUTarget) as the JIT would specialize it (the same binder: dtypes, 16-byte alignment, integers
divisible by 16 or equal to 1, constexprs, num_warps / num_stages), then runs the ptxas its wheel
bundles for the register and spill counts. Triton's version here may differ from the GPU machine's:
a check of the kernel's form, not of the GPU's exact code."""

import contextlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime import jit
from triton.runtime.jit import JITFunction

SM90 = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 232_448  # bytes of shared memory a block may use on sm_90


@dataclass
class Compiled:
    name: str
    shared: int
    registers: int
    spill_bytes: int
    async_copies: int  # loads pipelined into shared memory


@dataclass
class Launch:
    fn: JITFunction
    args: tuple
    kwargs: dict


def unsupported() -> str | None:
    """Why this Triton cannot be used here (None: it can): the JIT internals used to specialize a
    launch as the JIT does are Triton 3.9's, and the ptxas must be in its wheel."""
    if not hasattr(jit, "create_function_from_signature") or not hasattr(JITFunction, "_pack_args"):
        return f"Triton {triton.__version__} lacks the JIT internals tests/triton_aot.py uses (3.9's)"
    if ptxas() is None:
        return f"Triton {triton.__version__} has no bundled ptxas"
    return None


def ptxas() -> str | None:
    """The bundled ptxas that reads the PTX this Triton writes (ptxas-blackwell is the newer)."""
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        if os.access(os.path.join(folder, name), os.X_OK):
            return os.path.join(folder, name)
    return None


@contextlib.contextmanager
def captured_launches():
    """The launches made inside the block, recorded and not run (kernels return None)."""
    launches: list[Launch] = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def compile_sm90(launch: Launch) -> Compiled:
    fn, backend = launch.fn, make_backend(SM90)
    binder = jit.create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization, options)
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=SM90, options=options.__dict__)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run([ptxas(), "-v", "--gpu-name=sm_90a", path, "-o", os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    registers = re.search(r"Used (\d+) registers", out.stderr)
    spills = re.search(r"(\d+) bytes spill stores", out.stderr)
    assert registers and spills, out.stderr[-2000:]
    return Compiled(fn.__name__, kernel.metadata.shared, int(registers.group(1)), int(spills.group(1)),
                    kernel.asm["ttgir"].count("async_copy_global_to_local"))
