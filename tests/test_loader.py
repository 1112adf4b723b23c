"""Loading: quantized MLX checkpoints, hub ids without a network, dtype choice."""

import mlx.core as mx
import pytest

from mlxpaged import LLM, SamplingParams
from mlxpaged.errors import MlxPagedError
from mlxpaged.loading.loader import load

from reference import contiguous_generate


def test_quantized_mlx_checkpoint_matches_mlx_lm(tiny_model_path, tmp_path):
    """A 4-bit checkpoint written by mlx-lm's converter (as mlx-community publishes them)."""
    import mlx_lm
    from mlx_lm import convert

    qpath = tmp_path / "tiny-4bit"
    convert(str(tiny_model_path), mlx_path=str(qpath), quantize=True, q_bits=4, q_group_size=64)
    llm = LLM(str(qpath), num_blocks=64)
    assert type(llm.engine.loaded.model.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    prompt = "The KV cache stores"
    (out,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    ref, tok = mlx_lm.load(str(qpath))
    ref.set_dtype(mx.float32)
    assert out.outputs[0].token_ids == contiguous_generate(ref, tok.encode(prompt), 20)


def test_hub_repo_unreachable_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        MlxPagedError, match="cannot fetch model 'nobody/no-such-model-xyz' from the Hugging Face hub.*--model PATH"
    ):
        load("nobody/no-such-model-xyz")


def test_dtype_choice(tiny_model_path):
    assert load(str(tiny_model_path)).dtype == mx.float32  # auto on the CPU
    assert load(str(tiny_model_path), "bfloat16").dtype == mx.bfloat16
    with pytest.raises(MlxPagedError, match="unknown dtype"):
        load(str(tiny_model_path), "float8")
