"""A sequence being generated and the outputs users see (vLLM's ``Sequence``, ``RequestOutput``)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deepseek_v41.cache.block_table import BlockTable
from deepseek_v41.engine.detokenizer import IncrementalDetokenizer
from deepseek_v41.engine.sampler import Logprob, SamplingState
from deepseek_v41.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepseek_v41.engine.multimodal import ImageItem, MultiModalInputs
    from deepseek_v41.engine.spec_schedule import SequenceAcceptance
    from deepseek_v41.structured import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One sample of one request: its tokens, cache bookkeeping and sampling state.

    ``num_computed``: tokens whose KV is in the cache (positions [0, num_computed)). The next forward runs the
    tokens [num_computed, num_tokens): a prefill chunk, or one token in a decode step. ``decoder_start``: first
    position the CED decoder runs over (:meth:`~deepseek_v41.plan.LayerPlan.decoder_start` of the prompt), fixed
    at arrival so that a preempted sequence recomputes exactly what it had. ``decoder_done``: positions every
    layer has run over (the CED decoder lags ``num_computed`` during a prompt and after a prefix-cache hit).
    ``rebuild_engram_history``: set by the KV cache manager on a prefix hit; the model runner rebuilds the slot's
    Engram history from the tokens before ``num_computed`` at the next prefill chunk, then clears it.
    ``grammar``: the structured-output matcher (``deepseek_v41.structured``), None for free text.
    ``mm_inputs``: the prompt's images (:class:`~deepseek_v41.engine.multimodal.MultiModalInputs`: content hash,
    span offset and length of each, and one token type per prompt position), None for a text prompt; the prompt's
    ids are then the expanded ones (every span position carries ``image_token_id``). Output positions are text.
    """

    seq_id: int
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: SamplingState
    detokenizer: IncrementalDetokenizer
    decoder_start: int
    arrival_time: float = field(default_factory=time.time)
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    block_table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    new_text: str = ""  # text and tokens the last step added (streaming deltas)
    new_token_ids: list[int] = field(default_factory=list)
    # Prefix caching (SPEC.md §4.3): the request's salt, the chain hashes of its full blocks, how many of its
    # pages are registered, the first position whose entries it writes (L'), tokens replayed, decoder progress.
    cache_salt: str | None = None
    block_hashes: list[str] = field(default_factory=list)
    registered_pages: int = 0
    write_from: int = 0
    num_replayed_tokens: int = 0
    decoder_done: int = 0
    prompt_snapshot_taken: bool = False
    rebuild_engram_history: bool = False
    # Disaggregated serving (issue 29): a prefill-only sequence (a kv_producer's) ends when its prompt's pages are
    # in the KV connector, sampling nothing; kv_transfer = (pages, bytes, seconds) that moved through the connector:
    # read by its prefix lookup (a kv_consumer's), or its prompt's pages the connector held when it ended (a
    # producer's).
    prefill_only: bool = False
    kv_transfer: tuple[int, int, float] = (0, 0, 0.0)
    # Speculative decoding (DSPARK.md §6): drafts accepted (bonus tokens not counted) and steps that verified drafts.
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    # Its own acceptance history, for the adaptive speculation policy (spec_schedule.py); None before its first
    # speculative step.
    spec_acceptance: SequenceAcceptance | None = field(default=None, repr=False, compare=False)
    # DSpark draft context of positions computed by plain decode steps, (position, the step's target-layer taps,
    # row), that reaches the draft ring at the sequence's next speculative step (speculative.py, _flush).
    draft_backlog: list = field(default_factory=list, repr=False, compare=False)
    # The first position from which every committed position's draft context row exists (a plain step that took
    # no taps moves it past its position; a prefill resets it): a draft window reaching below it has holes.
    draft_context_from: int = 0
    # Structured outputs: the matcher of the request's constraint, at the state after every output token (None:
    # free text). The engine masks this sequence's logits with it and advances it by each emitted token.
    grammar: GrammarMatcher | None = None
    # Images of the prompt (VISION_DESIGN.md decision 4), None for a text prompt.
    mm_inputs: MultiModalInputs | None = field(default=None, repr=False, compare=False)

    @property
    def image_spans(self) -> list[tuple[int, int]]:
        """Prompt positions [offset, offset + length) of each image span, in prompt order ([] for text)."""
        mm = self.mm_inputs
        return [] if mm is None else [(item.offset, item.offset + item.length) for item in mm.images]

    def images_in(self, start: int, end: int) -> list[ImageItem]:
        """The prompt's images whose spans overlap positions [start, end), in prompt order."""
        mm = self.mm_inputs
        if mm is None:
            return []
        return [item for item in mm.images if item.offset < end and start < item.offset + item.length]

    def token_types(self, start: int, end: int) -> list[int] | None:
        """The :class:`~deepseek_v41.model.image_processor.TokenType` codes of positions [start, end) (-1 = text;
        output positions are text), or None when no image span overlaps them (then the forward is text only)."""
        if not self.images_in(start, end):
            return None
        n = len(self.prompt_token_ids)
        types = list(self.mm_inputs.token_types[start:min(end, n)])
        return types + [-1] * (end - max(start, n)) if end > n else types

    @property
    def output_token_ids(self) -> list[int]:
        return self.detokenizer.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, start: int, end: int) -> list[int]:
        """Token ids of positions [start, end) of prompt + output."""
        n = len(self.prompt_token_ids)
        ids = self.prompt_token_ids[start:end] if start < n else []
        if end > n:
            ids = ids + self.output_token_ids[max(0, start - n): end - n]
        return ids

    @property
    def needs_prefill(self) -> bool:
        """True while more than the last sampled token is left to compute, nothing was computed yet, or the
        layers have not all run up to ``num_computed`` (``decoder_done`` behind it: a prefix-cache hit restored
        the encoder's state only, and the CED decoder must still run over its inputs in a prefill chunk)."""
        return (self.num_computed == 0 or self.num_tokens - self.num_computed > 1
                or self.decoder_done < self.num_computed)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass
