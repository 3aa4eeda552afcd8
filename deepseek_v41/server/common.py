"""What both generation endpoints share: the server's state, request limits -> ``SamplingParams``, usage, logprobs.

Limits (SPEC.md §4.6): a prompt of ``max_model_len`` tokens or more, ``max_tokens`` beyond what is left of
``max_model_len``, ``n`` outside [1, max_n], more than 4 stop strings or one over 1024 characters, bad sampling
values -> :class:`APIError` 400 naming the field.
Usage follows OpenAI (``prompt_tokens_details.cached_tokens``) and the DeepSeek API (``prompt_cache_hit_tokens``,
``prompt_cache_miss_tokens``); cached tokens come from ``RequestOutput.num_cached_tokens``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

from deepseek_v41.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineDrainingError,
    StepOutput,
)
from deepseek_v41.engine.sampler import Logprob
from deepseek_v41.engine.sampling_params import SAMPLING_EPS, SamplingParams
from deepseek_v41.server.errors import APIError, error_body
from deepseek_v41.server.media import MediaConfig
from deepseek_v41.server.text import check_unicode, max_token_bytes

logger = logging.getLogger("deepseek_v41.server")

MAX_STOP_STRINGS = 4  # OpenAI's limit; each string is at most MAX_STOP_STRING_CHARS (SamplingParams)


@dataclass
class ServerConfig:
    """Settings of the HTTP layer.

    ``served_model_names``: the names ``model`` may take, listed by ``/v1/models`` (the first is the default);
    ``model_aliases``: other names ``model`` may take, not listed (``dsv41 serve`` sets the model path as given and
    its absolute form when ``--served-model-name`` is not set, so scripts written for vLLM, whose served name
    defaults to the path, keep working); ``api_keys``: accepted bearer
    keys (none = no auth); ``max_body_bytes``: request body limit (32 MiB); ``max_n``: largest ``n`` (default: the
    engine's ``max_num_seqs``); ``log_stats_interval_s``: period of the throughput log line (0 = off);
    ``drain_timeout_s``: on shutdown, how long running requests may finish before they are aborted;
    ``sampling_defaults``: what a request that does not set temperature, top_p, top_k, min_p, repetition_penalty or
    max_tokens gets (from the checkpoint's ``generation_config.json``, see
    :mod:`deepseek_v41.server.generation_config`; empty = vLLM's defaults), ``sampling_defaults_origin`` where
    they come from (for error messages: the file, or the flag); ``allow_origins``,
    ``allow_methods``, ``allow_headers``, ``allow_credentials``: CORS (vLLM's defaults: any origin, method and
    header, no credentials); ``log_requests``: log one line per request (id, prompt tokens, sampling parameters;
    never the prompt text), vLLM's ``--enable-log-requests``; ``media``: how images of chat requests are taken
    (:class:`~deepseek_v41.server.media.MediaConfig`: data URLs always, URL fetching off unless allowed, images per
    request, fetch timeout and byte limits); ``dev_mode``: serve the development routes
    (``POST /reset_prefix_cache``; vLLM's ``VLLM_SERVER_DEV_MODE``, here ``DSV41_SERVER_DEV_MODE=1``), which no API
    key guards: never on a public address.
    """

    served_model_names: list[str]
    model_path: str | None = None
    model_aliases: list[str] = field(default_factory=list)
    api_keys: list[str] = field(default_factory=list)
    max_body_bytes: int = 32 * 1024 * 1024
    max_n: int | None = None
    log_stats_interval_s: float = 10.0
    drain_timeout_s: float = 30.0
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    sampling_defaults_origin: str = "generation_config.json"
    allow_origins: list[str] = field(default_factory=lambda: ["*"])
    allow_methods: list[str] = field(default_factory=lambda: ["*"])
    allow_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    log_requests: bool = False
    media: MediaConfig = field(default_factory=MediaConfig)
    dev_mode: bool = False


@dataclass
class ServerState:
    """Everything a route needs; lives on ``app.state.server``."""

    config: ServerConfig
    engine: AsyncLLMEngine
    metrics: Any
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # Longest prompt text, in UTF-8 bytes, that can fit max_model_len tokens (None: no tokenizer).
    max_text_bytes: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.tokenizer is not None:
            self.max_text_bytes = self.engine.max_model_len * max_token_bytes(self.tokenizer)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def response_model(self, req: Any) -> str:
        """The ``model`` of a response, as vLLM's ``_get_model_name``: the name the request used (a served name or
        an alias, already checked by :func:`check_common`), else the first served name."""
        return req.model or self.model_name

    def logprob_tokenizer(self, req: Any):
        """The tokenizer that spells the tokens of ``logprobs``: None (tokens as ``token_id:N``, vLLM's spelling)
        when the request sets vLLM's ``return_tokens_as_token_ids``."""
        return None if getattr(req, "return_tokens_as_token_ids", False) else self.tokenizer

    def accepts_model(self, name: str | None) -> bool:
        """Whether a request's ``model`` is served here: unset or empty (vLLM's default model), a served name, or an
        alias of one."""
        return not name or name in self.config.served_model_names or name in self.config.model_aliases

    @property
    def max_n(self) -> int:
        return self.config.max_n or self.engine.engine.args.max_num_seqs

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.config.vocab_size


def key_salt(api_key: str) -> str:
    """The prefix-cache salt of an API key: a hash, so the key itself never reaches the engine."""
    return hashlib.sha256(b"dsv41-api-key\0" + api_key.encode()).hexdigest()[:32]


def request_salt(key_salt_: str | None, cache_salt: str | None) -> str | None:
    """Combine the key's salt with a request's own ``cache_salt`` (vLLM field); None when neither is set."""
    parts = [p for p in (key_salt_, cache_salt) if p]
    return ":".join(parts) if parts else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_ids(prefix: str, req: Any) -> tuple[str, str]:
    """``(response id, engine id)`` of a request. With the vLLM field ``request_id`` the response id is
    ``{prefix}-{request_id}`` (vLLM's spelling); the engine id always gets a random part as well, so two requests
    that send the same ``request_id`` never collide in the engine."""
    given = getattr(req, "request_id", None)
    if not given:
        response_id = new_id(prefix)
        return response_id, response_id
    response_id = f"{prefix}-{given}"
    return response_id, f"{response_id}-{uuid.uuid4().hex[:12]}"


def check_common(state: ServerState, req: Any) -> None:
    """Valid Unicode everywhere, the model name (a served name or alias; unset or empty means the default, as in
    vLLM's ``_check_model``), the declared-but-unsupported fields, and stream_options without stream (as OpenAI and
    vLLM)."""
    check_unicode(req)
    if getattr(req, "stream_options", None) is not None and not req.stream:
        raise APIError("stream_options is only allowed when stream is true", "stream_options", "invalid_value")
    if not state.accepts_model(req.model):
        raise APIError(f"The model '{req.model}' does not exist; this server serves "
                       f"{state.config.served_model_names}", "model", "model_not_found", 404)
    for name, why in getattr(req, "UNSUPPORTED", {}).items():
        value = getattr(req, name, None)
        if value not in (None, False, {}, []):
            raise APIError(why, name, "unsupported_parameter")


def check_prompt_ids(state: ServerState, ids: list[int], param: str) -> None:
    """Empty, out-of-vocabulary or too-long prompts (400 naming ``param``)."""
    if not ids:
        raise APIError("the prompt is empty: give at least one token", param, "invalid_value")
    vocab = state.vocab_size
    if max(ids) >= vocab:
        raise APIError(f"token id {max(ids)} is outside the vocabulary [0, {vocab})", param, "invalid_value")
    limit = state.engine.max_model_len
    if len(ids) >= limit:
        raise APIError(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                       f"{len(ids)} tokens; it must leave room for at least one generated token.", param,
                       "context_length_exceeded")


def sampling_params(state: ServerState, req: Any, prompt_len: int, *, max_tokens_field: str,
                    logprobs: int | None, logprobs_field: str, skip_special_tokens: bool,
                    structured_outputs: Any = None) -> SamplingParams:
    """The request's SamplingParams, or APIError 400 naming the field that cannot be honoured.
    ``structured_outputs``: the request's ``StructuredOutputsParams`` (:mod:`deepseek_v41.server.structured`), or
    None for free generation."""
    if req.n > state.max_n:
        raise APIError(f"n must be at most {state.max_n} on this server, got {req.n}", "n", "invalid_value")
    if req.stop and state.tokenizer is None:
        raise APIError("stop strings need a tokenizer and this model has none; use stop_token_ids", "stop",
                       "invalid_value")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP_STRINGS:
        raise APIError(f"stop takes at most {MAX_STOP_STRINGS} strings (as OpenAI), got {len(req.stop)}", "stop",
                       "invalid_value")
    room = state.engine.max_model_len - prompt_len
    defaults = state.config.sampling_defaults
    requested = getattr(req, max_tokens_field)
    if requested is None or max_tokens_field not in req.model_fields_set:
        # Not set by the client: the smallest of the field's default (completions' 16), the checkpoint's
        # max_new_tokens and what is left of the context; a value the client set is never shrunk.
        requested = min(v for v in (room, requested, defaults.get("max_tokens")) if v is not None)
    if requested is not None and requested > room:
        raise APIError(f"This model's maximum context length is {state.engine.max_model_len} tokens. However, you "
                       f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for "
                       f"the completion). Please reduce the length of the prompt or {max_tokens_field}.",
                       max_tokens_field, "context_length_exceeded")
    names = {"max_tokens": max_tokens_field, "logprobs": logprobs_field}
    # The checkpoint's defaults fill the sampling fields the client did not set (vLLM's --generation-config).
    sampling = {name: defaults[name] if name in defaults and name not in req.model_fields_set else getattr(req, name)
                for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    if req.n > 1 and sampling["temperature"] < SAMPLING_EPS:
        raise APIError(_greedy_n_message(state, req), "n", "invalid_value")
    try:
        return SamplingParams(
            structured_outputs=structured_outputs, n=req.n, **sampling, seed=req.seed,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, stop=req.stop, stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            max_tokens=requested, min_tokens=req.min_tokens, logprobs=logprobs,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            extra_args=None if req.kv_transfer_params is None else {"kv_transfer_params": req.kv_transfer_params})
    except ValueError as exc:
        field_name = str(exc).split(" ", 1)[0]
        raise APIError(str(exc), names.get(field_name, field_name), "invalid_value") from exc


def _greedy_n_message(state: ServerState, req: Any) -> str:
    """Why ``n > 1`` is refused at temperature 0 (vLLM refuses it too: greedy samples are all the same), naming
    where the temperature came from and how to change it."""
    if "temperature" in req.model_fields_set:
        return (f"n must be 1 when using greedy sampling, got {req.n}: temperature {req.temperature} is greedy "
                f"(every sample would be the same); set temperature > 0 for n > 1")
    origin = state.config.sampling_defaults_origin
    return (f"n must be 1 when using greedy sampling, got {req.n}: this request does not set temperature, so it "
            f"gets the server's default temperature {state.config.sampling_defaults['temperature']} from {origin}, "
            f"which is greedy. Pass temperature > 0 in the request, or start the server with --generation-config "
            f"vllm (vLLM's default temperature 1.0) or --override-generation-config '{{\"temperature\": 1.0}}'")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI usage plus DeepSeek's cache fields; ``cached_tokens <= prompt_tokens`` always."""
    cached = min(cached_tokens, prompt_tokens)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached},
            "prompt_cache_hit_tokens": cached, "prompt_cache_miss_tokens": prompt_tokens - cached}


def token_text(tokenizer, token_id: int) -> str:
    """A token's own text (special tokens kept); ``token_id:N`` without a tokenizer (vLLM's spelling)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, Logprob]], top: int) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        text = token_text(tokenizer, token_id)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:top]
        content.append({"token": text, "logprob": max(entry[token_id].logprob, -9999.0),
                        "bytes": list(text.encode()),
                        "top_logprobs": [{"token": (t := token_text(tokenizer, i)), "logprob": max(lp.logprob, -9999.0),
                                          "bytes": list(t.encode())} for i, lp in ranked]})
    return {"content": content}


def completion_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, Logprob]], top: int,
                        offset: int) -> dict[str, Any]:
    """OpenAI completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset (from ``offset``)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=False):
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(max(entry[token_id].logprob, -9999.0))
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:top]
        tops.append({token_text(tokenizer, i): max(lp.logprob, -9999.0) for i, lp in ranked})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def engine_unavailable(exc: EngineDeadError | EngineDrainingError) -> APIError:
    """The 503 every request gets when the engine cannot serve it: ``engine_dead`` after a failure of the engine
    loop (the same message for every request, the cause included; the server exits so that its supervisor restarts
    it), ``shutting_down`` while draining."""
    if isinstance(exc, EngineDrainingError):
        return APIError("the server is shutting down; retry on another replica", None, "shutting_down", 503)
    return APIError(f"the engine stopped after an internal failure and the server is restarting; retry shortly "
                    f"({exc})", None, "engine_dead", 503)


