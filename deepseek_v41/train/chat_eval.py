"""``dsv41 eval-chat``: a checkpoint on the held-out split of the chat data (issue 26; CHATFORMAT_CONTRACT).

Each record (one JSONL line: ``id``, ``kind``, ``thinking``, ``tools``, ``messages``, ``reference``) is answered by
greedy decoding of at most ``max_tokens`` tokens through :meth:`deepseek_v41.engine.LLM.chat`: the prompt is every
message but the last (the assistant target), rendered by the official encoder with the generation prompt, the
record's tools and its thinking mode. The answer is parsed by the project's parser into an OpenAI message
(:func:`deepseek_v41.chat.assistant_message`) and scored against ``reference``:

- ``qa``, ``tool_result``, ``no_tool`` (reference ``{"answer": text}``): overlap of the answer's ``content`` with the
  reference, as ROUGE-L F1 (:func:`rouge_l_f1`) and token F1 (:func:`token_f1`) over lowercase word tokens
  (:func:`words`), under ``tool_choice`` "auto" (plain chat when the record has no tools). For ``no_tool`` also
  the share answered in text, with no tool call.
- ``tool`` (reference ``{"name", "arguments"}``): three times: with no grammar at all (``FREE``: the tools rendered
  as "auto" renders them, the model alone), under ``tool_choice`` "auto" (free text, but a tool block the model
  opens is held to the grammar of the given tools from its opening on) and constrained ("required": the DSML
  grammar of :mod:`deepseek_v41.structured.dsml_grammar` from the first token). Per answer (:func:`score_call`):
  *valid* = the model ended the answer (finish reason "stop") with at least one tool call, every call names a
  given tool and its ``arguments`` are a JSON object valid under that tool's ``parameters`` schema
  (:func:`deepseek_v41.structured.schema_check.schema_errors`, which knows no grammar); *right function* = the
  first call's name is the reference name; *exact arguments* = that, and its arguments equal the reference's.
  *cut* = the answer ran into ``max_tokens`` (a constrained call can: the grammar fixes the form, not the length).

Constrained answers that ended must all be valid: :func:`evaluate_chat` raises :class:`ConstrainedCallError` naming
the record otherwise (the grammar's guarantee, checked by an oracle independent of it). Cut answers are counted
apart and are not valid.

Rates are fractions of the records of that kind (or mode) evaluated; every rate comes with its count ``n``.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from deepseek_v41.chat import assistant_message, encode_messages
from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.progress import ProgressCallback
from deepseek_v41.structured.schema_check import schema_errors

KINDS = ("qa", "tool", "tool_result", "no_tool")
ANSWER_KINDS = ("qa", "tool_result", "no_tool")
MAX_TOKENS = 320  # greedy budget per answer: room for a short answer or one tool call with its arguments
_WORD = re.compile(r"\w+")


class ChatEvalError(ValueError):
    """A held-out file or record this evaluation cannot read; the message names the line and the field."""


class ConstrainedCallError(RuntimeError):
    """A constrained (``tool_choice`` "required") answer that ended but is not a valid call: the grammar broke its
    guarantee."""


# ---------------------------------------------------------------------------------------------- metrics
FREE = "free"  # tool records answered with the tools rendered and no grammar at all


def words(text: str) -> list[str]:
    """Lowercase word tokens of ``text``: maximal runs of Unicode letters, digits and ``_`` (``\\w+``)."""
    return _WORD.findall(text.lower())


def token_f1(prediction: str, reference: str) -> float:
    """Token F1 of ``prediction`` against ``reference`` over :func:`words` as multisets (SQuAD's answer F1): with
    ``c`` the shared tokens counted with multiplicity, ``P = c / |prediction|``, ``R = c / |reference|``,
    ``F1 = 2PR / (P + R)``; 0 when nothing is shared, 1.0 when both have no words."""
    pred, ref = words(prediction), words(reference)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of two token lists (O(len(a) * len(b)) time, O(len(b)) memory)."""
    if len(b) > len(a):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0  # row[j - 1] of the previous row
        for j, y in enumerate(b, 1):
            above = row[j]
            row[j] = diagonal + 1 if x == y else max(row[j - 1], above)
            diagonal = above
    return row[-1]


def rouge_l_f1(prediction: str, reference: str) -> float:
    """ROUGE-L F1 (Lin 2004, with beta = 1) of ``prediction`` against ``reference`` over :func:`words`: with ``l``
    the longest common subsequence, ``P = l / |prediction|``, ``R = l / |reference|``, ``F1 = 2PR / (P + R)``; 0
    when nothing is shared, 1.0 when both have no words."""
    pred, ref = words(prediction), words(reference)
    if not pred or not ref:
        return float(pred == ref)
    common = lcs_length(pred, ref)
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def score_call(message: dict[str, Any], finish_reason: str | None, tools: list[dict[str, Any]] | None,
               reference: dict[str, Any]) -> dict[str, Any]:
    """The tool-call scores of one answer (see the module docstring): ``{"called", "valid", "right_function",
    "exact_arguments", "cut"}`` (bools) and ``"why"``: "" for a valid call, else the first reason it is not.

    message: the OpenAI assistant message (``tool_calls`` with JSON ``arguments``); finish_reason: the engine's;
    tools: the record's tools; reference: ``{"name": str, "arguments": dict}``."""
    calls = message.get("tool_calls") or []
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []}
    cut = finish_reason == "length"
    why = "cut at max_tokens" if cut else "" if finish_reason == "stop" else f"finish reason {finish_reason!r}"
    parsed = []
    for call in calls:
        name, text = call["function"]["name"], call["function"]["arguments"]
        try:
            arguments = json.loads(text)
        except ValueError:
            arguments = None
        parsed.append((name, arguments))
        if why:
            continue
        if name not in schemas:
            why = f"calls {name!r}, not one of the tools {sorted(schemas)}"
        elif not isinstance(arguments, dict):
            why = f"arguments of {name!r} are not a JSON object: {text[:80]!r}"
        else:
            problems = schema_errors(arguments, schemas[name])
            if problems:
                why = f"arguments of {name!r} break its schema: {problems[0]}"
    if not calls and not why:
        why = "no tool call"
    right = bool(parsed) and parsed[0][0] == reference["name"]
    return {"called": bool(calls), "valid": not why, "right_function": right,
            "exact_arguments": right and parsed[0][1] == reference["arguments"], "cut": cut, "why": why}


