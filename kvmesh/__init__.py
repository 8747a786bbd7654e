"""kvmesh: serve LLMs on a cluster of GPUs with exact KV-event prefix-aware routing.

    from kvmesh import LLM, SamplingParams
    llm = LLM()
    outs = llm.generate(["What is the capital of France?"], SamplingParams(max_tokens=32, temperature=0))
"""

import os as _os

from kvmesh import _layout

_layout.install(_os.path.dirname(_os.path.abspath(__file__)))

from kvmesh.sampling_params import SamplingParams  # noqa: E402
from kvmesh.structured_outputs import StructuredOutputs  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "__version__"]


def __getattr__(name):
    # LLM pulls in torch and transformers; import it on first use so `kvmesh.hashing` stays light.
    if name == "LLM":
        from kvmesh.llm import LLM
        return LLM
    raise AttributeError(f"module 'kvmesh' has no attribute {name!r}")
