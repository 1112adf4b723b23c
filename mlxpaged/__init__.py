"""mlxpaged: PagedAttention inference on MLX for Apple Silicon."""

from ._blas import use_system_blas

use_system_blas()  # before MLX loads: see _blas.py


from .attention import paged_attention, paged_attention_varlen
from .config import EngineConfig
from .engine.beam_search import BeamSearchParams
from .engine.llm import LLM
from .engine.llm_engine import LLMEngine
from .engine.outputs import CompletionOutput, RequestOutput
from .engine.sampling_params import SamplingParams
from .version import __version__

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "paged_attention",
    "paged_attention_varlen",
    "BeamSearchParams",
]
