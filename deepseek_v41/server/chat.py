"""``POST /v1/chat/completions``: messages -> the official prompt -> the engine -> OpenAI messages or SSE chunks.

The prompt is rendered by :func:`deepseek_v41.chat.encode_messages`; the completion is split into
``reasoning_content``, ``content`` and ``tool_calls`` by one :class:`~deepseek_v41.chat.ChoiceParser` per
choice, in both modes, so a streamed answer concatenates to the non-streamed one (CHAT_FORMAT.md §5).

Request mapping (CHAT_FORMAT.md §3(g), §6): thinking is **off** unless ``chat_template_kwargs.thinking`` /
``enable_thinking`` is true, ``thinking.type`` is "enabled" or ``reasoning_effort`` is given (explicit flags win;
``reasoning_effort: "none"`` is off); API effort words map as the DeepSeek API does (minimal/low -> low,
medium/high/xhigh -> high, max/ultra -> max) and ints 1..100 pass through. ``chat_template_kwargs.drop_thinking``
defaults to true. ``continue_final_message`` leaves the last assistant turn open (``wo_eos``).

Tools: ``tool_choice`` "auto" (default with tools), "none" (tools not rendered, DSML output not returned as
calls, no grammar), "required" and a named function. "required" and named choices are enforced by grammar-
constrained decoding with the V4.1 DSML structural tag (:mod:`deepseek_v41.structured.dsml_grammar`): the answer is
one tool-call block whose invokes name the given tools and whose arguments are valid under each tool's schema (after
free reasoning in thinking mode). "auto" constrains a tool block only once the model opens one. ``response_format``,
``structured_outputs`` and ``guided_*`` map onto the same engine API (:mod:`deepseek_v41.server.structured`).
``parallel_tool_calls: false`` allows (and returns) only the first call.

Images (issue 27): image content parts (``image_url`` with a data URL or an http(s) URL, ``input_image``, ``image``:
:mod:`deepseek_v41.chat.images`), several per message and across messages, render as one placeholder each; the
images are loaded under the server's media policy (:mod:`deepseek_v41.server.media`), decoded and preprocessed
(:func:`deepseek_v41.engine.multimodal.process_images`) one at a time on the media threads, and handed to the engine
as ``multi_modal_data={"image": [...]}`` in the order of their placeholders in the prompt. The prompt is tokenized
around the placeholders and gets ``image_token_id`` in their places (the engine expands each into its image span),
so the placeholder's spelling in the tokenizer does not matter. Limits are checked on the expanded prompt: its
length against ``max_model_len``, the image tokens against the model's ``max_image_tokens``, the count against
``--limit-mm-per-prompt``; each a 400 naming the limit. A model without a vision tower answers a 400 "this model
does not take images".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from deepseek_v41.chat import IMAGE, ChatFormatError, ChoiceParser, ImageSource, render_messages
from deepseek_v41.engine.async_engine import EngineDeadError, EngineDrainingError, StepOutput
from deepseek_v41.model.image_processor import expand_image_placeholders
from deepseek_v41.server.common import (
    ServerState,
    chat_logprobs,
    check_common,
    check_prompt_ids,
    request_ids,
    request_salt,
    sampling_params,
    start_generation,
    stream_error,
    usage,
)
from deepseek_v41.server.errors import APIError
from deepseek_v41.server.media import check_image_count, image_bytes, in_media_thread, preprocess
from deepseek_v41.server.protocol import ChatCompletionRequest
from deepseek_v41.server.streaming import SSEResponse
from deepseek_v41.server.structured import Constraint, engine_params, request_constraint, tool_constraint
from deepseek_v41.server.text import check_text_fits, encode
from deepseek_v41.structured.dsml_grammar import ToolGrammarError
from deepseek_v41.structured.tool_choice import resolve_tool_choice

_EFFORTS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "high", "max": "max",
            "ultra": "max"}
_TEMPLATE_KWARGS = ("thinking", "enable_thinking", "drop_thinking")


@dataclass
class ChatPlan:
    """A chat request turned into what the engine and the parsers need. With images, ``ids`` holds one
    ``image_token_id`` per image (what the engine takes), ``images`` the preprocessed images in that order and
    ``prompt_ids`` the prompt as the model sees it (each placeholder expanded into its span); without, the
    three are ``ids``, ``[]`` and ``ids``."""

    prompt: str
    ids: list[int]
    thinking: bool  # the parser's starting state: inside the reasoning
    tools_active: bool  # DSML calls in the output are returned as tool_calls
    parallel: bool
    constraint: Constraint | None  # structured-output constraint (response_format, tool_choice, ...), after thinking
    images: list = field(default_factory=list)  # ProcessedImage, prompt order
    prompt_ids: list[int] | None = None  # None: ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids if self.prompt_ids is not None else self.ids)

    @property
    def multi_modal_data(self) -> dict | None:
        return {"image": list(self.images)} if self.images else None


def resolve_thinking(req: ChatCompletionRequest) -> tuple[bool, int | str | None, bool]:
    """(thinking, reasoning_effort for the encoder, drop_thinking) from the request; APIError for bad values."""
    kwargs = req.chat_template_kwargs or {}
    for key, value in kwargs.items():
        if key not in _TEMPLATE_KWARGS:
            raise APIError(f"unknown chat_template_kwargs key {key!r}; known: {list(_TEMPLATE_KWARGS)}",
                           f"chat_template_kwargs.{key}", "unknown_parameter")
        if not isinstance(value, bool):
            raise APIError(f"must be true or false, got {value!r}", f"chat_template_kwargs.{key}", "invalid_type")
    explicit = None
    if req.thinking is not None:
        explicit = req.thinking.type == "enabled"
    for key in ("thinking", "enable_thinking"):
        if key in kwargs:
            explicit = kwargs[key]
    effort = req.reasoning_effort
    if isinstance(effort, str):
        if effort == "none":
            explicit, effort = False if explicit is None else explicit, None
        elif effort in _EFFORTS:
            effort = _EFFORTS[effort]
        else:
            raise APIError(f"reasoning_effort {effort!r} is not one of none, {', '.join(_EFFORTS)} or an integer "
                           f"1..100", "reasoning_effort", "invalid_value")
    elif effort is not None and not 1 <= effort <= 100:
        raise APIError(f"reasoning_effort must be in 1..100, got {effort}", "reasoning_effort", "invalid_value")
    thinking = explicit if explicit is not None else effort is not None
    return thinking, effort, kwargs.get("drop_thinking", True)


def _vision_config(state: ServerState, sources: list[ImageSource]):
    """The model's vision config; a 400 naming the first image part when the model has none."""
    vision = getattr(state.engine.engine.config, "vision_config", None)
    if vision is None:
        raise APIError("this model does not take images: it has no vision tower (no vision_config in its "
                       "config.json); send text content parts", sources[0].where, "unsupported_content")
    return vision


