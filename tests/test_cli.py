"""`mlxpaged generate` through click's runner, bad inputs included."""

import json

import pytest
from click.testing import CliRunner

from mlxpaged.cli.main import main

from drive import run  # noqa: E402
from reference import contiguous_generate


def test_generate_json_matches_contiguous(tiny_model_path, mlx_lm_tiny):
    ref_model, tok = mlx_lm_tiny
    r = run(
        "--model",
        str(tiny_model_path),
        "--prompt",
        "The KV cache stores",
        "--prompt",
        "Paged attention",
        "--no-chat",
        "-t",
        "15",
        "--ignore-eos",
        "--json",
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [o["token_ids"] for o in data["outputs"]] == [
        contiguous_generate(ref_model, tok.encode(p), 15) for p in ["The KV cache stores", "Paged attention"]
    ]
    assert [(o["prompt_index"], o["sample_index"]) for o in data["outputs"]] == [(0, 0), (1, 0)]
    st = data["stats"]
    for key in [
        "prompt_tokens",
        "generation_tokens",
        "prompt_tps",
        "generation_tps",
        "peak_memory_gb",
        "block_size",
        "num_blocks",
        "blocks_in_use_peak",
        "blocks_without_sharing",
        "cow_copies",
    ]:
        assert key in st
    assert st["generation_tokens"] == 30 and st["block_size"] == 16


def test_generate_streams_and_summarises(tiny_model_path):
    r = run("--model", str(tiny_model_path), "--prompt", "hello", "-t", "5", "--ignore-eos", "--chat")
    assert r.exit_code == 0, r.output
    assert "Generation: 5 tokens" in r.stdout and "KV blocks:" in r.stdout


def test_n_samples_are_labelled(tiny_model_path):
    r = run(
        "--model",
        str(tiny_model_path),
        "--prompt",
        "hello",
        "-n",
        "3",
        "-t",
        "6",
        "--temp",
        "0.8",
        "--ignore-eos",
        "--block-size",
        "4",
    )
    assert r.exit_code == 0, r.output
    assert all(f"sample {i}" in r.stdout for i in range(3))
    assert "copy-on-write" in r.stdout


def test_prompts_file_jsonl(tiny_model_path, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"prompt": "The KV cache", "max_tokens": 3, "ignore_eos": true}\n'
        '{"prompt": "The KV cache", "n": 2, "max_tokens": 4, "temperature": 0.5, "ignore_eos": true}\n'
    )
    r = run("--model", str(tiny_model_path), "--prompts-file", str(f), "--json", "--block-size", "2")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [len(o["token_ids"]) for o in data["outputs"]] == [3, 4, 4]
    for key in ["prefix_cache_hit_tokens", "preemptions", "blocks_free", "blocks_cached"]:
        assert key in data["stats"]
    # Both arrive at once with one prompt: the second waits a step and reuses the first's blocks.
    cached = [o["num_cached_tokens"] for o in data["outputs"]]
    assert cached[0] == 0 and cached[1] == cached[2] > 0
    assert data["stats"]["prefix_cache_hit_tokens"] == cached[1]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "/nonexistent/model", "--prompt", "hi"], "model not found"),
        (["--prompt", ""], "empty prompt"),
        (["--prompt", "hi", "-n", "0"], "n must be"),
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens must be"),
        (["--prompt", "hi", "--block-size", "48"], "power of two"),
        (["--prompt", "hi", "--block-size", "512"], "power of two"),
        (["--prompt", "hi " * 200, "--num-blocks", "2"], "cannot fit in the KV pool"),
        (["--prompts-file", "/nonexistent.txt"], "cannot read prompts file"),
        ([], "no prompt"),
    ],
)
def test_bad_input_one_line_error(tiny_model_path, args, message):
    if "--model" not in args:
        args = ["--model", str(tiny_model_path), *args]
    r = run(*args)
    assert r.exit_code == 1
    assert "Traceback" not in r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], r.stderr


