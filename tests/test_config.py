"""EngineConfig in parts (cache, scheduler, speculative), as vLLM's VllmConfig: every engine flag
lands in exactly one part's field, the flat form round-trips, and bad values are refused by the part
that owns them."""

import dataclasses

import pytest

from mlxpaged.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig, flat_field
from mlxpaged.engine.flags import ENGINE_FIELDS


def test_every_engine_flag_has_one_home():
    homes = {}
    for flag, name in ENGINE_FIELDS.items():
        where = flat_field(name)
        assert where is not None, f"flag --{flag} ({name}) reaches no config field"
        assert where not in homes.values(), f"{name} and another flag share {where}"
        homes[name] = where
    # and every field of every part is reachable from a flat name (nothing only code can set)
    parts = {"cache": CacheConfig, "scheduler": SchedulerConfig, "speculative": SpeculativeConfig}
    every = {(p, f.name) for p, cls in parts.items() for f in dataclasses.fields(cls)} | {(None, "attention_impl")}
    assert set(homes.values()) <= every
    assert {flat_field(n) for n in EngineConfig().flat()} == every


def test_of_routes_flat_settings_to_their_parts_and_round_trips():
    c = EngineConfig.of(block_size=8, max_num_seqs=3, speculative="ngram", speculative_max_batch_size=2, kv_bits=8)
    assert c.cache.block_size == 8 and c.cache.kv_bits == 8
    assert c.scheduler.max_num_seqs == 3
    assert c.speculative.method == "ngram" and c.speculative.max_batch_size == 2
    assert EngineConfig.of(**c.flat()) == c
    assert EngineConfig.of() == EngineConfig()


@pytest.mark.parametrize(
    "flat, msg",
    [
        ({"block_size": 12}, "power of two"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"speculative": "draft"}, "needs a draft model"),
        ({"prefix_cache_disk_gb": 1.0}, "needs prefix_cache_dir"),
        ({"watermark": 1.5}, "watermark"),
    ],
)
def test_bad_values_are_refused_by_their_part(flat, msg):
    with pytest.raises(ValueError, match=msg):
        EngineConfig.of(**flat)


def test_an_unknown_setting_is_refused_by_name():
    with pytest.raises(TypeError, match="'max_batch'"):
        EngineConfig.of(max_batch=4)


def test_serve_defaults_to_the_shortest_prefill_first_and_small_cpu_chunks_generate_does_not():
    """`serve` (interactive clients) takes the shortest prefill first and, on the CPU, 256-token
    chunks; `generate` keeps arrival order and 2,048; a flag given explicitly wins in both."""
    import mlx.core as mx

    from mlxpaged.cli.main import main
    from mlxpaged.server.cli import serve, serve_engine_config

    def flags(cmd, **given):
        out = {p.name: p.default for p in cmd.params if p.name in ENGINE_FIELDS}
        return {**out, **given}

    generate = main.commands["generate"]
    cpu = mx.default_device() == mx.cpu
    s = serve_engine_config(flags(serve), None).scheduler
    assert (s.prefill_order, s.max_num_batched_tokens) == ("shortest", 256 if cpu else 2048)
    g = EngineConfig.of(**{ENGINE_FIELDS[k]: v for k, v in flags(generate).items()}).scheduler
    assert (g.prefill_order, g.max_num_batched_tokens) == ("fcfs", 2048)
    s = serve_engine_config(flags(serve, prefill_order="fcfs", max_num_batched_tokens=1024), None).scheduler
    assert (s.prefill_order, s.max_num_batched_tokens) == ("fcfs", 1024)
