"""``POST /v1/completions``: raw prompts (text or token ids) -> the engine -> OpenAI text completions or SSE.

``prompt`` takes OpenAI's four forms: a string, a list of strings, a list of token ids, a list of token-id lists.
Several prompts are submitted together (they share engine steps) and run concurrently; choice ``index`` is
``prompt_index * n + sample_index``. Token-id prompts work on a model without a tokenizer (the text is then empty:
use ``return_token_ids``). ``echo`` puts the prompt text in front; ``best_of`` must equal ``n`` (no server-side
reranking); ``suffix`` is refused. ``response_format``, ``structured_outputs`` and ``guided_*`` constrain every
choice (:mod:`deepseek_v41.server.structured`). Source: the OpenAI completions API; vLLM ``serving_completion.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from deepseek_v41.engine.async_engine import EngineDeadError, EngineDrainingError, StepOutput
from deepseek_v41.server.common import (
    ServerState,
    check_common,
    check_prompt_ids,
    completion_logprobs,
    merged,
    request_ids,
    request_salt,
    sampling_params,
    start_all,
    start_generation,
    stream_error,
    usage,
)
from deepseek_v41.server.errors import APIError
from deepseek_v41.server.protocol import CompletionRequest
from deepseek_v41.server.streaming import SSEResponse
from deepseek_v41.server.structured import engine_params, request_constraint
from deepseek_v41.server.text import check_text_fits, encode


@dataclass
class _Prompt:
    text: str | None
    ids: list[int]


async def _encode_failing_fast(state: ServerState, texts: list[str], names: list[str],
                               add_special_tokens: bool) -> list[list[int]]:
    """Tokenize ``texts`` in groups of about one prompt's byte bound (``max_text_bytes``), checking each group's
    prompts before the next is tokenized: a request of many prompts that each pass the byte bound but not
    ``max_model_len`` is refused after tokenizing at most about two prompts' worth of text, not all of them
    (before, 24 such prompts of 2.4 MB in two requests took 135 s of tokenizing and 3 GB before their 400)."""
    group_chars = max(1, (state.max_text_bytes or 0) // 4)  # a character is 1-4 UTF-8 bytes
    encoded: list[list[int]] = []
    start = 0
    while start < len(texts):
        end, size = start, 0
        while end < len(texts) and (end == start or size + len(texts[end]) <= group_chars):
            size += len(texts[end])
            end += 1
        group = await encode(state, texts[start:end], add_special_tokens)
        for ids, name in zip(group, names[start:end], strict=True):
            check_prompt_ids(state, ids, name)
        encoded.extend(group)
        start = end
    return encoded


async def _prompts(state: ServerState, req: CompletionRequest) -> list[_Prompt]:
    """The request's prompts as token ids; APIError 400 naming ``prompt`` when they cannot be used."""
    raw = req.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], str)):
        texts = [raw] if isinstance(raw, str) else list(raw)
        if state.tokenizer is None:
            raise APIError("this model has no tokenizer.json: send the prompt as token ids", "prompt",
                           "invalid_value")
        names = ["prompt"] if isinstance(raw, str) else [f"prompt[{i}]" for i in range(len(texts))]
        for text, name in zip(texts, names, strict=True):
            check_text_fits(state, text, name)
        id_names = ["prompt"] if len(texts) == 1 else [f"prompt[{i}]" for i in range(len(texts))]
        encoded = await _encode_failing_fast(state, texts, id_names, req.add_special_tokens)
        prompts = [_Prompt(t, ids) for t, ids in zip(texts, encoded, strict=True)]
    else:
        lists = [raw] if isinstance(raw[0], int) else raw
        prompts = [_Prompt(None, list(ids)) for ids in lists]
    for i, prompt in enumerate(prompts):
        check_prompt_ids(state, prompt.ids, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
    if len(prompts) * req.n > state.max_n:
        raise APIError(f"{len(prompts)} prompts x n={req.n} is more than the {state.max_n} sequences this server "
                       f"takes in one request", "prompt", "invalid_value")
    return prompts


async def completion(state: ServerState, req: CompletionRequest, salt: str | None, arrival: float):
    """Run one completions request; a JSONResponse, or an SSEResponse when ``stream``."""
    check_common(state, req)
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of must equal n (this server does not rerank samples)", "best_of", "invalid_value")
    if req.echo and req.logprobs is not None:
        raise APIError("echo with logprobs needs prompt logprobs, which are not supported yet", "echo",
                       "unsupported_parameter")
    constraint = request_constraint(req)
    prompts = await _prompts(state, req)
    request_id, engine_id = request_ids("cmpl", req)
    salt_ = request_salt(salt, req.cache_salt)
    params = [sampling_params(state, req, len(p.ids), max_tokens_field="max_tokens", logprobs=req.logprobs,
                              logprobs_field="logprobs", skip_special_tokens=req.skip_special_tokens,
                              structured_outputs=engine_params(constraint)) for p in prompts]
    # All prompts are submitted at once, so they share engine steps (the first token of 32 prompts comes as soon
    # as one's).
    started = await start_all([
        start_generation(state, f"{engine_id}-{i}", prompt.ids, params[i], prompt.text, salt_, arrival,
                         constraint.param if constraint else "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        for i, prompt in enumerate(prompts)])
    created = int(time.time())
    run = _Run(state, req, prompts, request_id, created)
    if req.stream:
        return SSEResponse(run.chunks(merged(started)))
    finals: dict[int, StepOutput] = {}
    async with contextlib.aclosing(merged(started)) as outputs:
        async for index, out in outputs:
            finals[index] = out
    return JSONResponse(run.full(finals))


class _Run:
    """Builds the response of one completions request from its prompts' outputs."""

    def __init__(self, state: ServerState, req: CompletionRequest, prompts: list[_Prompt], request_id: str,
                 created: int):
        self.state, self.req, self.prompts = state, req, prompts
        self.base = {"id": request_id, "object": "text_completion", "created": created,
                     "model": state.response_model(req)}

    def _echo(self, index: int) -> str:
        prompt = self.prompts[index]
        if not self.req.echo:
            return ""
        if prompt.text is not None:
            return prompt.text
        tokenizer = self.state.tokenizer
        return tokenizer.decode(prompt.ids, skip_special_tokens=False) if tokenizer is not None else ""

    def _usage(self, outputs: dict[int, StepOutput], generated: int) -> dict[str, Any]:
        prompt_tokens = sum(len(p.ids) for p in self.prompts)
        cached = sum(out.output.num_cached_tokens for out in outputs.values())
        return usage(prompt_tokens, generated, cached)

    def full(self, finals: dict[int, StepOutput]) -> dict[str, Any]:
        choices = []
        req = self.req
        for index in range(len(self.prompts)):
            for completion in finals[index].output.outputs:
                echo = self._echo(index)
                entry: dict[str, Any] = {"index": index * req.n + completion.index, "text": echo + completion.text,
                                         "logprobs": None, "finish_reason": completion.finish_reason or "abort",
                                         "stop_reason": completion.stop_reason}
                if req.logprobs is not None:
                    entry["logprobs"] = completion_logprobs(self.state.logprob_tokenizer(req), completion.token_ids,
                                                            completion.logprobs or [], req.logprobs, len(echo))
                if req.return_token_ids:
                    entry["token_ids"] = completion.token_ids
                    entry["prompt_token_ids"] = self.prompts[index].ids
                choices.append(entry)
        generated = sum(len(c.token_ids) for out in finals.values() for c in out.output.outputs)
        body = {**self.base, "choices": choices, "usage": self._usage(finals, generated)}
        transfers = [finals[i].output.kv_transfer_params for i in range(len(self.prompts))]
        if any(t is not None for t in transfers):  # (one dict per prompt when the request has several)
            body["kv_transfer_params"] = transfers[0] if len(transfers) == 1 else transfers
        return body

    async def chunks(self, outputs: AsyncIterator[tuple[int, StepOutput]]) -> AsyncIterator[dict[str, Any]]:
        """SSE chunks: echo first, deltas, exactly one finish chunk per choice, then the usage chunk."""
        req = self.req
        options = req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        latest: dict[int, StepOutput] = {}
        generated = 0
        sent_text = {}

        def chunk(choice: dict[str, Any]) -> dict[str, Any]:
            body = {**self.base, "choices": [choice]}
            if include_usage:
                body["usage"] = self._usage(latest, generated) if continuous else None
            return body

        async with contextlib.aclosing(outputs):
            try:
                async for index, step in outputs:
                    latest[index] = step
                    for i, completion in enumerate(step.output.outputs):
                        choice_index = index * req.n + i
                        new_ids = step.delta_token_ids[i]
                        generated += len(new_ids)
                        text = step.delta_text[i]
                        if choice_index not in sent_text:
                            text = self._echo(index) + text
                            sent_text[choice_index] = 0
                        if text or new_ids:
                            piece: dict[str, Any] = {"index": choice_index, "text": text, "logprobs": None,
                                                     "finish_reason": None}
                            if req.logprobs is not None and new_ids:
                                entries = (completion.logprobs or [])[len(completion.token_ids) - len(new_ids):]
                                piece["logprobs"] = completion_logprobs(self.state.logprob_tokenizer(req), new_ids,
                                                                        entries, req.logprobs, sent_text[choice_index])
                            if req.return_token_ids:
                                piece["token_ids"] = new_ids
                            sent_text[choice_index] += len(text)
                            yield chunk(piece)
                        reason = step.finish_reasons[i]
                        if reason is not None:
                            yield chunk({"index": choice_index, "text": "", "logprobs": None,
                                         "finish_reason": reason, "stop_reason": completion.stop_reason})
            except (EngineDeadError, EngineDrainingError) as exc:
                yield stream_error(exc)
                return
        if include_usage:
            yield {**self.base, "choices": [], "usage": self._usage(latest, generated)}