async def load_images(state: ServerState, sources: list[ImageSource], vision) -> list:
    """The preprocessed images of a request, in order: each loaded (:func:`deepseek_v41.server.media.image_bytes`),
    decoded and preprocessed for ``vision`` (the model's vision config) before the next, so at most one decoded
    image is held at a time. APIError 400 naming the part for anything refused."""
    processed = []
    for source in sources:
        data = await image_bytes(source, state.config.media)
        processed.append(await in_media_thread(preprocess, data, state.config.media, vision, source.where))
        del data
    return processed


async def encode_with_images(state: ServerState, prompt: str, count: int, add_special_tokens: bool) -> list[int]:
    """Tokenize a rendered prompt holding ``count`` image placeholders: the text between them is tokenized (off the
    event loop) and ``image_token_id`` put in each placeholder's place; special tokens, when asked, only before the
    first piece."""
    pieces = prompt.split(IMAGE)
    if len(pieces) != count + 1:  # the renderer emits exactly one placeholder per image part it renders
        raise RuntimeError(f"the rendered prompt holds {len(pieces) - 1} image placeholders for {count} images")
    (first,) = await encode(state, pieces[:1], add_special_tokens=add_special_tokens)
    rest = await encode(state, pieces[1:], add_special_tokens=False)
    image_token_id = state.engine.engine.config.image_token_id
    ids = list(first)
    for piece in rest:
        ids.append(image_token_id)
        ids += piece
    return ids


def _expand(state: ServerState, ids: list[int], images: list) -> list[int]:
    """The prompt with each placeholder expanded into its image's span (the length the model sees, for the
    context checks); a count mismatch becomes a 400. The engine expands again and hashes each image (its encoder
    and prefix cache keys) on its own thread; nothing is hashed twice."""
    try:
        expanded, _ = expand_image_placeholders(ids, [image.grid for image in images],
                                                state.engine.engine.config.image_token_id)
    except ValueError as exc:
        raise APIError(str(exc), "messages", "invalid_value") from exc
    return expanded


def _tool_choice(req: ChatCompletionRequest) -> tuple[str, str | None]:
    """("auto" | "none" | "required" | "named", function name) with the request's tools checked
    (:func:`deepseek_v41.structured.tool_choice.resolve_tool_choice`; its errors as 400s naming the field)."""
    try:
        return resolve_tool_choice(req.tools, req.tool_choice)
    except ToolGrammarError as exc:
        raise APIError(str(exc), exc.param, "invalid_value") from exc