def test_unsupported_architecture(tiny_model_path, tmp_path):
    import shutil

    bad = tmp_path / "bert"
    shutil.copytree(tiny_model_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "bert"
    (bad / "config.json").write_text(json.dumps(cfg))
    r = run("--model", str(bad), "--prompt", "hi")
    # names the type and what is missing (no list of names: a model runs when its structure does)
    assert r.exit_code == 1 and "'bert'" in r.stderr and "no model module" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_corrupt_weights(tiny_model_path, tmp_path):
    import shutil

    bad = tmp_path / "corrupt"
    shutil.copytree(tiny_model_path, bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 100)
    r = run("--model", str(bad), "--prompt", "hi")
    assert r.exit_code == 1 and "Traceback" not in r.output and r.stderr.startswith("error:")


def test_generate_sizes_the_pool_to_its_workload(tiny_model_path, mlx_lm_tiny):
    """One prompt, n=3, 20 tokens: the pool holds exactly that, not a server's share of memory."""
    _, tok = mlx_lm_tiny
    prompt = "Paged attention borrows an idea from operating systems"
    r = run(
        "--model",
        str(tiny_model_path),
        "--prompt",
        prompt,
        "--no-chat",
        "-n",
        "3",
        "-t",
        "20",
        "--temp",
        "0.5",
        "--ignore-eos",
        "--json",
    )
    assert r.exit_code == 0, r.output
    st = json.loads(r.stdout)["stats"]
    p = len(tok.encode(prompt))
    shared = p // 16
    assert st["num_blocks"] == shared + 3 * (-(-(p + 19) // 16) - shared)
    # K and V, 2 layers, 2 KV heads, 16 slots, head_dim 64, float32
    assert st["pool_gb"] * 1e9 == pytest.approx(st["num_blocks"] * 2 * 2 * 2 * 16 * 64 * 4, rel=1e-6)


def test_beam_width_prints_scored_beams(tiny_model_path, mlx_lm_tiny):
    from reference import reference_beam_search

    ref_model, tok = mlx_lm_tiny
    prompt = "The KV cache stores"
    r = run("--model", str(tiny_model_path), "--prompt", prompt, "--no-chat", "--beam-width", "3", "-t", "8", "--json")
    assert r.exit_code == 0, r.output
    outs = json.loads(r.stdout)["outputs"]
    want = reference_beam_search(ref_model, tok.encode(prompt), 3, 8, eos=set(tok.eos_token_ids))
    assert [o["token_ids"] for o in outs] == [t for _, t, _ in want]
    assert [o["score"] for o in outs] == pytest.approx([s for s, _, _ in want], abs=1e-4)
    r = run("--model", str(tiny_model_path), "--prompt", prompt, "--no-chat", "--beam-width", "3", "-t", "8")
    assert r.exit_code == 0 and r.stdout.count("==== beam ") == 3 and "score" in r.stdout


def test_generate_and_serve_share_model_and_engine_flags():
    """Both commands take the model and engine flags from one declaration: same names, defaults
    and choices, and each engine flag reaches its EngineConfig field. Two defaults differ on
    purpose, for interactive clients: serve's prefill order and its chunk (resolved per device)."""
    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.flags import ENGINE_FIELDS, engine_config

    serving = {"prefill_order": ("fcfs", "shortest"), "max_num_batched_tokens": (2048, None)}
    params = {cmd: {p.name: p for p in main.commands[cmd].params} for cmd in ("generate", "serve")}
    shared = ["model", "dtype", "weights", *ENGINE_FIELDS]
    for name in shared:
        g, s = params["generate"][name], params["serve"][name]
        assert (g.opts, getattr(g.type, "choices", None)) == (s.opts, getattr(s.type, "choices", None))
        assert (g.default, s.default) == serving.get(name, (g.default, g.default)), name
    kw = {flag: params["generate"][flag].default for flag in ENGINE_FIELDS} | {"port": 8000}
    assert engine_config(kw) == EngineConfig() and kw == {"port": 8000}  # defaults agree; flags taken out


@pytest.mark.parametrize("args,msg", [(["--block-size", "3"], "block size"), (["--kv-bits", "3"], "kv_bits")])
def test_serve_bad_engine_flag_one_line(args, msg):
    """`serve` rejects bad engine settings before loading anything: one line, exit 1."""
    r = CliRunner().invoke(main, ["serve", "--port", "0", *args])
    assert r.exit_code == 1 and msg in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1
