"""mlxpaged: PagedAttention inference on MLX for Apple Silicon."""

from ._blas import use_system_blas

use_system_blas()  # before MLX loads: see _blas.py


# noqa: E402 on these imports: they come after use_system_blas() on purpose (OpenBLAS must load before MLX)
from .attention import paged_attention, paged_attention_varlen  # noqa: E402
from .config import EngineConfig  # noqa: E402
from .engine.beam_search import BeamSearchParams  # noqa: E402
from .engine.llm import LLM  # noqa: E402
from .engine.llm_engine import LLMEngine  # noqa: E402
from .engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from .engine.sampling_params import SamplingParams  # noqa: E402
from .version import __version__  # noqa: E402

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
    "__version__",
]