async def prepare_chat(state: ServerState, req: ChatCompletionRequest, check_length: bool = True) -> ChatPlan:
    """Validate and render the request; APIError 400 naming the field for anything that cannot be served.
    ``check_length=False`` (for /tokenize) lets a prompt over ``max_model_len`` tokens through, but not one whose
    text cannot fit it (:func:`check_text_fits`)."""
    check_common(state, req)
    if state.tokenizer is None:
        raise APIError("this model has no tokenizer.json, so chat is not available; use /v1/completions with "
                       "token-id prompts", "messages", "invalid_value")
    if req.modalities and set(req.modalities) != {"text"}:
        raise APIError("this model only produces text: modalities must be ['text']", "modalities", "invalid_value")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    messages = req.messages
    thinking, effort, drop = resolve_thinking(req)
    choice, name = _tool_choice(req)
    constraint = _constraint(req, choice, name, thinking)
    if req.continue_final_message:
        if messages[-1].get("role") != "assistant":
            raise APIError("continue_final_message needs an assistant message last", "continue_final_message",
                           "invalid_value")
        messages = [*messages[:-1], {**messages[-1], "wo_eos": True}]
    elif not req.add_generation_prompt:
        raise APIError("add_generation_prompt: false is only supported with continue_final_message: true",
                       "add_generation_prompt", "invalid_value")
    try:
        prompt, sources = render_messages(messages, tools=req.tools if choice != "none" else None,
                                          thinking=thinking, reasoning_effort=effort, drop_thinking=drop)
    except ChatFormatError as exc:
        raise APIError(str(exc), exc.where, "invalid_value") from exc
    check_text_fits(state, prompt, "messages")  # the rendered prompt holds every message's text
    images, prompt_ids = [], None
    if sources:  # the cheap checks first: nothing is fetched for a request refused anyway
        vision = _vision_config(state, sources)
        check_image_count(len(sources), state.config.media)
        ids = await encode_with_images(state, prompt, len(sources), req.add_special_tokens)
        if check_length:
            check_prompt_ids(state, ids, "messages")  # the text alone, one position per image
        images = await load_images(state, sources, vision)
        prompt_ids = await asyncio.to_thread(_expand, state, ids, images)
    else:
        (ids,) = await encode(state, [prompt], add_special_tokens=req.add_special_tokens)
    if check_length:
        check_prompt_ids(state, prompt_ids if prompt_ids is not None else ids, "messages")
    return ChatPlan(prompt, ids, thinking and not req.continue_final_message, choice != "none",
                    req.parallel_tool_calls is not False, constraint, images, prompt_ids)


def _constraint(req: ChatCompletionRequest, choice: str, name: str | None, thinking: bool) -> Constraint | None:
    """The request's structured-output constraint: an explicit one (response_format, structured_outputs,
    guided_*), else the DSML grammar of tool_choice "required" / named / "auto" with tools. A constrained answer
    starts at the beginning of the assistant turn, so continue_final_message takes none ("auto" then runs
    unconstrained, as the tool block is parsed from text either way)."""
    explicit = request_constraint(req)
    if explicit is not None and choice in ("required", "named"):
        raise APIError(f"tool_choice {choice!r} constrains the answer to a tool call, so it cannot be combined with "
                       f"{explicit.param}; use tool_choice 'auto' or 'none'", "tool_choice", "invalid_value")
    if req.continue_final_message:
        if explicit is not None or choice in ("required", "named"):
            raise APIError(f"{explicit.param if explicit else 'tool_choice'} constrains the whole answer, which "
                           f"continue_final_message does not start; drop one of them", "continue_final_message",
                           "invalid_value")
        return None
    if explicit is None:
        return tool_constraint(req.tools, choice, name, thinking, req.parallel_tool_calls is not False)
    return explicit


class _Choice(ChoiceParser):
    """One choice's parser (:class:`~deepseek_v41.chat.ChoiceParser`, the request's tool policy) and what its
    stream has sent."""

    def __init__(self, plan: ChatPlan):
        super().__init__(plan.thinking, plan.tools_active, plan.parallel)
        self.num_tokens = 0
        self.finished = False

    def feed(self, text: str, finished: bool = False) -> list[dict[str, Any]]:
        self.finished = self.finished or finished
        return super().feed(text, finished)


