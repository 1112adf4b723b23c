"""`mlxpaged` on the command line: `generate` (and `bench`, where installed)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import click

from ..engine.flags import engine_config, launched_rank, model_and_engine_options, user_errors
from ..engine.guided import GuidedDecoding
from ..engine.sampling_params import SamplingParams
from ..errors import MlxPagedError

SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def _read_prompts_file(path: str) -> list[tuple[str, dict]]:
    """One prompt per line, or JSONL objects with a "prompt" and per-request sampling fields."""
    items = []
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as e:
        raise MlxPagedError(f"cannot read prompts file {path}: {e.strerror}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise MlxPagedError(f"{path}:{i}: invalid JSON ({e.msg})") from None
            if not isinstance(obj.get("prompt"), str):
                raise MlxPagedError(f'{path}:{i}: a JSON line needs a string "prompt"')
            unknown = set(obj) - SAMPLING_FIELDS - {"prompt"}
            if unknown:
                raise MlxPagedError(f"{path}:{i}: unknown fields {sorted(unknown)}")
            if isinstance(
                obj.get("guided"), dict
            ):  # {"json_schema": {...}} or {"json_object": true} or {"grammar": "..."}
                try:
                    obj["guided"] = GuidedDecoding(**obj["guided"])
                except (TypeError, ValueError) as e:
                    raise MlxPagedError(f'{path}:{i}: bad "guided": {e}') from None
            items.append((obj.pop("prompt"), obj))
        else:
            items.append((line.replace("\\n", "\n"), {}))
    if not items:
        raise MlxPagedError(f"prompts file {path} has no prompts")
    return items


def _parse_logit_bias(items: tuple[str, ...]) -> dict[int, float] | None:
    bias = {}
    for item in items:
        tok, _, val = item.partition("=")
        try:
            bias[int(tok)] = float(val)
        except ValueError:
            raise MlxPagedError(f"--logit-bias takes TOKEN_ID=BIAS (e.g. 13=-100), got {item!r}") from None
    return bias or None


def _read_json_schema(path: str) -> dict:
    try:
        schema = json.loads(open(path, encoding="utf-8").read())
    except OSError as e:
        raise MlxPagedError(f"cannot read JSON schema file {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise MlxPagedError(f"{path}: invalid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(schema, dict):
        raise MlxPagedError(f"{path}: a JSON schema must be an object")
    return schema


def _encode(tokenizer, prompt: str, chat: bool, num_images: int = 0) -> list[int]:
    """A prompt's ids; with `num_images`, the chat template's user turn holds that many images
    before the text (without the template, the text holds their markers itself)."""
    if not prompt.strip():
        raise MlxPagedError("empty prompt")
    if chat and getattr(tokenizer, "chat_template", None):
        from ..engine.chat import chat_ids

        content = [{"type": "image"}] * num_images + [{"type": "text", "text": prompt}] if num_images else prompt
        return chat_ids(tokenizer, [{"role": "user", "content": content}])
    return tokenizer.encode(prompt)


class OneLineErrors(click.Group):
    """The `mlxpaged` group: a usage error (a bad flag value, a missing option, an unknown
    command) is one line and exit 1, like every other refusal at start-up, not click's
    three-line usage block and exit 2."""

    def main(self, *args, **kwargs):
        kwargs.pop("standalone_mode", None)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as e:
            where = f"{e.ctx.command_path}: " if e.ctx is not None and e.ctx.command is not self else ""
            click.echo(f"error: {where}{e.format_message()}", err=True)
            sys.exit(1)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("error: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=OneLineErrors)
@click.version_option(package_name="mlxpaged")
def main():
    """mlxpaged: PagedAttention inference on MLX for Apple Silicon."""


@main.command()
@model_and_engine_options("what the prompts, -n and --max-tokens can use, capped by free memory")
@click.option("--prompt", "-p", "prompts", multiple=True, help="A prompt; repeat for a batch. '-' reads stdin.")
@click.option(
    "--prompts-file",
    type=click.Path(dir_okay=False),
    help='One prompt per line, or JSONL with "prompt" and sampling fields.',
)
@click.option("-n", "n", default=1, show_default=True, help="Samples per prompt (share the prompt's blocks).")
@click.option("--max-tokens", "-t", default=256, show_default=True, help="Tokens to generate at most.")
@click.option("--temp", default=0.0, show_default=True, help="Sampling temperature (0 = greedy).")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True, help="0 disables.")
@click.option(
    "--seed",
    default=0,
    show_default=True,
    help="Seed of each prompt; sample i draws from its own stream derived from (seed, i).",
)
@click.option(
    "--min-p",
    default=0.0,
    show_default=True,
    help="Drop tokens less likely than min_p times the most likely one (0 disables).",
)
@click.option(
    "--logit-bias",
    multiple=True,
    metavar="TOKEN_ID=BIAS",
    help="Add BIAS in [-100, 100] to a token's logit (100 forces, -100 bans); repeatable.",
)
@click.option(
    "--presence-penalty",
    default=0.0,
    show_default=True,
    help="OpenAI's, in [-2, 2]: subtracted once from each token already generated.",
)
@click.option(
    "--frequency-penalty",
    default=0.0,
    show_default=True,
    help="OpenAI's, in [-2, 2]: subtracted per occurrence of each generated token.",
)
@click.option(
    "--repetition-penalty",
    default=1.0,
    show_default=True,
    help="HF's, > 0: divides positive (multiplies negative) logits of prompt and generated tokens (1 disables).",
)
@click.option(
    "--json-schema",
    "json_schema",
    type=click.Path(dir_okay=False),
    help="A JSON schema file every completion must follow (grammar-constrained decoding).",
)
@click.option("--stop", multiple=True, help="A stop string; repeatable.")
@click.option(
    "--chat/--no-chat", default=True, show_default=True, help="Wrap each prompt in the model's chat template."
)
@click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS (benchmarks).")
@click.option(
    "--beam-width", default=0, show_default=True, help="Beam search with this many beams on shared blocks (0: sample)."
)
@click.option(
    "--length-penalty", default=1.0, show_default=True, help="Beam score = cumulative logprob / length ** this."
)
@click.option(
    "--adapter",
    "adapter",
    type=click.Path(file_okay=False),
    help="A LoRA adapter folder (mlx_lm.lora's adapters.safetensors, or PEFT's) to generate with.",
)
@click.option(
    "--image",
    "image_paths",
    multiple=True,
    help="An image file for a vision model, placed before each prompt's text; repeatable (in order).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with outputs and stats.")
def generate(
    model,
    dtype,
    weights,
    prompts,
    prompts_file,
    n,
    max_tokens,
    temp,
    top_p,
    top_k,
    seed,
    min_p,
    logit_bias,
    presence_penalty,
    frequency_penalty,
    repetition_penalty,
    json_schema,
    stop,
    chat,
    ignore_eos,
    beam_width,
    length_penalty,
    adapter,
    image_paths,
    as_json,
    **engine_flags,
):
    """Generate completions for one or more prompts on a paged KV cache."""
    with user_errors():
        items = [(sys.stdin.read() if p == "-" else p, {}) for p in prompts]
        if prompts_file:
            items += _read_prompts_file(prompts_file)
        if not items:
            raise MlxPagedError("no prompt: give --prompt TEXT (repeatable) or --prompts-file FILE")
        base = dict(
            n=n,
            max_tokens=max_tokens,
            temperature=temp,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=list(stop),
            ignore_eos=ignore_eos,
            min_p=min_p,
            logit_bias=_parse_logit_bias(logit_bias),
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            guided=GuidedDecoding(json_schema=_read_json_schema(json_schema)) if json_schema else None,
            adapter="adapter" if adapter else None,
        )
        params = [SamplingParams(**{**base, **extra}) for _, extra in items]
        beam = None
        if beam_width:
            knobs = {
                "--min-p": min_p != 0,
                "--logit-bias": bool(logit_bias),
                "--presence-penalty": presence_penalty != 0,
                "--frequency-penalty": frequency_penalty != 0,
                "--repetition-penalty": repetition_penalty != 1,
                "--json-schema": bool(json_schema),
            }
            if any(knobs.values()):
                raise MlxPagedError(f"{', '.join(k for k, v in knobs.items() if v)} cannot be used with --beam-width")
            from ..engine.beam_search import BeamSearchParams

            beam = BeamSearchParams(
                beam_width, max_tokens, ignore_eos=ignore_eos, length_penalty=length_penalty, adapter=base["adapter"]
            )
            params = [SamplingParams(n=beam_width, max_tokens=max_tokens)] * len(items)  # the pool's sizing
        config = engine_config(engine_flags)
        if any(not p.strip() for p, _ in items):
            raise MlxPagedError("empty prompt")
        from ..engine.builder import build_engine, load_model
        from ..engine.sizing import request_blocks
        from ..worker.kv_cache import pool_blocks

        group, follower = launched_rank()  # one rank of several under mlx.launch: tensor parallelism
        if follower:
            sys.stdout = open(os.devnull, "w")  # rank 0 prints; the others only compute
        loaded = load_model(model, dtype, weights, group)
        ids = [_encode(loaded.tokenizer, p, chat, len(image_paths)) for p, _ in items]
        images = [None] * len(ids)
        if image_paths:  # each prompt's image markers widened to its images' tokens (multimodal.py)
            from ..engine.multimodal import decode_images, process_images

            if beam is not None:
                raise MlxPagedError("--image cannot be used with --beam-width")
            decoded = decode_images([Path(p) for p in image_paths])
            images = [process_images(loaded, i, decoded) for i in ids]
            ids = [im.ids for im in images]
        # `generate` knows its whole workload: a pool just big enough for all of it at full length.
        need = sum(request_blocks(len(i), p.n, p.max_tokens, config.cache.block_size) for i, p in zip(ids, params))
        config.cache.num_blocks = pool_blocks(loaded, config, need)
        engine = build_engine(loaded, config, group=group, adapters={"adapter": adapter} if adapter else None)
        if beam is not None:
            rids = [engine.add_beam_request(i, beam) for i in ids]
        else:
            rids = [
                engine.add_request(i, sp, images=im) if im is not None else engine.add_request(i, sp)
                for i, sp, im in zip(ids, params, images)
            ]  # (a tensor-parallel engine takes no images)

    stream = not as_json and len(items) == 1 and params[0].n == 1 and beam is None
    with user_errors():  # MlxPagedError: a tensor-parallel rank lost its peers or diverged
        done = _run(engine, rids, stream=stream, progress=bool(prompts_file) and not stream, as_json=as_json)
    # The cache's format first, so a stats_dict that reports it itself wins.
    stats = engine.stats_dict()
    if as_json:
        outputs = [
            {
                "prompt_index": i,
                "sample_index": c.index,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "num_cached_tokens": done[r].num_cached_tokens,
                **({"cumulative_logprob": c.cumulative_logprob, "score": c.score} if beam is not None else {}),
            }
            for i, r in enumerate(rids)
            if r in done
            for c in done[r].outputs
        ]
        click.echo(json.dumps({"outputs": outputs, "stats": stats}))
    else:
        _summary(stats)
    if len(done) < len(rids):
        sys.exit(130)


def _run(engine, rids, *, stream: bool, progress: bool, as_json: bool) -> dict:
    """Step the engine to the end; print finished outputs as they come unless `as_json`.

    Ctrl-C stops early but keeps (and prints) what already finished.
    """
    from tqdm import tqdm

    order = {r: i for i, r in enumerate(rids)}
    done, printed = {}, 0
    bar = tqdm(total=len(rids), unit="req", file=sys.stderr, disable=not progress)
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if stream:
                    text = out.outputs[0].text
                    click.echo(text[printed:], nl=False)
                    printed = len(text)
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
                    if not stream and not as_json:
                        _print_output(order[out.request_id], out, len(rids))
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted: {len(done)} of {len(rids)} requests finished", err=True)
    bar.close()
    if stream:
        click.echo()
    return done


def _print_output(index: int, out, num_prompts: int) -> None:
    for c in out.outputs:
        what = "beam" if c.score is not None else "sample"
        label = f"prompt {index}, {what} {c.index}" if num_prompts > 1 else f"{what} {c.index}"
        score = f", score {c.score:.4f}, logprob {c.cumulative_logprob:.4f}" if c.score is not None else ""
        click.echo(f"==== {label} ({len(c.token_ids)} tokens, {c.finish_reason}{score}) ====")
        click.echo(c.text)


def _summary(s: dict) -> None:
    click.echo("==========")
    click.echo(f"Prompt: {s['prompt_tokens']} tokens, {s['prompt_tps']:.1f} tokens-per-sec")
    click.echo(f"Generation: {s['generation_tokens']} tokens, {s['generation_tps']:.1f} tokens-per-sec")
    kv = f"{s['kv_bits']}-bit K/V, group {s['kv_group_size']}" if s.get("kv_bits") else "K/V in the model's dtype"
    click.echo(
        f"Peak memory: {s['peak_memory_gb']:.3f} GB (KV pool: {s['num_blocks']} blocks of "
        f"{s['block_size']} tokens, {kv}, {s['pool_gb']:.3f} GB)"
    )
    forks = f", {s['beam_forks']} beam forks, {s['beam_frees']} beams freed" if s["beam_forks"] else ""
    click.echo(
        f"KV blocks: {s['blocks_in_use_peak']} in use at peak (without sharing: {s['blocks_without_sharing']}), "
        f"{s['cow_copies']} copy-on-write copies{forks}, block size {s['block_size']}, pool {s['num_blocks']}"
    )
    if s.get("speculative"):
        click.echo(
            f"Speculative decoding ({s['speculative']}): {s['spec_accepted_tokens']} of "
            f"{s['spec_proposed_tokens']} proposed tokens "
            f"accepted ({100 * s['spec_acceptance_rate']:.1f}%), "
            f"mean accepted length {s['spec_mean_accepted_length']:.2f}"
        )
    if s["prefix_cache_hit_tokens"] or s["preemptions"]:
        disk = f" ({s['prefix_cache_disk_hit_tokens']} from disk)" if s.get("prefix_cache_disk_hit_tokens") else ""
        click.echo(
            f"Prefix cache: {s['prefix_cache_hit_tokens']} prompt tokens reused{disk}; preemptions: {s['preemptions']}"
        )


def _add_bench() -> None:
    from ..bench.cli import bench

    main.add_command(bench)


def _add_doctor() -> None:
    from .doctor import doctor  # imports click only; MLX loads when `doctor` runs

    main.add_command(doctor)


def _add_serve() -> None:
    from ..server.cli import serve  # imports click only; FastAPI etc. load when `serve` runs

    main.add_command(serve)


def _add_models() -> None:
    from .models import ls, pull, rm  # imports click only; huggingface_hub loads when one runs

    for command in (pull, ls, rm):
        main.add_command(command)


_add_bench()
_add_serve()
_add_doctor()
_add_models()

if __name__ == "__main__":
    main()
