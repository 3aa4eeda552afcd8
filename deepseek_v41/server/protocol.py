"""Request bodies of the OpenAI-compatible API (pydantic), with the vLLM, SGLang and DeepSeek extensions.

Every model forbids unknown fields and validates types strictly (no "1" for 1, no 1.5 for an int, no NaN), so a
mistyped request is a 400 naming the field instead of a silently different request. Fields that clients send
and that this server does not implement are declared, so that the error says "not supported" rather than
"unknown" (each model's ``UNSUPPORTED``). Responses are plain dicts built in ``serving_chat`` / ``serving_completion``.

Sources: the OpenAI API reference (chat completions, completions), vLLM ``vllm/entrypoints/openai/protocol.py``
(extra sampling fields, ``chat_template_kwargs``, ``return_token_ids``, ``cache_salt``), the DeepSeek API
(``thinking: {"type": ...}``, ``reasoning_effort``), CHAT_FORMAT.md §3(g), §6.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

NonNegInt = Annotated[int, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage (and ``choices: []``);
    ``continuous_usage_stats`` (vLLM) puts the running usage on every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class ThinkingOption(_Strict):
    """The DeepSeek API's ``thinking`` object."""

    type: Literal["enabled", "disabled"]


class _Sampling(_Strict):
    """Sampling and stopping fields shared by both endpoints (OpenAI names, vLLM extensions)."""

    model: str | None = None
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] = 1.0
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0  # OpenAI's range (the LLM API takes any T >= 0)
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None  # int64, as vLLM
    n: Annotated[int, Field(ge=1)] = 1
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    min_tokens: NonNegInt = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # same text either way with this fast tokenizer (SamplingParams)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = None
    # vLLM's disaggregated-serving field (issue 29): {"do_remote_decode": true} asks a kv_producer / kv_both server
    # for the prompt's KV only; a decode server gets the prefill response's params back.
    kv_transfer_params: dict[str, Any] | None = None
    return_token_ids: bool = False
    request_id: Annotated[str, Field(max_length=256)] | None = None  # vLLM: the response id is {prefix}-{request_id}
    priority: int = 0
    logit_bias: dict[str, float] | None = None
    # vLLM fields this server does not implement, declared so that they get a reason instead of "unrecognized".
    use_beam_search: bool = False
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False  # logprobs tokens spelled token_id:N (vLLM)
    logits_processors: Any = None
    # vLLM's structured outputs (checked and mapped in deepseek_v41.server.structured).
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    # field -> why it is refused when set to anything but its default (a 400 naming the field).
    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "logit_bias": "logit_bias is not supported yet",
        "priority": "priority must be 0: this server schedules requests first come, first served (vLLM's "
                    "--scheduling-policy fcfs, where vLLM refuses a priority too)",
        "use_beam_search": "beam search is not supported: this server samples (n independent samples)",
        "bad_words": "bad_words is not supported yet (the sampler has no token masks per request)",
        "allowed_token_ids": "allowed_token_ids is not supported yet (the sampler has no token masks per request)",
        "truncate_prompt_tokens": "truncate_prompt_tokens is not supported: a prompt over max_model_len is refused "
                                  "(400) rather than cut; shorten it on the client",
        "prompt_logprobs": "prompt_logprobs is not supported yet",
        "logits_processors": "logits_processors are not supported: the server runs no user code",
    }


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``.

    ``messages`` are checked by the chat encoder (roles, content parts, tool calls), which names the offending
    field. Thinking is off unless ``chat_template_kwargs.thinking`` (or ``enable_thinking``) is true,
    ``thinking.type`` is "enabled" or ``reasoning_effort`` is given (``"none"`` turns it off).
    """

    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | int | None = None
    thinking: ThinkingOption | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's default for chat: the rendered prompt already holds the BOS
    # Declared so that they get a clear "not supported" (see UNSUPPORTED), never a silent no-op.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    echo: bool = False
    chat_template: str | None = None
    documents: list[Any] | None = None

    UNSUPPORTED: ClassVar[dict[str, str]] = {
        **_Sampling.UNSUPPORTED,
        "functions": "the deprecated 'functions' API is not supported; send 'tools'",
        "function_call": "the deprecated 'function_call' is not supported; send 'tool_choice'",
        "audio": "this model does not produce audio",
        "prediction": "predicted outputs are not supported",
        "web_search_options": "web search is not supported",
        "echo": "echo is not supported on chat completions",
        "chat_template": "a per-request chat_template is not supported: prompts are rendered by the official "
                         "DeepSeek-V4.1 encoder (CHAT_FORMAT.md)",
        "documents": "documents (RAG chat templates) are not supported: put them in a message",
    }


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or a list of
    token-id lists (OpenAI's four forms); token ids work on models without a tokenizer."""

    prompt: str | Annotated[list[str], Field(min_length=1)] | Annotated[list[NonNegInt], Field(min_length=1)] | \
        Annotated[list[Annotated[list[NonNegInt], Field(min_length=1)]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1)] | None = None
    add_special_tokens: bool = True
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # vLLM: json_object / json_schema / structural_tag on completions

    UNSUPPORTED: ClassVar[dict[str, str]] = {
        **_Sampling.UNSUPPORTED,
        "suffix": "suffix (fill in the middle) is not supported by this model",
    }


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM): a ``prompt`` or chat ``messages`` (rendered by the chat encoder)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | int | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM): token ids back to text (special tokens kept)."""

    model: str | None = None
    tokens: list[NonNegInt]