async def chat_completion(state: ServerState, req: ChatCompletionRequest, salt: str | None, arrival: float):
    """Run one chat request; a JSONResponse, or an SSEResponse when ``stream``."""
    plan = await prepare_chat(state, req)
    top = req.top_logprobs or 0
    params = sampling_params(state, req, plan.num_prompt_tokens, max_tokens_field=(
        "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"),
        logprobs=top if req.logprobs else None, logprobs_field="top_logprobs", skip_special_tokens=False,
        structured_outputs=engine_params(plan.constraint, plan.thinking))
    request_id, engine_id = request_ids("chatcmpl", req)
    stream, first = await start_generation(state, engine_id, plan.ids, params, plan.prompt,
                                           request_salt(salt, req.cache_salt), arrival,
                                           plan.constraint.param if plan.constraint else "messages",
                                           multi_modal_data=plan.multi_modal_data)
    created = int(time.time())
    if req.stream:
        return SSEResponse(_chunks(state, req, plan, request_id, created, stream, first))
    async with contextlib.aclosing(stream):
        last = first
        async for last in stream:  # noqa: B007 (the last output is the final state)
            pass
    return JSONResponse(_full_response(state, req, plan, request_id, created, last))


def _full_response(state: ServerState, req: ChatCompletionRequest, plan: ChatPlan, request_id: str, created: int,
                   last: StepOutput) -> dict[str, Any]:
    out = last.output
    choices = []
    for completion in out.outputs:
        choice = _Choice(plan)
        message = choice.message(completion.text)  # = parse_output(text), tool policy applied
        entry: dict[str, Any] = {"index": completion.index, "message": message, "logprobs": None,
                                 "finish_reason": choice.finish_reason(completion.finish_reason or "abort"),
                                 "stop_reason": completion.stop_reason}
        if req.logprobs:
            entry["logprobs"] = chat_logprobs(state.logprob_tokenizer(req), completion.token_ids,
                                              completion.logprobs or [], req.top_logprobs or 0)
        if req.return_token_ids:
            entry["token_ids"] = completion.token_ids
        choices.append(entry)
    body = {"id": request_id, "object": "chat.completion", "created": created,
            "model": state.response_model(req),
            "choices": choices, "usage": usage(plan.num_prompt_tokens, sum(len(c.token_ids) for c in out.outputs),
                                               out.num_cached_tokens)}
    if req.return_token_ids:
        body["prompt_token_ids"] = out.prompt_token_ids
    if out.kv_transfer_params is not None:
        body["kv_transfer_params"] = out.kv_transfer_params
    return body


async def _chunks(state: ServerState, req: ChatCompletionRequest, plan: ChatPlan, request_id: str, created: int,
                  stream: AsyncIterator[StepOutput], first: StepOutput) -> AsyncIterator[dict[str, Any]]:
    """The SSE chunks: a role chunk per choice, deltas, exactly one finish chunk per choice, then usage."""
    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    choices = [_Choice(plan) for _ in range(req.n)]
    prompt_tokens = plan.num_prompt_tokens
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": state.response_model(req)}

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        body = {**base, "choices": [choice]}
        if include_usage:
            body["usage"] = usage(prompt_tokens, sum(c.num_tokens for c in choices), cached) if continuous else None
        return body

    cached = first.output.num_cached_tokens
    # Token ids of steps whose text the parser held back (no delta yet): they go with the next piece of the choice,
    # so that a stream's token_ids add up to its completion tokens.
    held: list[list[int]] = [[] for _ in range(req.n)]
    async with contextlib.aclosing(stream):
        for i in range(req.n):
            yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
        step = first
        try:
            while True:
                for i, choice in enumerate(choices):
                    if choice.finished:  # it finished in an earlier step; the others go on
                        continue
                    reason = step.finish_reasons[i]
                    new_ids = step.delta_token_ids[i]
                    choice.num_tokens += len(new_ids)
                    logprobs = None
                    if req.logprobs and new_ids:
                        entries = (step.output.outputs[i].logprobs or [])[choice.num_tokens - len(new_ids):]
                        logprobs = chat_logprobs(state.logprob_tokenizer(req), new_ids, entries, req.top_logprobs or 0)
                    deltas = choice.feed(step.delta_text[i], reason is not None) or ([{}] if logprobs else [])
                    held[i].extend(new_ids)
                    for k, delta in enumerate(deltas):
                        piece = {"index": i, "delta": delta, "logprobs": logprobs if k == 0 else None,
                                 "finish_reason": None}
                        if req.return_token_ids:
                            piece["token_ids"], held[i] = (held[i], []) if k == 0 else ([], held[i])
                        yield chunk(piece)
                    if reason is not None:
                        last = {"index": i, "delta": {}, "logprobs": None,
                                "finish_reason": choice.finish_reason(reason),
                                "stop_reason": step.output.outputs[i].stop_reason}
                        if req.return_token_ids and held[i]:
                            last["token_ids"], held[i] = held[i], []
                        yield chunk(last)
                if step.finished:
                    break
                step = await anext(stream)
        except (EngineDeadError, EngineDrainingError) as exc:
            yield stream_error(exc)
            return
    if include_usage:
        yield {**base, "choices": [], "usage": usage(prompt_tokens, sum(c.num_tokens for c in choices), cached)}