# ---------------------------------------------------------------------------------------------- records
def read_records(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The first ``limit`` (all when None) records of a held-out JSONL file, checked: each has a unique ``id``, a
    ``kind`` of :data:`KINDS`, a bool ``thinking``, ``tools`` (None or a list), ``messages`` ending with the
    assistant target, and the ``reference`` its kind needs. Raises ChatEvalError naming the line and the field,
    FileNotFoundError for a missing file."""
    if limit is not None and limit < 1:
        raise ChatEvalError(f"limit must be at least 1, got {limit}")
    records, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ChatEvalError(f"{where}: not JSON ({exc})") from exc
            _check_record(record, where)
            if record["id"] in seen:
                raise ChatEvalError(f"{where}: id {record['id']!r} appears twice")
            seen.add(record["id"])
            records.append(record)
    if not records:
        raise ChatEvalError(f"{path}: no records")
    return records


def _check_record(record: Any, where: str) -> None:
    if not isinstance(record, dict):
        raise ChatEvalError(f"{where}: a record is a JSON object, got {type(record).__name__}")
    missing = [k for k in ("id", "kind", "thinking", "tools", "messages", "reference") if k not in record]
    if missing:
        raise ChatEvalError(f"{where}: missing {missing} (a record has id, kind, thinking, tools, messages, "
                            "reference)")
    if record["kind"] not in KINDS:
        raise ChatEvalError(f"{where}: kind {record['kind']!r} is not one of {KINDS}")
    if not isinstance(record["thinking"], bool):
        raise ChatEvalError(f"{where}: thinking must be true or false, got {record['thinking']!r}")
    if record["tools"] is not None and not isinstance(record["tools"], list):
        raise ChatEvalError(f"{where}: tools must be null or a list of tools")
    messages = record["messages"]
    if not isinstance(messages, list) or len(messages) < 2 or not isinstance(messages[-1], dict) or \
            messages[-1].get("role") != "assistant":
        raise ChatEvalError(f"{where}: messages must hold the prompt then the assistant target (last)")
    reference = record["reference"]
    if record["kind"] == "tool":
        if not isinstance(reference, dict) or not isinstance(reference.get("name"), str) or \
                not isinstance(reference.get("arguments"), dict):
            raise ChatEvalError(f"{where}: a tool record's reference is {{\"name\": str, \"arguments\": {{...}}}}")
        if not record["tools"]:
            raise ChatEvalError(f"{where}: a tool record needs tools")
    elif not isinstance(reference, dict) or not isinstance(reference.get("answer"), str):
        raise ChatEvalError(f"{where}: a {record['kind']} record's reference is {{\"answer\": str}}")


# ---------------------------------------------------------------------------------------------- evaluation
def _generate(llm: LLM, jobs: list[tuple[dict[str, Any], str]], params: SamplingParams,
              batch_size: int) -> Iterable[tuple[dict[str, Any], str, Any]]:
    """(record, tool_choice, CompletionOutput) for each job, batching records that share tools and thinking mode
    (``LLM.chat`` takes one ``tools`` list per call), in order within each group. Tools are the same when their
    JSON is, key order included: the order is part of the rendered prompt (CHAT_FORMAT.md §3(c))."""
    groups: dict[tuple[str, bool, str], list[dict[str, Any]]] = {}
    for record, choice in jobs:
        groups.setdefault((json.dumps(record["tools"]), record["thinking"], choice), []).append(record)
    for (_, thinking, choice), records in groups.items():
        for start in range(0, len(records), batch_size):
            batch = records[start:start + batch_size]
            tools = batch[0]["tools"]
            if choice == FREE:
                yield from _generate_free(llm, batch, params, thinking)
                continue
            outputs = llm.chat([r["messages"][:-1] for r in batch], params, tools=tools,
                               tool_choice=choice if tools else None, thinking=thinking, use_tqdm=False)
            for record, output in zip(batch, outputs, strict=True):
                yield record, choice, output.outputs[0]


def _generate_free(llm: LLM, batch: list[dict[str, Any]], params: SamplingParams,
                   thinking: bool) -> Iterable[tuple[dict[str, Any], str, Any]]:
    """The ``FREE`` mode: the tools rendered into the prompt as "auto" renders them, but no grammar at all (not even
    once a tool block opens), so the rates measure the model alone; the message is parsed as the server parses."""
    prompts = [encode_messages(r["messages"][:-1], tools=r["tools"], thinking=thinking) for r in batch]
    outputs = llm.generate(prompts, params, use_tqdm=False, add_special_tokens=False)
    for record, output in zip(batch, outputs, strict=True):
        completion = output.outputs[0]
        text = llm.get_tokenizer().decode(completion.token_ids, skip_special_tokens=False)
        completion.message = assistant_message(text, thinking, tools_active=True)
        yield record, FREE, completion


def _fits(llm: LLM, record: dict[str, Any], max_tokens: int) -> bool:
    """Whether the record's prompt plus ``max_tokens`` fits the engine's ``max_model_len``."""
    prompt = encode_messages(record["messages"][:-1], tools=record["tools"], thinking=record["thinking"])
    tokens = len(llm.get_tokenizer().encode(prompt, add_special_tokens=False).ids)
    return tokens + max_tokens <= llm.engine.max_model_len


def evaluate_chat(llm: LLM, records: list[dict[str, Any]], max_tokens: int = MAX_TOKENS, batch_size: int = 8,
                  progress: ProgressCallback | None = None, log: Callable[[str], None] | None = None,
                  log_every: int = 25, check: bool = True) -> dict[str, Any]:
    """Answer and score ``records`` (from :func:`read_records`) with ``llm``; the report (see :func:`summarize`).

    Records whose prompt plus ``max_tokens`` exceed the engine's ``max_model_len`` are skipped and counted.
    ``progress(done, total, what)`` is called with the answers done; ``log`` gets a line of running metrics every
    ``log_every`` answers. With ``check`` (default) raises ConstrainedCallError for a constrained answer that
    ended and is not valid (:func:`check_constrained`)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    kept = [r for r in records if _fits(llm, r, max_tokens)]
    jobs = [(r, "auto") for r in kept] + [(r, mode) for mode in (FREE, "required") for r in kept
                                           if r["kind"] == "tool"]
    results: dict[str, dict[str, Any]] = {r["id"]: {"id": r["id"], "kind": r["kind"], "thinking": r["thinking"]}
                                          for r in kept}
    start = time.perf_counter()
    if progress is not None:
        progress(0, len(jobs), "")
    for done, (record, choice, completion) in enumerate(_generate(llm, jobs, params, batch_size), 1):
        result = results[record["id"]]
        message = completion.message
        entry = {"finish_reason": completion.finish_reason, "tokens": len(completion.token_ids),
                 "content": message.get("content") or "", "tool_calls": message.get("tool_calls", [])}
        if record["kind"] == "tool":
            entry.update(score_call(message, completion.finish_reason, record["tools"], record["reference"]))
        else:
            answer = entry["content"]
            entry["rouge_l_f1"] = rouge_l_f1(answer, record["reference"]["answer"])
            entry["token_f1"] = token_f1(answer, record["reference"]["answer"])
            entry["answered_in_text"] = not entry["tool_calls"]
        result[choice] = entry
        if progress is not None:
            progress(done, len(jobs), record["id"])
        if log is not None and (done % log_every == 0 or done == len(jobs)):
            log(f"eval-chat: {done}/{len(jobs)} answers, {time.perf_counter() - start:.0f} s; "
                f"{_running(list(results.values()))}")
    report = summarize(list(results.values()))
    report["skipped_too_long"] = len(records) - len(kept)
    report["max_tokens"] = max_tokens
    report["seconds"] = round(time.perf_counter() - start, 1)
    if check:
        check_constrained(report)
    return report


def _rate(entries: list[dict[str, Any]], key: str) -> float:
    return sum(bool(e[key]) for e in entries) / len(entries) if entries else math.nan


def _mean(entries: list[dict[str, Any]], key: str) -> float:
    return sum(e[key] for e in entries) / len(entries) if entries else math.nan


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The report of per-record results: ``counts`` per kind; ``answers`` per answer kind (and ``all``) with ``n``,
    ``rouge_l_f1`` and ``token_f1`` (means); ``tool_calls`` per mode ("auto", "required") with ``n`` and the rates
    ``called``, ``valid``, ``right_function``, ``exact_arguments``, ``cut``; ``no_tool`` with ``n`` and
    ``answered_in_text``; ``records``: the per-record results. NaN where a group is empty."""
    counts = Counter(r["kind"] for r in results)
    answers = {}
    for kind in (*ANSWER_KINDS, "all"):
        entries = [r["auto"] for r in results if "auto" in r and r["kind"] != "tool" and kind in (r["kind"], "all")]
        answers[kind] = {"n": len(entries), "rouge_l_f1": _mean(entries, "rouge_l_f1"),
                         "token_f1": _mean(entries, "token_f1")}
    calls = {}
    for mode in (FREE, "auto", "required"):
        entries = [r[mode] for r in results if r["kind"] == "tool" and mode in r]
        calls[mode] = {"n": len(entries), **{k: _rate(entries, k) for k in
                                             ("called", "valid", "right_function", "exact_arguments", "cut")}}
    no_tool = [r["auto"] for r in results if r["kind"] == "no_tool" and "auto" in r]
    return {"counts": {k: counts.get(k, 0) for k in KINDS}, "answers": answers, "tool_calls": calls,
            "no_tool": {"n": len(no_tool), "answered_in_text": _rate(no_tool, "answered_in_text")},
            "records": results}


def _running(results: list[dict[str, Any]]) -> str:
    """One line of the metrics so far."""
    report = summarize([r for r in results if any(mode in r for mode in ("auto", FREE, "required"))])
    a, calls = report["answers"]["all"], report["tool_calls"]
    parts = [f"{mode} n={calls[mode]['n']} valid {calls[mode]['valid']:.2f} right "
             f"{calls[mode]['right_function']:.2f}" for mode in (FREE, "auto", "required")]
    return (f"answers n={a['n']} ROUGE-L {a['rouge_l_f1']:.3f} token F1 {a['token_f1']:.3f}; tool calls "
            f"{', '.join(parts)} cut {calls['required']['cut']:.2f}")


def check_constrained(report: dict[str, Any]) -> None:
    """Raise ConstrainedCallError unless every constrained answer of ``report`` that ended is a valid call."""
    for result in report["records"]:
        entry = result.get("required")
        if entry is not None and not entry["cut"] and not entry["valid"]:
            raise ConstrainedCallError(f"record {result['id']!r}: the constrained answer ended but is not a valid "
                                       f"call ({entry['why']})")


def eval_chat_command(model: Path, data: Path, limit: int | None = None, out: Path | None = None,
                      max_tokens: int = MAX_TOKENS, batch_size: int = 8, max_model_len: int = 4096,
                      dtype: str = "float32", device: str = "cpu", threads: int | None = None,
                      progress: ProgressCallback | None = None, log: Callable[[str], None] | None = None,
                      log_every: int = 25) -> dict[str, Any]:
    """Load ``model``, evaluate the first ``limit`` records of ``data`` and write the report to ``out`` (JSON; NaN
    as null) when given (before the check). ``threads``: torch threads (1 on a busy machine). Raises
    ChatEvalError for a bad file, ConstrainedCallError as :func:`check_constrained`."""
    if threads:
        torch.set_num_threads(threads)
    records = read_records(data, limit)
    llm = LLM(model, dtype=dtype, device=device, max_model_len=max_model_len, max_num_seqs=batch_size)
    report = {"model": str(model), "data": str(data), "limit": limit,
              **evaluate_chat(llm, records, max_tokens, batch_size, progress=progress, log=log, log_every=log_every,
                             check=False)}
    if out is not None:  # written before the check, so that a failing record can be read there
        Path(out).write_text(json.dumps(json_safe(report), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    check_constrained(report)
    return report


def json_safe(value: Any) -> Any:
    """``value`` (a report) with NaN floats as None: JSON has no NaN."""
    if isinstance(value, float):
        return None if math.isnan(value) else value
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------- model card
def _cell(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def card_tables(reports: dict[str, dict[str, Any]]) -> str:
    """The model card's Markdown tables comparing checkpoints on the held-out chat split: ``reports`` maps a
    checkpoint's name (e.g. "v41-tiny", "v41-tiny-chat") to its :func:`evaluate_chat` report (as written, NaN
    as null). Answer quality per kind, tool-call rates unconstrained and constrained, no-tool answers in text."""
    lines = ["### Chat answers (held-out, greedy)", "",
             "| checkpoint | kind | records | ROUGE-L F1 | token F1 |", "|---|---|---|---|---|"]
    for name, report in reports.items():
        for kind in (*ANSWER_KINDS, "all"):
            a = report["answers"][kind]
            lines.append(f"| {name} | {kind} | {a['n']} | {_cell(a['rouge_l_f1'])} | {_cell(a['token_f1'])} |")
    lines += ["", "### Tool calls (held-out `tool` records, greedy)", "",
              "| checkpoint | tool_choice | records | valid | right function | exact arguments | cut at max_tokens |",
              "|---|---|---|---|---|---|---|"]
    for name, report in reports.items():
        for mode, label in ((FREE, "auto, no grammar (the model alone)"),
                            ("auto", "auto (grammar once a call opens)"), ("required", "required (constrained)")):
            c = report["tool_calls"].get(mode)
            if c is None:  # a report written before the FREE mode existed
                continue
            lines.append(f"| {name} | {label} | {c['n']} | {_cell(c['valid'], 2)} | {_cell(c['right_function'], 2)} "
                         f"| {_cell(c['exact_arguments'], 2)} | {_cell(c['cut'], 2)} |")
    lines += ["", "### Tools given, no call needed (held-out `no_tool` records, tool_choice auto)", "",
              "| checkpoint | records | answered in text |", "|---|---|---|"]
    for name, report in reports.items():
        n = report["no_tool"]
        lines.append(f"| {name} | {n['n']} | {_cell(n['answered_in_text'], 2)} |")
    budgets = sorted({r.get("max_tokens") for r in reports.values()} - {None})
    lines += ["", f"Greedy decoding, at most {', '.join(map(str, budgets)) or '?'} tokens per answer; valid = the "
              "answer ended with calls of the given tools whose arguments are JSON valid under the tool's schema; "
              "a constrained call cut at max_tokens is not valid (`dsv41 eval-chat`).", ""]
    return "\n".join(lines)
