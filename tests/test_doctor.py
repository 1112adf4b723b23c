"""`mlxpaged doctor`: the report on this machine (kernels in the emulator) and a failed check."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mlxpaged.attention import metal
from mlxpaged.cli.main import main


def _doctor(tmp_path, *args):
    """`mlxpaged doctor ARGS` in this process with the emulator as a user gets it: (result, JSON report)."""
    out = tmp_path / "report.json"
    r = CliRunner().invoke(main, ["doctor", "--out", str(out), *args])
    return r, (json.loads(out.read_text()) if out.stat().st_size else None)


def test_doctor_reports_and_writes_json(tmp_path, monkeypatch):
    """The whole report on one shape family (6 kernel checks): what a user gets from the defaults
    but the full kernel matrix, which the next test runs."""
    monkeypatch.delenv("MLXPAGED_METAL", raising=False)
    metal.reset_kernels()
    r, report = _doctor(tmp_path, "--family", "7x64")
    assert r.exit_code == 0, r.output
    assert "kernels run on: MSL emulator (CPU)" in r.output
    assert report["mlx_version"]
    assert report["kernel_table"]["kind"] == "emulator"
    assert len(report["checks"]) == 6 and all(c["ok"] for c in report["checks"])
    assert "kernel checks: 6/6 passed" in r.output
    # The prefill kernel is checked too, for every dtype the decode kernels are.
    families = {
        k: {(c["dtype"], c["group"], c["head_dim"]) for c in report["checks"] if c["kernel"] == k}
        for k in ("decode", "varlen")
    }
    assert families["decode"] == families["varlen"] == {(dt, 7, 64) for dt in ("float16", "bfloat16", "float32")}
    row = report["kernel_table"]["rows"][0]
    assert 1.0 <= row["ratio"] <= 1.05 and row["max_error"] < 1e-3
    assert {c["model"] for c in report["kernel_table"]["cost_model"]} == {"Qwen2.5-0.5B", "Qwen2.5-7B"}
    plan = report["split_planning"]  # no Metal here: the documented default core count
    assert plan["gpu_cores"] == metal.DEFAULT_GPU_CORES and not plan["from_device_info"]
    parts = plan["partition_tokens_one_sequence"]
    assert parts["float16"]["1024"] > 0 and parts["4-bit"]["1024"] == 0  # 4-bit rows: too short
    assert 0 < parts["4-bit"]["32768"] <= metal.LONG_PARTITION_TOKENS
    assert "split planning: 10 GPU cores (default: no device info)" in r.output
    # An MLA model's 576-wide latent rows exceed the kernels' head_dim bound (256): named, one line.
    assert "latent attention (MLA, rows of 576) runs the reference path: head_dim 576" in r.output


# Every kernel variant the doctor knows, in the emulator: a few minutes on a quiet 2-core machine
# whose emulator cache is cold (the limit: a quiet machine's, stretched for a busy one).
@pytest.mark.timeout(900)
def test_doctor_full_kernel_matrix(tmp_path, monkeypatch):
    """The defaults: every family in every dtype, decode and prefill (varlen) kernels, 18 checks."""
    monkeypatch.delenv("MLXPAGED_METAL", raising=False)
    monkeypatch.setattr("mlxpaged.cli.doctor._table", lambda *a: {"kind": "emulator", "note": "", "rows": []})
    metal.reset_kernels()
    r, report = _doctor(tmp_path)
    assert r.exit_code == 0, r.output
    assert len(report["checks"]) == 18 and all(c["ok"] for c in report["checks"])
    assert "kernel checks: 18/18 passed" in r.output
    families = {
        k: {(c["dtype"], c["group"], c["head_dim"]) for c in report["checks"] if c["kernel"] == k}
        for k in ("decode", "varlen")
    }
    assert (
        families["decode"]
        == families["varlen"]
        == {(dt, g, hd) for dt in ("float16", "bfloat16", "float32") for g, hd in ((7, 64), (6, 128), (7, 128))}
    )


def _doctor_with_faulty(kind: str, tmp_path, monkeypatch):
    """`mlxpaged doctor` where kernel kind `kind` fails to compile: (CLI result, JSON report).
    One shape family in every dtype (6 checks, 3 of each kernel), for CPU time: the full matrix
    runs above, and which checks run does not change how a failed one is reported."""
    from kernel_cases import FaultyFactory

    factory = FaultyFactory(kind, "compile")
    monkeypatch.setattr(metal, "_metal_kernel_factory", lambda: factory)
    monkeypatch.delenv("MLXPAGED_METAL", raising=False)
    monkeypatch.setattr("mlxpaged.cli.doctor._table", lambda *a: {"kind": "emulator", "note": "", "rows": []})
    metal.reset_kernels()
    try:
        return _doctor(tmp_path, "--family", "7x64")
    finally:
        metal.reset_kernels()


def test_doctor_names_a_failing_variant(tmp_path, monkeypatch):
    r, report = _doctor_with_faulty("paged_attention_partitioned", tmp_path, monkeypatch)
    assert r.exit_code == 1
    assert "kernel checks: 3/6 passed" in r.output  # the varlen kernels still pass
    assert {c["kernel"] for c in report["checks"] if c["ok"]} == {"varlen"}
    assert "FAILED decode float16 hd64_bs16_g7_nsg8" in r.output and "simulated compiler failure" in r.output
    # The compiler's own text, first lines kept, not just the first one.
    assert "      kernel.metal:13:1: note: second line of the diagnostics" in r.output
    assert "second line of the diagnostics" in report["checks"][0]["error"]


def test_doctor_names_a_failing_varlen_kernel(tmp_path, monkeypatch):
    # A Mac whose compiler rejects only the prefill (varlen) kernel: the engine still decodes
    # with the kernel but prefills on the reference path, and the report must say which.
    r, report = _doctor_with_faulty("paged_attention_varlen", tmp_path, monkeypatch)
    assert r.exit_code == 1
    assert "kernel checks: 3/6 passed" in r.output
    assert "FAILED varlen float16 hd64_bs16_g7_tq16_kc32_nsg8_hs2" in r.output
    failed = [c for c in report["checks"] if not c["ok"]]
    assert {c["kernel"] for c in failed} == {"varlen"} and len(failed) == 3
    assert all("second line of the diagnostics" in c["error"] for c in failed)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--seqs", "0"], "--seqs and --tokens must be positive"),
        (["--family", "7by64"], "--family takes GROUPxHEAD_DIM"),
        (["--family", "0x64"], "--family takes GROUPxHEAD_DIM"),
    ],
)
def test_doctor_rejects_bad_options(args, message):
    r = CliRunner().invoke(main, ["doctor", *args])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], r.output