def stream_error(exc: EngineDeadError | EngineDrainingError) -> dict[str, Any]:
    """The SSE error event of :func:`engine_unavailable` (a stream's status line has already been sent)."""
    error = engine_unavailable(exc)
    return error_body(error.message, error.status, error.param, error.code)


async def start_generation(state: ServerState, request_id: str, ids: list[int], params: SamplingParams,
                           prompt: str | None, salt: str | None, arrival: float, param: str,
                           multi_modal_data: dict | None = None) -> tuple[AsyncIterator[StepOutput], StepOutput]:
    """Submit a request and wait for its first output, so that engine refusals become a 400 naming ``param``
    (and shutdown / a dead engine a 503) before any response byte is sent. Returns the open stream and the
    first output; the caller must close the stream. ``multi_modal_data``: ``{"image": [ProcessedImage, ...]}``, one
    per ``image_token_id`` placeholder of ``ids``, or None."""
    stream = state.engine.generate(request_id, ids, params, prompt=prompt, cache_salt=salt, arrival_time=arrival,
                                   multi_modal_data=multi_modal_data)
    try:
        first = await anext(stream)
    except ValueError as exc:
        await stream.aclose()
        raise APIError(str(exc), param, "invalid_value") from exc
    except (EngineDrainingError, EngineDeadError) as exc:
        await stream.aclose()
        raise engine_unavailable(exc) from exc
    except BaseException:
        await stream.aclose()
        raise
    if params.max_tokens is not None:
        state.metrics.request_started(params.max_tokens)
    if state.config.log_requests:
        images = len(multi_modal_data["image"]) if multi_modal_data else 0
        logger.info("Received request %s: %d prompt tokens%s, %s", request_id, len(first.output.prompt_token_ids),
                    f" ({images} images)" if images else "", params)
    return stream, first


