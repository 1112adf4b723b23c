"""mlxpaged: PagedAttention inference on MLX for Apple Silicon."""

from ._blas import use_system_blas

use_system_blas()  # before MLX loads: see _blas.py


from .attention import paged_attention, paged_attention_varlen
from .beam_search import BeamSearchParams
from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

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
__version__ = "0.1.0"
