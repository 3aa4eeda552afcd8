"""``dsv41 data chat`` (issue 26): deterministic chat records from real docstrings, split by package, every tool
call rendered in DSML parses back to its reference and validates against its tool's schema."""

import ast
import json
import sysconfig
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from typer.testing import CliRunner

from deepseek_v41.chat import parse_output
from deepseek_v41.cli.main import app
from deepseek_v41.train.chat_data import KINDS, build_chat_data, read_functions, render, typed_params
from tests.schema_oracle import errors

MODEL = Path(__file__).parents[2] / "checkpoints" / "v41-tiny"
# A slice of the standard library with tool-capable functions in several packages (fast to read).
PACKAGES = ("textwrap", "shlex", "fnmatch", "base64", "colorsys", "html", "keyword", "bisect", "glob", "heapq")


def stdlib_slice() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / f"{p}.py" for p in PACKAGES if (root / f"{p}.py").is_file()]
    files += [f for p in PACKAGES if (root / p).is_dir() for f in (root / p).rglob("*.py")]
    return sorted((f.relative_to(root).as_posix(), f) for f in files)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("chat")
    manifest = build_chat_data(out / "a", MODEL, seed=0, heldout_fraction=0.2, files=stdlib_slice())
    return out, manifest


def test_same_seed_same_bytes_other_seed_other_bytes(built):
    out, _ = built
    build_chat_data(out / "b", MODEL, seed=0, heldout_fraction=0.2, files=stdlib_slice())
    for name in ("train.jsonl", "heldout.jsonl", "manifest.json"):
        assert (out / "a" / name).read_bytes() == (out / "b" / name).read_bytes()
    two = [f for f in stdlib_slice() if f[0] in ("textwrap.py", "shlex.py")]
    for seed in (0, 1):
        build_chat_data(out / f"seed{seed}", MODEL, seed=seed, heldout_fraction=0.2, files=two)
    assert (out / "seed0" / "train.jsonl").read_bytes() != (out / "seed1" / "train.jsonl").read_bytes()


def test_split_by_package_without_leak(built):
    out, manifest = built
    train, heldout = read_jsonl(out / "a" / "train.jsonl"), read_jsonl(out / "a" / "heldout.jsonl")
    assert train and heldout
    held = set(manifest["heldout_packages"])
    assert {r["module"].split(".")[0] for r in heldout} <= held
    assert not {r["module"].split(".")[0] for r in train} & held
    for records, inside in ((train, False), (heldout, True)):
        for r in records:  # tool definitions (distractors too) come from the record's own split
            for tool in r["tools"] or ():
                package = tool["function"]["name"].split("_")[0]
                assert (package in held) == inside, (r["id"], package)
    ids = [r["id"] for r in train + heldout]
    assert len(ids) == len(set(ids))
    counts = manifest["counts"]
    for split, records in (("train", train), ("heldout", heldout)):
        assert sum(c["records"] for c in counts[split].values()) == len(records)


def test_every_record_renders_and_every_call_parses_back(built):
    out, manifest = built
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    records = read_jsonl(out / "a" / "train.jsonl") + read_jsonl(out / "a" / "heldout.jsonl")
    assert {r["kind"] for r in records} == set(KINDS)
    assert {r["thinking"] for r in records} == {True, False}
    for r in records:
        assert r["messages"][-1]["role"] == "assistant"
        prompt, target = render(r)
        assert len(tok.encode(prompt + target, add_special_tokens=False).ids) <= manifest["max_tokens"]
        parsed = parse_output(target, thinking=r["thinking"])
        if r["kind"] == "tool":
            assert len(parsed["tool_calls"]) == 1, r["id"]
            call = parsed["tool_calls"][0]["function"]
            assert call["name"] == r["reference"]["name"]
            arguments = json.loads(call["arguments"])
            assert arguments == r["reference"]["arguments"]
            schema = next(t["function"]["parameters"] for t in r["tools"] if t["function"]["name"] == call["name"])
            assert errors(arguments, schema) == [], r["id"]
            assert set(schema["required"]) <= set(arguments)
            assert all(v["type"] in ("string", "integer", "number", "boolean", "array")
                       for v in schema["properties"].values())
        else:
            assert parsed["tool_calls"] == [] and parsed["content"] == r["reference"]["answer"], r["id"]
        if r["kind"] == "tool_result":
            calls = [m for m in r["messages"] if m.get("tool_calls")]
            assert len(calls) == 1 and r["messages"][-2]["role"] == "tool"


def test_answers_are_the_functions_own_docstrings(built):
    """The reference answer of a qa record is text of that function's docstring, read here independently."""
    out, _ = built
    docs = {}
    for rel, path in stdlib_slice():
        module = rel[:-3].replace("/__init__", "").replace("/", ".")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                for m in node.body:
                    if isinstance(m, ast.FunctionDef) and ast.get_docstring(m):
                        docs[f"{module}.{node.name}.{m.name}"] = " ".join(ast.get_docstring(m).split())
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                docs.setdefault(f"{module}.{node.name}", " ".join(ast.get_docstring(node).split()))
    qa = [r for r in read_jsonl(out / "a" / "train.jsonl") if r["kind"] == "qa"]
    assert len(qa) > 30
    for r in qa:
        answer = r["reference"]["answer"]
        assert answer.rstrip(".") in docs[r["id"].removeprefix("qa/")], r["id"]
        assert 4 <= len(answer.split()) <= 60


def test_parameter_types_from_annotations_defaults_and_names():
    fn = ast.parse("def f(text, width: int, sep=',', *, strict=False, items=(1, 2), other=None): pass").body[0]
    params = {p.name: (p.type, p.required) for p in typed_params(fn.args, is_method=False)}
    assert params == {"text": ("string", True), "width": ("integer", True), "sep": ("string", False),
                      "strict": ("boolean", False)}  # at most 4; `other` has no type and is optional: left out
    assert typed_params(ast.parse("def g(obj, n=1): pass").body[0].args, False) is None  # untyped required
    assert typed_params(ast.parse("def h(*args): pass").body[0].args, False) is None


def test_read_functions_skips_private_and_undocumented(tmp_path):
    (tmp_path / "mod.py").write_text('def a(x):\n    "Add one to x and return the result."\n\n'
                                     'def _b(x):\n    "Private helper that is left out."\n\n'
                                     'def c(x):\n    pass\n\n'
                                     'class K:\n    def m(self, s):\n        "Return s with its case swapped."\n',
                                     encoding="utf-8")
    found = read_functions([("mod.py", tmp_path / "mod.py")])
    assert [(f.qualname, f.params is not None) for f in found] == [("mod.a", True), ("mod.K.m", False)]


def test_cli_rejects_a_bad_fraction(tmp_path):
    result = CliRunner().invoke(app, ["data", "chat", "--out", str(tmp_path), "--heldout-fraction", "1.5"])
    assert result.exit_code == 2 and "heldout-fraction" in result.output
