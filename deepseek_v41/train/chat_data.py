"""``dsv41 data chat``: chat fine-tuning data from the standard library's docstrings and signatures (issue 26).

Deterministic and offline: the same interpreter, seed and tokenizer give the same bytes. The source is the
``python-stdlib`` source of ``dsv41 data prepare`` (:func:`~deepseek_v41.train.sources.stdlib_source`), read
with :mod:`ast` (no module is imported). Four kinds of record (CHATFORMAT_CONTRACT.md):

- ``qa``: "What does ``module.func`` do?" in varied words -> the docstring's first sentence(s), at most
  ``MAX_ANSWER_WORDS`` words;
- ``tool``: 1-3 tool definitions (real functions; JSON-schema parameters from the signature: annotations,
  defaults and parameter names -> string / integer / number / boolean / array, required = no default), a request
  phrased from the docstring with concrete argument values -> one DSML tool call;
- ``tool_result``: the same call, a tool message with a result, then the answer in text. The functions are not
  run: the result is a value of the shape the docstring announces (``True`` / ``False`` for predicates, else
  derived from the arguments), and the answer reports it;
- ``no_tool``: tools are given but the question is a ``qa`` one, answered in text.

Each record is rendered in thinking mode or chat mode (``thinking``); in thinking mode the assistant's
``reasoning_content`` is a short plan built from the signature. The split is by top-level package
(``email.utils`` goes with ``email``): a held-out package never appears in train, tool distractors included.
Records longer than ``max_tokens`` tokens (the whole rendered conversation) are dropped.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from deepseek_v41.chat import encode_messages
from deepseek_v41.chat.tokens import RESERVED
from deepseek_v41.train.sources import stdlib_source

MAX_ANSWER_WORDS = 60
MAX_DESCRIPTION_WORDS = 16
MAX_TOOL_PARAMS = 4
KINDS = ("qa", "tool", "tool_result", "no_tool")
JSON_TYPES = ("string", "integer", "number", "boolean", "array")

# Parameter names whose JSON type is clear without an annotation or default, with value pools.
_STRING_VALUES = {
    ("path", "filename", "file", "fn", "pathname", "fname", "src", "dst", "dir", "directory", "dirname"):
        ["/tmp/report.txt", "data/config.ini", "notes.md", "/var/log/app.log", "build/output.json"],
    ("url", "uri", "href"): ["https://example.com/index.html", "http://www.python.org/doc/",
                             "https://docs.python.org/3/library/json.html"],
    ("encoding", "charset"): ["utf-8", "latin-1", "ascii"],
    ("sep", "delimiter", "separator"): [",", ";", ":", "|"],
    ("name", "key", "attr", "option", "section", "field", "module", "package", "fullname", "distribution_name",
     "category", "typ", "type"): ["timeout", "user", "HOME", "json", "color"],
    ("version",): ["3.11", "1.0.2", "2.7.18"],
    ("address", "addr", "ip"): ["192.168.0.1", "10.0.0.0/8", "::1"],
    ("reason", "str", "output", "val", "arg", "item", "codeline", "digest", "shortopts", "contents"):
        ["hello", "value", "abc", "not found", "x = 1"],
    ("text", "s", "string", "line", "msg", "message", "source", "value", "word", "body", "data", "content",
     "header", "title", "input"): ["hello world", "The quick brown fox", "  indented line\n  second line",
                                   "spam and eggs", "Hello, World!", "caf\u00e9 au lait", "a,b,c"],
    ("prefix",): ["tmp_", "log-", "test"],
    ("suffix", "ext", "extension"): [".txt", ".py", ".log"],
    ("mode",): ["r", "w", "rb"],
    ("pattern", "pat", "regex", "glob"): ["*.py", "[a-z]+", "data_*.csv", r"\d+"],
    ("host", "hostname", "server"): ["localhost", "example.com", "127.0.0.1"],
    ("fmt", "format"): ["%Y-%m-%d", "%H:%M:%S", "json"],
    ("cmd", "command"): ["ls -l", "echo hello", "python --version"],
    ("chars",): [" ", "xyz", "\t"],
}
_INT_NAMES = {"n", "size", "count", "width", "length", "num", "index", "i", "k", "maxsplit", "base", "port",
              "level", "indent", "bufsize", "offset", "start", "stop", "step", "year", "month", "day", "hour",
              "minute", "second", "tabsize", "depth", "limit", "lineno", "precision", "ndigits", "pos", "maxlen",
              "columns", "lines", "number", "code", "status", "flags", "fd", "pid", "signum", "nbytes", "cols",
              "tabwidth", "octet", "bias"}
_NUMBER_NAMES = {"a", "b", "x", "y", "timeout", "seconds", "delay", "secs", "ratio", "factor", "mu", "sigma", "alpha",
                 "beta", "lambd", "weight", "rate"}
_ARRAY_NAMES = {"args", "items", "seq", "sequence", "iterable", "elements", "values", "names", "words", "lst",
                "population", "keys", "paths", "files", "argv"}
_INT_VALUES = {"year": [1999, 2024, 2000], "month": [1, 6, 12], "day": [1, 15, 28], "hour": [0, 9, 23],
               "minute": [0, 30, 59], "second": [0, 15, 45], "port": [80, 8080, 443]}

_QA_TEMPLATES = (
    "What does `{qual}` do?",
    "What is `{name}` in the `{module}` module for?",
    "Explain `{qual}` briefly.",
    "In Python's `{module}` module, what does `{sig}` do?",
    "What is the purpose of `{qual}`?",
    "Describe what `{qual}` does.",
    "I found `{sig}` in `{module}`. What does it do?",
    "Can you tell me what `{qual}` is used for?",
)
_TOOL_TEMPLATES = (
    "Please {task}. Use {args}.",
    "Can you {task}? Arguments: {args}.",
    "I need to {task}, with {args}.",
    "{Task} for me: {args}.",
    "Use the right tool to {task} ({args}).",
)
_RESULT_TEMPLATES = (
    "The call to `{qual}` returned {result}.",
    "`{qual}` gave {result}.",
    "The result is {result}.",
    "Done: `{qual}` returned {result}.",
)


@dataclass(frozen=True)
class Param:
    """One parameter of a tool: JSON type (one of JSON_TYPES), whether required, its default (JSON value)."""

    name: str
    type: str
    required: bool
    default: Any = None


@dataclass(frozen=True)
class Function:
    """A documented function or method of the standard library, read from source.

    ``module``: dotted module name; ``name``: qualified name inside it (``Class.method`` for methods);
    ``signature``: ``name(a, b=1)`` as written; ``summary``: the docstring's first sentence(s), at most
    MAX_ANSWER_WORDS words; ``params``: the typed parameters when every required one has a JSON type (then it
    can be a tool), else None.
    """

    module: str
    name: str
    signature: str
    summary: str
    params: tuple[Param, ...] | None

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def package(self) -> str:
        return self.module.split(".")[0]

    @property
    def tool_name(self) -> str:
        """OpenAI function names allow ``[a-zA-Z0-9_-]``: dots become underscores."""
        return self.qualname.replace(".", "_")


# ------------------------------------------------------------------------------------------ reading the stdlib
def module_name(rel: str) -> str | None:
    """``email/utils.py`` -> ``email.utils``; ``json/__init__.py`` -> ``json``; None for private or ``__main__``
    modules (any part starting with ``_``)."""
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or any(p.startswith("_") for p in parts):
        return None
    return ".".join(parts)


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(\"'])")
_SIGNATURE_LINE = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?$")


def summarize(doc: str, max_words: int = MAX_ANSWER_WORDS) -> str | None:
    """The first paragraph's leading sentences, whitespace collapsed, at most ``max_words`` words (whole
    sentences; None when the first is longer, or when the paragraph is a signature line, a doctest, too short,
    or holds a chat special token)."""
    paragraph = doc.strip().split("\n\n")[0]
    if _SIGNATURE_LINE.match(paragraph.splitlines()[0].strip()) if paragraph else True:
        return None
    text = " ".join(paragraph.split())
    if ">>>" in text or any(t in text for t in RESERVED) or not text[0].isalpha():
        return None
    out: list[str] = []
    for sentence in _SENTENCE_END.split(text):
        if len(" ".join(out + [sentence]).split()) > max_words:
            break
        out.append(sentence)
    summary = " ".join(out)
    if len(summary.split()) < 4:
        return None
    return summary if summary[-1] in ".!?" else summary + "."


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _annotation_type(node: ast.expr | None) -> str | None:
    if node is None:
        return None
    base = node.value if isinstance(node, ast.Subscript) else node
    name = base.id if isinstance(base, ast.Name) else None
    return {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array"}.get(name)


def _default_type(value: Any) -> str | None:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
        return "array"
    return None


def _name_type(name: str) -> str | None:
    if name in _INT_NAMES:
        return "integer"
    if name in _NUMBER_NAMES:
        return "number"
    if name in _ARRAY_NAMES:
        return "array"
    if any(name in names for names in _STRING_VALUES):
        return "string"
    return None


def typed_params(args: ast.arguments, is_method: bool) -> tuple[Param, ...] | None:
    """The JSON-typed parameters of a signature, or None when it cannot be a tool: ``*args`` / ``**kwargs``,
    a required parameter without a JSON type, more than 3 required parameters or none at all. Optional
    parameters without a type (e.g. ``default=None`` and an unknown name) are left out of the schema; at most
    MAX_TOOL_PARAMS are kept."""
    if args.vararg or args.kwarg:
        return None
    positional = args.posonlyargs + args.args
    if is_method:
        positional = positional[1:]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    pairs = list(zip(positional, defaults, strict=True)) + list(zip(args.kwonlyargs, args.kw_defaults, strict=True))
    params = []
    for arg, default in pairs:
        if arg.arg.startswith("_"):
            return None
        ok, value = _literal(default) if default is not None else (False, None)
        kind = _annotation_type(arg.annotation) or (_default_type(value) if ok else None) or _name_type(arg.arg)
        required = default is None
        if kind is None or (ok and value is not None and _default_type(value) not in (kind, None)):
            if required:
                return None
            continue
        if ok and kind == "array" and isinstance(value, tuple):
            value = list(value)
        params.append(Param(arg.arg, kind, required, value if ok else None))
    required = [p for p in params if p.required]
    if not 1 <= len(required) <= 3:
        return None
    return tuple(required + [p for p in params if not p.required][: MAX_TOOL_PARAMS - len(required)])


def _signature(name: str, node: ast.FunctionDef, is_method: bool) -> str:
    """``name(a, b=1)`` without annotations (and without ``self``); ``name(...)`` when over 80 characters."""
    args = copy.deepcopy(node.args)
    if is_method:
        if args.posonlyargs:
            args.posonlyargs = args.posonlyargs[1:]
        elif args.args:
            args.args = args.args[1:]
    for a in args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]:
        a.annotation = None
    short = name.split(".")[-1]
    text = f"{short}({ast.unparse(args)})"
    return text if len(text) <= 80 else f"{short}(...)"


def read_functions(files: list[tuple[str, Path]]) -> list[Function]:
    """The documented public functions (and public methods of public classes) of ``files`` — (relative path,
    path) pairs as :class:`~deepseek_v41.train.sources.Source` lists them — in path order then source order.
    Files that do not parse or are not UTF-8 are skipped."""
    out: list[Function] = []
    for rel, path in sorted(files):
        module = module_name(rel)
        if module is None:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        seen: set[str] = set()
        for node in tree.body:
            candidates: list[tuple[str, ast.FunctionDef, bool]] = []
            if isinstance(node, ast.FunctionDef):
                candidates.append((node.name, node, False))
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                candidates += [(f"{node.name}.{m.name}", m, True) for m in node.body
                               if isinstance(m, ast.FunctionDef) and not m.name.startswith("_")
                               and not m.decorator_list]
            for name, fn, is_method in candidates:
                if name.split(".")[-1].startswith("_") or name in seen:
                    continue
                doc = ast.get_docstring(fn)
                summary = summarize(doc) if doc else None
                if summary is None:
                    continue
                seen.add(name)
                params = typed_params(fn.args, is_method) if not is_method else None
                out.append(Function(module, name, _signature(name, fn, is_method), summary, params))
    return out


# ------------------------------------------------------------------------------------------ records
def tool_schema(fn: Function) -> dict[str, Any]:
    """The OpenAI ``tools`` entry of a function: name, first-sentence description, JSON-schema parameters."""
    properties: dict[str, Any] = {}
    for p in fn.params or ():
        properties[p.name] = {"type": p.type, "items": {"type": "string"}} if p.type == "array" else {"type": p.type}
    description = _SENTENCE_END.split(fn.summary)[0]
    words = description.split()
    if len(words) > MAX_DESCRIPTION_WORDS:
        description = " ".join(words[:MAX_DESCRIPTION_WORDS]) + " ..."
    return {"type": "function", "function": {
        "name": fn.tool_name, "description": description,
        "parameters": {"type": "object", "properties": properties,
                       "required": [p.name for p in fn.params or () if p.required]}}}


def _pick_value(p: Param, rng: random.Random) -> Any:
    """A concrete argument: a changed default for optional parameters, else a value by name and type."""
    if not p.required and p.default is not None:
        if p.type == "boolean":
            return not p.default
        if p.type == "integer":
            return p.default + rng.choice([1, 2, 4, 8]) if p.default >= 0 else rng.choice([0, 1, 3])
        if p.type == "number":
            return round(p.default * 2 + 0.5, 2)
        if p.type == "string" and p.default:
            return p.default
    if p.type == "string":
        pool = next((v for names, v in _STRING_VALUES.items() if p.name in names), None)
        return rng.choice(pool or ["example", "hello world", "spam"])
    if p.type == "integer":
        return rng.choice(_INT_VALUES.get(p.name, [2, 3, 5, 8, 10, 16, 42]))
    if p.type == "number":
        return rng.choice([0.5, 1.5, 2.0, 3.75, 10.0])
    if p.type == "boolean":
        return rng.choice([True, False])
    return rng.choice([["alpha", "beta", "gamma"], ["spam", "eggs"], ["1", "2", "3"], ["red", "green", "blue"]])


def call_arguments(fn: Function, rng: random.Random) -> dict[str, Any]:
    """Arguments of the reference call: every required parameter, each optional one with probability 0.3."""
    return {p.name: _pick_value(p, rng) for p in fn.params or () if p.required or rng.random() < 0.3}


def _show(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False) if not isinstance(value, bool) else str(value).lower()


def _task(fn: Function) -> str:
    """The first sentence as a request: "Return the x." -> "get the x"."""
    first = _SENTENCE_END.split(fn.summary)[0].rstrip(".!?")
    words = first.split()
    if words[0] in ("Return", "Returns", "return"):
        words[0] = "get"
    elif words[0].endswith("s") and words[0][:-1] in ("Get", "Convert", "Create", "Compute", "Make", "Remove"):
        words[0] = words[0][:-1]
    words[0] = words[0][0].lower() + words[0][1:]
    return " ".join(words)


def _tool_request(fn: Function, arguments: dict[str, Any], rng: random.Random) -> str:
    args = ", ".join(f"{k} {_show(v)}" for k, v in arguments.items())
    template = rng.choice(_TOOL_TEMPLATES)
    task = _task(fn)
    return template.format(task=task, Task=task[0].upper() + task[1:], args=args)


def _tool_result(fn: Function, arguments: dict[str, Any], rng: random.Random) -> str:
    """A result of the shape the docstring announces (the function is not run)."""
    lead = fn.summary.lower()
    if lead.startswith(("return true", "return whether", "test whether", "check whether", "returns true")):
        return rng.choice(["True", "False"])
    strings = [v for v in arguments.values() if isinstance(v, str)]
    numbers = [v for v in arguments.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if strings:
        return strings[0]
    if numbers:
        return str(numbers[0] * rng.choice([1, 2, 3]))
    return rng.choice(["None", "[]", "OK"])


def _qa_question(fn: Function, rng: random.Random) -> str:
    return rng.choice(_QA_TEMPLATES).format(qual=fn.qualname, name=fn.name, module=fn.module, sig=fn.signature)


def _assistant(content: str, reasoning: str | None, calls: list[dict] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def _call(fn: Function, arguments: dict[str, Any], call_id: str | None = None) -> dict[str, Any]:
    call = {"type": "function", "function": {"name": fn.tool_name,
                                             "arguments": json.dumps(arguments, ensure_ascii=False)}}
    return {"id": call_id, **call} if call_id else call


def make_records(fn: Function, pool: list[Function], seed: int) -> list[dict[str, Any]]:
    """The records of one function: a qa record, and when it can be a tool a ``tool``, a ``tool_result`` and a
    ``no_tool`` record. ``pool``: the tool-capable functions of the same split (distractors and no_tool tools)."""
    rng = random.Random(f"{seed}:{fn.qualname}")
    records = []
    thinking = rng.random() < 0.5
    plan = f"The user asks about `{fn.name}` from the `{fn.module}` module, called as `{fn.signature}`. " \
           f"I answer from its documentation."
    records.append({"id": f"qa/{fn.qualname}", "kind": "qa", "thinking": thinking, "tools": None,
                    "messages": [{"role": "user", "content": _qa_question(fn, rng)},
                                 _assistant(fn.summary, plan if thinking else None)],
                    "reference": {"answer": fn.summary}})
    others = [f for f in pool if f.qualname != fn.qualname]
    if others and rng.random() < 0.25:
        thinking = rng.random() < 0.5
        tools = [tool_schema(f) for f in rng.sample(others, min(len(others), rng.choice([1, 1, 2])))]
        reason = f"None of the tools answers this; `{fn.qualname}` is documented, so I answer from that."
        records.append({"id": f"no_tool/{fn.qualname}/0", "kind": "no_tool", "thinking": thinking, "tools": tools,
                        "messages": [{"role": "user", "content": _qa_question(fn, rng)},
                                     _assistant(fn.summary, reason if thinking else None)],
                        "reference": {"answer": fn.summary}})
    if fn.params is None:
        return records
    for kind, n in (("tool", 0), ("tool", 1), ("tool_result", 0)):
        thinking = rng.random() < 0.5
        arguments = call_arguments(fn, rng)
        distractors = rng.sample(others, min(len(others), rng.choice([0, 1])))
        tools = [tool_schema(f) for f in distractors] + [tool_schema(fn)]
        rng.shuffle(tools)
        request = _tool_request(fn, arguments, rng)
        plan = f"The tool `{fn.tool_name}` can {_task(fn)}, so I call it with the values given."
        call_msg = _assistant("", plan if thinking else None, [_call(fn, arguments, "call_0")])
        messages: list[dict[str, Any]] = [{"role": "user", "content": request}]
        if kind == "tool":
            call_msg["tool_calls"] = [_call(fn, arguments)]
            messages.append(call_msg)
            reference: dict[str, Any] = {"name": fn.tool_name, "arguments": arguments}
        else:
            result = _tool_result(fn, arguments, rng)
            answer = rng.choice(_RESULT_TEMPLATES).format(qual=fn.qualname, result=f"`{result}`")
            messages += [call_msg, {"role": "tool", "tool_call_id": "call_0", "content": result},
                         _assistant(answer, "The tool returned; I report its result." if thinking else None)]
            reference = {"answer": answer}
        records.append({"id": f"{kind}/{fn.qualname}/{n}", "kind": kind, "thinking": thinking, "tools": tools,
                        "messages": messages, "reference": reference})
    return records


def render(record: dict[str, Any]) -> tuple[str, str]:
    """(prompt, target) of a record: the prompt renders every message but the last with the generation header;
    the target is the rest of the whole conversation's render (the last assistant message with its thinking,
    content or DSML calls and end token). Raises ValueError when the prompt is not a prefix of the whole."""
    whole = encode_messages(record["messages"], tools=record["tools"], thinking=record["thinking"])
    prompt = encode_messages(record["messages"][:-1], tools=record["tools"], thinking=record["thinking"])
    if not whole.startswith(prompt):
        raise ValueError(f"record {record['id']}: the prompt render is not a prefix of the conversation's")
    return prompt, whole[len(prompt):]


def split_packages(functions: list[Function], fraction: float, seed: int) -> set[str]:
    """The held-out top-level packages: packages ranked by sha256(seed, name) are taken in order until they hold
    at least ``fraction`` of the functions and of the tool-capable functions (so every kind is held out)."""
    ranked = sorted({f.package for f in functions}, key=lambda p: hashlib.sha256(f"{seed}:{p}".encode()).hexdigest())
    tools = [f for f in functions if f.params is not None]
    held: set[str] = set()
    for package in ranked:
        if (sum(f.package in held for f in functions) >= fraction * len(functions)
                and sum(f.package in held for f in tools) >= fraction * len(tools)):
            break
        held.add(package)
    return held


def fit(record: dict[str, Any], tok: Tokenizer, max_tokens: int) -> tuple[dict[str, Any], int, int] | None:
    """The record, its token count and its prompt's, if it fits in ``max_tokens``; else retried with only the
    tools the reference needs (tool / tool_result: the called one; no_tool: the first); None if still too long."""
    for attempt in range(2):
        prompt, target = render(record)
        # The prompt ends with a special token (<think> / </think>), so the whole tokenizes as its two halves.
        n_prompt = len(tok.encode(prompt, add_special_tokens=False).ids)
        n_all = n_prompt + len(tok.encode(target, add_special_tokens=False).ids)
        if n_all <= max_tokens:
            return record, n_all, n_prompt
        if attempt or not record["tools"] or len(record["tools"]) == 1:
            return None
        name = record["reference"].get("name") or next(
            (m["tool_calls"][0]["function"]["name"] for m in record["messages"] if m.get("tool_calls")), None)
        keep = [t for t in record["tools"] if t["function"]["name"] == name] or record["tools"][:1]
        record = {**record, "tools": keep}
    return None


def build_chat_data(out: Path, tokenizer: Path, seed: int = 0, heldout_fraction: float = 0.05,
                    max_tokens: int = 512, log: Callable[[str], None] = lambda line: None,
                    files: list[tuple[str, Path]] | None = None) -> dict[str, Any]:
    """Write ``train.jsonl``, ``heldout.jsonl`` and ``manifest.json`` into ``out`` (see the module docstring).

    tokenizer: a folder with tokenizer.json (e.g. checkpoints/v41-tiny) to measure records; longer than
    ``max_tokens`` are dropped. files: (relative path, path) pairs to read instead of the whole standard library
    (a subset of it, for tests). Returns the manifest. Raises ValueError for a fraction outside (0, 1) and when
    no documented function is found.
    """
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"--heldout-fraction must be in (0, 1), got {heldout_fraction}")
    tok = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
    if files is None:
        source = stdlib_source()
        files, origin = source.files, {"name": source.name, "origin": source.origin, "license": source.license}
    else:
        origin = {"name": "files", "origin": f"{len(files)} files given", "license": "as the files"}
    functions = read_functions(files)
    if not functions:
        raise ValueError("no documented public function found in the files read")
    log(f"{len(functions)} documented functions and methods in {len({f.module for f in functions})} modules")
    held = split_packages(functions, heldout_fraction, seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stats: dict[str, dict[str, dict[str, int]]] = {}
    digests = {}
    for split in ("train", "heldout"):
        members = [f for f in functions if (f.package in held) == (split == "heldout")]
        pool = [f for f in members if f.params is not None]
        stats[split] = {k: {"records": 0, "tokens": 0, "target_tokens": 0, "dropped": 0} for k in KINDS}
        lines = []
        for fn in members:
            for record in make_records(fn, pool, seed):
                entry = stats[split][record["kind"]]
                fitted = fit(record, tok, max_tokens)
                if fitted is None:
                    entry["dropped"] += 1
                    continue
                record, n_all, n_prompt = fitted
                entry["records"] += 1
                entry["tokens"] += n_all
                entry["target_tokens"] += n_all - n_prompt
                lines.append(json.dumps({**record, "module": fn.module}, ensure_ascii=False))
        data = ("\n".join(lines) + "\n").encode()
        (out / f"{split}.jsonl").write_bytes(data)
        digests[split] = hashlib.sha256(data).hexdigest()
        log(f"{split}: {len(lines)} records -> {out / (split + '.jsonl')}")
    manifest = {"seed": seed, "heldout_fraction": heldout_fraction, "max_tokens": max_tokens,
                "tokenizer_sha256": hashlib.sha256((Path(tokenizer) / "tokenizer.json").read_bytes()).hexdigest(),
                "source": origin,
                "heldout_packages": sorted(held), "counts": stats, "sha256": digests}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
