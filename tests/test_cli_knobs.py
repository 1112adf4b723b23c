"""`mlxpaged generate` with --json-schema and the sampling knobs, bad inputs included."""

from __future__ import annotations

import json

import jsonschema
import pytest

from drive import run

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["a", "b"]}},
    "required": ["n", "tag"],
    "additionalProperties": False,
}


def test_json_schema_flag(tiny_model_path, tmp_path):
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(SCHEMA))
    r = run(
        "--model",
        str(tiny_model_path),
        "--prompt",
        "hello",
        "--json-schema",
        str(f),
        "-n",
        "3",
        "--temp",
        "1.5",
        "--seed",
        "2",
        "-t",
        "60",
        "--json",
    )
    assert r.exit_code == 0, r.output
    outs = json.loads(r.stdout)["outputs"]
    assert len(outs) == 3
    for o in outs:
        assert o["finish_reason"] == "stop"
        jsonschema.validate(json.loads(o["text"]), SCHEMA)


def test_knob_flags(tiny_model_path):
    r = run(
        "--model",
        str(tiny_model_path),
        "--prompt",
        "hello",
        "--logit-bias",
        "37=100",
        "--min-p",
        "0.1",
        "--presence-penalty",
        "0.5",
        "--frequency-penalty",
        "0.5",
        "--repetition-penalty",
        "1.1",
        "--temp",
        "1.0",
        "-t",
        "5",
        "--ignore-eos",
        "--json",
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["outputs"][0]["token_ids"] == [37] * 5


@pytest.mark.parametrize(
    "args,message",
    [
        (["--logit-bias", "37"], "TOKEN_ID=BIAS"),
        (["--logit-bias", "x=1"], "TOKEN_ID=BIAS"),
        (["--logit-bias", "37=500"], "logit_bias values must be in [-100, 100]"),
        (["--logit-bias", "100000=1"], "outside the vocabulary"),
        (["--min-p", "2"], "min_p must be in [0, 1]"),
        (["--presence-penalty", "3"], "presence_penalty must be in [-2, 2]"),
        (["--repetition-penalty", "0"], "repetition_penalty must be > 0"),
        (["--json-schema", "/nonexistent.json"], "cannot read JSON schema file"),
        (["--json-schema", "BAD"], "invalid JSON"),
        (["--json-schema", "NOT"], 'unsupported JSON schema: Unimplemented keys: ["not"]'),
        (["--json-schema", "ARRAY"], "a JSON schema must be an object"),
        (["--beam-width", "2", "--min-p", "0.1"], "--min-p cannot be used with --beam-width"),
    ],
)
def test_bad_knobs_one_line_error(tiny_model_path, tmp_path, args, message):
    files = {"BAD": "{not json", "NOT": json.dumps({"not": {"type": "string"}}), "ARRAY": "[1, 2]"}
    if args[-1] in files:
        f = tmp_path / "s.json"
        f.write_text(files[args[-1]])
        args = [*args[:-1], str(f)]
    r = run("--model", str(tiny_model_path), "--prompt", "hi", *args)
    assert r.exit_code == 1
    assert "Traceback" not in r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], r.stderr


def test_prompts_file_guided_field(tiny_model_path, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps({"prompt": "hi", "temperature": 1.5, "seed": 1, "max_tokens": 60, "guided": {"json_schema": SCHEMA}})
        + "\n"
        + json.dumps({"prompt": "yo", "max_tokens": 4})
        + "\n"
    )
    r = run("--model", str(tiny_model_path), "--prompts-file", str(f), "--json")
    assert r.exit_code == 0, r.output
    outs = json.loads(r.stdout)["outputs"]
    jsonschema.validate(json.loads(outs[0]["text"]), SCHEMA)
    assert outs[0]["finish_reason"] == "stop" and len(outs[1]["token_ids"]) <= 4
    f.write_text(json.dumps({"prompt": "hi", "guided": {"json_object": True, "grammar": 'start: "a"'}}) + "\n")
    r = run("--model", str(tiny_model_path), "--prompts-file", str(f))
    assert r.exit_code == 1 and 'bad "guided"' in r.stderr and "exactly one" in r.stderr
