"""The attention-backend registry: one line per backend in `BACKENDS`, with what it supports.

`auto` takes the first backend, in registry order, that is installed and supports the request
(device, block size, head dim, dtype, KV-cache dtype); CUDA graphs are captured only for a backend that supports
them. A backend asked for by name that does not support the request is an error naming the field and
the limit. The engine config's names (kvmesh.config.ATTENTION_BACKENDS, a contract that imports
nothing of the worker) are checked against this registry by tests/unit/test_registries.py.

Pure data: importing this module imports no backend and no GPU library.
"""

import importlib.util
from dataclasses import dataclass

ANY_DTYPE = ("float32", "bfloat16", "float16")
HALF_DTYPES = ("bfloat16", "float16")
MODEL_DTYPE_KV = ("auto",)  # K/V stored in the model dtype only
FP8_KV = ("auto", "fp8_e4m3")  # also float8_e4m3fn K/V with per-layer scales
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's names


@dataclass(frozen=True)
class BackendSpec:
    target: str  # "module:Class"; GPU libraries are imported by the class when it is built
    library: str | None  # the package it needs installed (None: only torch)
    needs_gpu: bool
    cuda_graphs: bool  # its decode step can be captured in a CUDA graph
    dtypes: tuple[str, ...]
    block_size_multiple: int = 1
    head_dims: tuple[int, ...] | None = None  # None: any
    kv_cache_dtypes: tuple[str, ...] = MODEL_DTYPE_KV

    def unsupported(self, block_size: int, head_dim: int, dtype: str,
                    kv_cache_dtype: str = "auto") -> tuple[str, str] | None:
        """(field, the limit it breaks) for the first thing this backend cannot take; None if none."""
        if block_size % self.block_size_multiple:
            return "block_size", f"a multiple of {self.block_size_multiple}"
        if self.head_dims is not None and head_dim not in self.head_dims:
            return "head_dim", f"one of {', '.join(map(str, self.head_dims))}"
        if dtype not in self.dtypes:
            return "dtype", f"one of {', '.join(self.dtypes)}"
        if kv_cache_dtype_name(kv_cache_dtype) not in self.kv_cache_dtypes:
            return "kv_cache_dtype", f"one of {', '.join(self.kv_cache_dtypes)}"
        return None

    def installed(self) -> bool:
        return self.library is None or importlib.util.find_spec(self.library) is not None


# Registry order is `auto`'s preference.
BACKENDS = {
    # flashinfer's kernels are built for these head dims (vLLM's FlashInfer backend lists the same).
    "flashinfer": BackendSpec("kvmesh.worker.attention.flashinfer_backend:FlashInferAttentionBackend",
                              "flashinfer", needs_gpu=True, cuda_graphs=True, dtypes=HALF_DTYPES,
                              head_dims=(64, 128, 256), kv_cache_dtypes=FP8_KV),
    # flash-attn 2's paged KV cache needs pages of a multiple of 256 tokens; head dims up to 256.
    # No fp8 KV: flash-attn 2.8's flash_attn_with_kvcache / varlen take K/V in the query's dtype and
    # no descale (q/k/v_descale are flash-attn 3's interface).
    "flash_attn": BackendSpec("kvmesh.worker.attention.flash_attn_backend:FlashAttnAttentionBackend",
                              "flash_attn", needs_gpu=True, cuda_graphs=True, dtypes=HALF_DTYPES,
                              block_size_multiple=256, head_dims=tuple(range(8, 257, 8))),
    # kvmesh's Triton kernels: tl.arange over the head dim wants a power of two, tl.dot at least 16.
    "triton": BackendSpec("kvmesh.worker.attention.triton_backend:TritonAttentionBackend",
                          "triton", needs_gpu=True, cuda_graphs=True, dtypes=ANY_DTYPE,
                          head_dims=(16, 32, 64, 128, 256), kv_cache_dtypes=FP8_KV),
    # The reference: loops over sequences on the host, so a step cannot be captured in a graph.
    "torch": BackendSpec("kvmesh.worker.attention.torch_backend:TorchAttentionBackend",
                         None, needs_gpu=False, cuda_graphs=False, dtypes=ANY_DTYPE, kv_cache_dtypes=FP8_KV),
}

_FIELD_SOURCE = {  # where a user sets each field
    "block_size": "block_size (engine.block_size in a serve config)",
    "head_dim": "the model's head_dim",
    "dtype": "dtype (engine.dtype in a serve config)",
    "kv_cache_dtype": "kv_cache_dtype (engine.kv_cache_dtype in a serve config)",
}


def dtype_name(dtype) -> str:
    """"bfloat16" for torch.bfloat16 (the registry names dtypes as the engine config does)."""
    return str(dtype).removeprefix("torch.")


def kv_cache_dtype_name(kv_cache_dtype: str) -> str:
    """The registry's name of a KV-cache dtype: "fp8" is "fp8_e4m3"."""
    return KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)


def backend_spec(name: str) -> BackendSpec:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}")
    return BACKENDS[name]


def block_size_for(name: str, preferred: int = 16) -> int:
    """`preferred` rounded up to a block size backend `name` takes (16 -> 256 for flash_attn); for
    `auto`, `preferred` itself."""
    if name == "auto":
        return preferred
    multiple = backend_spec(name).block_size_multiple
    return -(-preferred // multiple) * multiple


def check_supported(name: str, block_size: int, head_dim: int, dtype: str, kv_cache_dtype: str = "auto") -> None:
    """Raise a ValueError naming the field and the limit when backend `name` cannot take these."""
    problem = backend_spec(name).unsupported(block_size, head_dim, dtype, kv_cache_dtype)
    if problem is None:
        return
    field, limit = problem
    value = {"block_size": block_size, "head_dim": head_dim, "dtype": dtype,
             "kv_cache_dtype": kv_cache_dtype}[field]
    others = [n for n, s in BACKENDS.items()
              if n != name and s.unsupported(block_size, head_dim, dtype, kv_cache_dtype) is None]
    fix = "choose" if field == "head_dim" else "change it or choose"
    raise ValueError(f"attention_backend {name!r} needs {_FIELD_SOURCE[field]} to be {limit}, got "
                     f"{value}; {fix} attention_backend {' or '.join(others)}")


def choose_backend(name: str, device_type: str, block_size: int, head_dim: int, dtype: str,
                   kv_cache_dtype: str = "auto") -> str:
    """The backend to build: `name` itself once checked, or for `auto` the first in registry order
    that runs on this device, is installed and supports the request."""
    on_gpu = device_type == "cuda"
    if name != "auto":
        spec = backend_spec(name)
        if spec.needs_gpu and not on_gpu:
            raise ValueError(f"attention_backend {name!r} needs a CUDA device; use 'torch' on the CPU")
        check_supported(name, block_size, head_dim, dtype, kv_cache_dtype)
        if not spec.installed():
            raise ValueError(f"attention_backend {name!r} is not available here: the {spec.library!r} "
                             "package is not installed")
        return name
    for candidate, spec in BACKENDS.items():
        if ((on_gpu or not spec.needs_gpu) and spec.installed()
                and spec.unsupported(block_size, head_dim, dtype, kv_cache_dtype) is None):
            return candidate
    raise ValueError(f"no attention backend supports block_size {block_size}, head_dim {head_dim}, "
                     f"dtype {dtype} and kv_cache_dtype {kv_cache_dtype} on {device_type}")


def uses_cuda_graphs(name: str, device_type: str, enforce_eager: bool) -> bool:
    """Whether decode steps of backend `name` are captured in CUDA graphs."""
    return device_type == "cuda" and not enforce_eager and backend_spec(name).cuda_graphs
