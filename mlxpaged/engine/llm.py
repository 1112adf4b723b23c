"""`LLM`: the offline batch API of vLLM, on mlxpaged's engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from ..config import EngineConfig
from ..loading.loader import LoadedModel
from .beam_search import BeamSearchParams
from .builder import build_engine, init_group
from .outputs import RequestOutput
from .pooling import PoolingParams
from .sampling_params import SamplingParams


class LLM:
    """Load a model once, then `generate` completions for batches of prompts.

    `model` is a local checkpoint directory, a `.gguf` file, a Hugging Face repo id, a
    `LoadedModel`, or `None` for the offline default. Other keyword arguments are
    flat `EngineConfig.of` settings (block_size, num_blocks, max_num_seqs, max_num_batched_tokens, ...).
    `distributed=True` makes this process one rank of a tensor-parallel group started by
    `mlx.launch`: it loads only its shard, and every rank must make the same calls.
    `adapters`: LoRA adapters (mlx-lm's or PEFT's folders) by name; a request runs with one by
    naming it in `SamplingParams.adapter`, and rows of different adapters share each step;
    `adapter_dir`: a folder of adapter folders a request may name, each loaded on first use.
    """

    def __init__(
        self,
        model: str | LoadedModel | None = None,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        dtype: str | None = None,
        weights: str | None = None,
        distributed: bool = False,
        adapters: dict[str, str] | None = None,
        adapter_dir: str | None = None,
        **engine_kwargs,
    ):
        config = EngineConfig.of(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
            **engine_kwargs,
        )
        group = init_group() if distributed else None  # one rank of a group started by mlx.launch
        self.engine = build_engine(
            model, config, dtype=dtype, weights=weights, group=group, adapters=adapters, adapter_dir=adapter_dir
        )

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | dict | Sequence[str | list[int] | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of `prompts`.

        A single string or a single list of ints is one prompt. A vision model's prompt with
        images is vLLM's dict, `{"prompt": text, "multi_modal_data": {"image": image or list}}`
        (PIL images, paths or bytes), its text holding one image marker per image (the chat
        template writes them for `{"type": "image"}` parts). `on_output` sees each
        intermediate output (for streaming or progress bars): with `output_kind="delta"` what is
        new in it; the outputs returned are whole either way.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = [self._add(p, sp) for p, sp in zip(prompts, sampling_params)]
        return self._drain(ids, on_output)

    def _add(self, prompt, params: SamplingParams) -> str:
        prompt, images = _with_images(prompt)
        if images is None:  # (a tensor-parallel engine takes no images)
            return self.engine.add_request(prompt, params)
        return self.engine.add_request(prompt, params, images=images)

    def _drain(self, ids: list[str], on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        totals: dict[str, RequestOutput] = {}  # a delta request's outputs so far, added up
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if on_output is not None:
                    on_output(out)
                if out.delta:
                    if out.request_id not in totals:
                        totals[out.request_id] = dataclasses.replace(out, outputs=[])
                    out = totals[out.request_id].add(out)
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def embed(
        self, prompts: str | list[int] | Sequence[str | list[int]], params: PoolingParams | None = None
    ) -> list[RequestOutput]:
        """Each prompt's embedding (`RequestOutput.pooled`: the last token's final hidden state,
        L2-normalised; `PoolingParams.dimensions` truncates first), or with `task="score"` a
        yes/no reranker's score, all in one continuous batch (engine/pooling.py); in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self.engine.add_pooling_request(p, params or PoolingParams()) for p in prompts]
        return self._drain(ids)

    def beam_search(
        self,
        prompts: str | list[int] | dict | Sequence[str | list[int] | dict],
        params: BeamSearchParams,
    ) -> list[RequestOutput]:
        """Beam search over each prompt, all in one continuous batch; outputs in prompt order.

        Each output's `outputs` are the `beam_width` best finished hypotheses, best first, with
        `token_ids`, `text`, `cumulative_logprob` and `score` (see `mlxpaged.engine.beam_search` for
        the stopping and scoring rule). A vision model's prompt with images is vLLM's dict, as
        in `generate`.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = []
        for p in prompts:
            p, images = _with_images(p)
            extra = {"images": images} if images is not None else {}  # (a tensor-parallel engine takes none)
            ids.append(self.engine.add_beam_request(p, params, **extra))
        return self._drain(ids)


def _with_images(prompt) -> tuple:
    """(prompt, images or None) of one `generate` prompt (vLLM's multimodal dict, or plain)."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = sorted(set(prompt) - {"prompt", "multi_modal_data"})
    data = prompt.get("multi_modal_data") or {}
    if unknown or "prompt" not in prompt or not isinstance(data, dict):
        raise ValueError(f"a prompt dict takes 'prompt' and 'multi_modal_data'; got {sorted(prompt)}")
    if set(data) - {"image"}:
        raise ValueError(f"multi_modal_data: only 'image' is supported, not {sorted(set(data) - {'image'})}")
    images = data.get("image")
    return prompt["prompt"], ([images] if images is not None and not isinstance(images, list) else images)