async def start_all(starts: list[Coroutine[Any, Any, tuple[AsyncIterator[StepOutput], StepOutput]]]
                    ) -> list[tuple[AsyncIterator[StepOutput], StepOutput]]:
    """Run several :func:`start_generation` calls concurrently (their requests reach the engine together) and
    return their results in order. If any fails, or the caller is cancelled, every stream already started is closed
    (its request aborted) and the first failure in order is raised."""
    tasks = [asyncio.ensure_future(start) for start in starts]
    try:
        await asyncio.wait(tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close_started(tasks)
        raise
    failed = [task.exception() for task in tasks if task.exception() is not None]
    if failed:
        await _close_started(tasks)
        raise failed[0]
    return [task.result() for task in tasks]


async def _close_started(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is None:
            await task.result()[0].aclose()


async def merged(streams: list[tuple[AsyncIterator[StepOutput], StepOutput]]
                 ) -> AsyncIterator[tuple[int, StepOutput]]:
    """Interleave several started generations as ``(prompt index, output)``, in arrival order."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[StepOutput], first: StepOutput) -> None:
        await queue.put((index, first))
        try:
            async for out in stream:
                await queue.put((index, out))
        except (EngineDeadError, EngineDrainingError) as exc:
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, s, f)) for i, (s, f) in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, out = await queue.get()
            if isinstance(out, BaseException):
                raise out
            remaining -= out.finished
            yield index, out
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for stream, _ in streams:
            await stream.aclose()
