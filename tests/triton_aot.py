"""Compile a Triton kernel for an H100 / H200 (sm_90) on a machine without a GPU: Triton's ahead-of-time
path (ASTSource + GPUTarget) with the ptxas its wheel bundles. Gives what the GPU's launch would
compile, as the JIT specializes it (16-byte aligned pointers, the named integers multiples of 16),
with its shared memory and ptxas's register and spill counts. Triton's version here may differ from
the GPU machine's: a check of the kernel's form, not of the GPU's exact code."""

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 232_448  # bytes of shared memory a block may use on sm_90


@dataclass
class Compiled:
    shared: int
    registers: int
    spill_bytes: int


def ptxas() -> str | None:
    """The bundled ptxas that reads the PTX this Triton writes (ptxas-blackwell is the newer)."""
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        if os.access(os.path.join(folder, name), os.X_OK):
            return os.path.join(folder, name)
    return None


def compile_sm90(fn, types: dict[str, str], constexprs: dict, num_warps: int, num_stages: int,
                 multiples_of_16: tuple[str, ...] = ()) -> Compiled:
    """fn (a @triton.jit kernel) with `types` for its runtime arguments ("*bf16", "i32", "fp32", ...)
    and `constexprs` for the rest."""
    signature = {a: "constexpr" if a in constexprs else types[a] for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if a not in constexprs and (types[a].startswith("*") or a in multiples_of_16)}
    src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    kernel = triton.compile(src, target=SM90, options={"num_warps": num_warps, "num_stages": num_stages})
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
    return Compiled(kernel.metadata.shared, int(registers.group(1)), int(spills.group(1)))