class EngineRequest:
    """A request on its way into the engine (vLLM's ``EngineCoreRequest``): what
    :meth:`~deepseek_v41.engine.engine.LLMEngine.add_request` takes, as one typed object, queued by the async
    engine on the event loop and added on the engine's thread.

    ``prompt_token_ids``: the prompt's ids in ``[0, vocab_size)``; ``prompt``: its text when it came as text
    (echoed in outputs); ``cache_salt``: keeps its prefix-cache entries apart from other salts (None or a
    non-empty string); ``arrival_time``: seconds since the epoch (None: when the engine takes it);
    ``multi_modal_data``: ``{"image": [PIL.Image | ProcessedImage | bytes, ...]}`` with one ``image_token_id``
    placeholder per image in ``prompt_token_ids`` (not expanded), or None.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    cache_salt: str | None = None
    arrival_time: float | None = None
    multi_modal_data: dict[str, Any] | None = None


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's ``CompletionOutput``); ``new_text`` / ``new_token_ids`` are the delta of
    the step that produced this output. ``message``: set by ``LLM.chat`` only, the sample as the OpenAI assistant
    message ``/v1/chat/completions`` returns (``content``, ``reasoning_content`` in thinking mode, ``tool_calls``;
    :func:`deepseek_v41.chat.assistant_message`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    new_text: str = ""  # what the last engine step added (for streaming)
    new_token_ids: list[int] = field(default_factory=list)
    message: dict[str, Any] | None = None


@dataclass
class RequestMetrics:
    """Timestamps (seconds since the epoch) of a request; ``time_to_first_token`` in seconds."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt (vLLM's ``RequestOutput``).

    ``prompt_token_ids``: one list per request, made at arrival and shared by all its outputs (as vLLM's): a
    caller editing it changes what that request's later outputs show, not what the engine computes.
    ``num_cached_tokens``: prompt tokens served from the prefix cache (L' of SPEC.md §4.3 = DeepSeek's
    ``prompt_cache_hit_tokens``); replayed tokens are reported apart, never subtracted.
    ``spec_accepted_tokens``: DSpark drafts the target accepted over all samples (bonus tokens not counted, as
    vLLM's ``num_accepted_tokens``); ``spec_verify_steps``: steps that verified drafts, over all samples (as
    vLLM's ``num_drafts``: plain steps, and speculative steps that verified none, are not counted; 0 without
    speculation).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    num_replayed_tokens: int = 0  # cached prompt tokens recomputed to rebuild window state (bounded replay)
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    # Disaggregated serving (vLLM's name): a prefill-only request's {"do_remote_prefill": true, "num_prompt_tokens",
    # "num_pages", "block_size", "transfer_bytes"}; a request whose prefix came through the KV connector
    # {"cached_tokens", "replayed_tokens", "transfer_pages", "transfer_bytes", "transfer_seconds"}; else None.
    kv_transfer_params: dict | None = None
