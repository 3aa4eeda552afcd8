"""``LLM``: the offline entry point, shaped like vLLM's (``generate``, ``chat``, ``SamplingParams``)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from deepseek_v41.chat import assistant_message, render_messages
from deepseek_v41.chat.images import read_offline, split_at_placeholders
from deepseek_v41.distributed import driver  # (a module: driver.py's imports reach back to this package)
from deepseek_v41.distributed.config import ParallelConfig
from deepseek_v41.dtypes import resolve_dtype
from deepseek_v41.engine import options
from deepseek_v41.engine.engine import EngineArgs, LLMEngine, load_tokenizer
from deepseek_v41.engine.generation_config import load_sampling_defaults
from deepseek_v41.engine.sampling_params import SamplingParams, StructuredOutputsParams
from deepseek_v41.engine.sequence import RequestOutput
from deepseek_v41.model.checkpoint import load_model
from deepseek_v41.structured.tool_choice import resolve_tool_choice, tool_choice_tag

log = logging.getLogger("deepseek_v41")
# The chat_template_kwargs keys LLM.chat takes (the server's, and reasoning_effort as the argument).
CHAT_TEMPLATE_KWARGS = ("thinking", "enable_thinking", "drop_thinking", "reasoning_effort")
MAX_IMAGE_BYTES = 64 * 1024 * 1024  # encoded bytes of one image of an LLM.chat data URL or file


class LLM:
    """Load a model directory (or take a model object) and generate.

    ``LLM(model, dtype="auto", device="cpu", prefill_mode="ced"|"exact", block_size=16, max_num_seqs=64,
    max_num_batched_tokens=4096, max_model_len=None, num_kv_pages=None, kv_cache_memory_bytes=None,
    window_slack_rows=16, enforce_eager=True, seed=0, tokenizer=None, generation_config="auto")``. ``model`` is a
    path (config.json + safetensors, tokenizer.json and generation_config.json when present) or an already built
    model (used in its own dtype). ``dtype``: ``"auto"`` (the config's ``torch_dtype``, else bfloat16 where the
    device computes bf16 natively, else float32), ``"bfloat16"``, ``"float32"``, ``"float16"``, ``"float64"`` or a
    ``torch.dtype`` (:func:`deepseek_v41.dtypes.resolve_dtype`; ValueError naming the allowed values otherwise).
    ``generation_config``: where :meth:`get_default_sampling_params` reads its defaults, as vLLM's
    (``"auto"`` = the model directory's ``generation_config.json``, ``"vllm"`` = none, or a folder holding one).
    ``enforce_eager`` is accepted for vLLM compatibility: the engine is always eager.
    ``tokenizer``: None (the model directory's ``tokenizer.json``), a folder holding ``tokenizer.json`` or the file
    itself (vLLM's ``tokenizer=``), or a ``tokenizers.Tokenizer``; ValueError for a folder without one.
    ``structured_outputs_config``: ``{"backend": "auto"|"xgrammar"|"guidance", "disable_any_whitespace": bool}``
    (vLLM's name; :class:`~deepseek_v41.structured.StructuredOutputsConfig`) for requests with
    ``SamplingParams(structured_outputs=...)``.

    vLLM's engine options mean what ``dsv41 serve``'s flags of the same names mean (:mod:`engine.options`):
    ``gpu_memory_utilization`` (a fraction in (0, 1]) sizes the KV pool's byte budget as that fraction of the memory
    left free once the weights are loaded (device memory; RAM on CPU), unless ``num_kv_pages`` or
    ``kv_cache_memory_bytes`` is given (an explicit size wins, with a warning); the budget is an upper bound, the
    pool never holding more than ``max_num_seqs`` sequences of ``max_model_len`` tokens.
    ``pipeline_parallel_size``: only 1. ``kv_cache_dtype``: only ``"auto"`` (the KV
    format is fixed by the model). ``trust_remote_code``: accepted; no code from the model directory ever runs.

    Parallelism (issue 28; vLLM's names, :class:`~deepseek_v41.distributed.config.ParallelConfig`):
    ``tensor_parallel_size`` ranks split attention heads, dense / shared-expert / routed-expert intermediate dims and
    the vocabulary; ``enable_expert_parallel`` splits the routed experts whole over them instead
    (``expert_parallel_size``: SGLang's ``--ep-size``, experts over that many ranks with attention replicated);
    ``distributed_executor_backend``: "uni" (one process, the default for one rank), "mp" (worker processes
    spawned here, the default for several; rank 0 runs in this process), "ray" (the workers as Ray actors;
    ``pip install ray``); ``nnodes`` / ``node_rank`` / ``master_addr`` / ``master_port``: several nodes (the
    other nodes run ``dsv41 serve MODEL --headless ...``); ``distributed_timeout_s``: how long a collective may
    wait for a rank. Several ranks need a model path (the workers load it themselves); a worker that dies makes
    the next step raise RuntimeError naming its rank, as does any failed step afterwards (the ranks are out of
    step: build a new LLM); :meth:`shutdown` (or the LLM's collection, or interpreter exit) stops the workers.
    ``data_parallel_size``: only 1 here.

    At start the settings in force (dtype, device, max_model_len, the KV pool allocated and its budget) are logged
    at INFO on the ``deepseek_v41`` logger, as vLLM logs its config. Raises ValueError for a dtype that is none of
    those or a vLLM option with a value it cannot have here (naming it and what is allowed), GenerationConfigError
    (a ValueError) for a ``generation_config.json`` with a value no request may have, TypeError for an unknown
    engine argument.
    """

    def __init__(self, model: str | Path | Any, dtype: str | torch.dtype = "auto", device: str = "cpu",
                 tokenizer: Any | None = None, enforce_eager: bool = True, generation_config: str = "auto",
                 gpu_memory_utilization: float | None = None, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, kv_cache_dtype: str = "auto", trust_remote_code: bool = False,
                 enable_expert_parallel: bool = False, expert_parallel_size: int | None = None,
                 data_parallel_size: int = 1, distributed_executor_backend: str | None = None, nnodes: int = 1,
                 node_rank: int = 0, master_addr: str = "127.0.0.1", master_port: int = 0,
                 distributed_timeout_s: float = 60.0, shard_engram: bool = True, **engine_args: Any):
        for why in (options.check_parallel_size("pipeline_parallel_size", pipeline_parallel_size),
                    options.check_kv_cache_dtype(kv_cache_dtype)):
            if why is not None:
                raise ValueError(why)
        parallel = ParallelConfig(tensor_parallel_size, enable_expert_parallel, expert_parallel_size,
                                  data_parallel_size, distributed_executor_backend, nnodes, node_rank, master_addr,
                                  master_port, False, distributed_timeout_s, shard_engram).validate()
        if parallel.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size {parallel.data_parallel_size}: LLM runs one engine replica; "
                             "give 1 (several replicas are served by dsv41 serve --data-parallel-size)")
        self.parallel_config = parallel
        unknown = set(engine_args) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown engine arguments {sorted(unknown)}; known: "
                            f"{sorted(EngineArgs.__dataclass_fields__)}")
        path = Path(model) if isinstance(model, str | Path) else None
        if parallel.backend != "uni" and engine_args.get("kv_transfer_config") is not None:
            raise ValueError("kv_transfer_config with several ranks is not supported yet: run the prefill and decode "
                             "servers with one rank each (tensor_parallel_size 1)")
        if parallel.backend != "uni" and path is None:
            raise ValueError(f"distributed_executor_backend {parallel.backend!r} needs a model path (each worker "
                             "loads the checkpoint itself), got a model object")
        budget = None  # (the fraction, the budget, free bytes, weight bytes) of gpu_memory_utilization
        if gpu_memory_utilization is not None:
            options.kv_budget_bytes(gpu_memory_utilization, 0, 0)  # the range, before anything is loaded
            if engine_args.get("num_kv_pages") is not None or engine_args.get("kv_cache_memory_bytes") is not None:
                log.warning("gpu_memory_utilization is ignored: num_kv_pages / kv_cache_memory_bytes size the KV "
                            "pool")
            elif path is not None:  # measured before loading, as vLLM profiles free memory
                weights = options.weight_bytes(path, resolve_dtype(dtype, device, path))
                free = options.free_memory_bytes(device)
                budget = (gpu_memory_utilization, options.kv_budget_bytes(gpu_memory_utilization, free, weights),
                          free, weights)
            else:  # a model object's weights are in memory already: the free memory left is the base
                params = next(model.parameters(), None)
                free = options.free_memory_bytes(params.device if params is not None else device)
                budget = (gpu_memory_utilization, options.kv_budget_bytes(gpu_memory_utilization, free, 0), free,
                          options.module_bytes(model))
            if budget is not None:
                engine_args["kv_cache_memory_bytes"] = max(1, budget[1])
        if isinstance(tokenizer, str | Path):  # vLLM's tokenizer=<folder>: its tokenizer.json
            where = tokenizer
            try:
                tokenizer = Tokenizer.from_file(str(where)) if Path(where).is_file() else load_tokenizer(where)
            except Exception as exc:  # tokenizers raises a bare Exception for a file that is not a tokenizer
                raise ValueError(f"tokenizer={str(where)!r} is not a tokenizer.json the tokenizers library reads "
                                 f"({exc})") from exc
            if tokenizer is None:
                raise ValueError(f"tokenizer={str(where)!r}: no tokenizer.json there (give a folder holding "
                                 "tokenizer.json, the file itself, or a tokenizers.Tokenizer)")
        if path is not None:
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
        # "auto" reads the model directory's file; a model object has no directory, so no file, as a directory
        # without one.
        self._sampling_defaults = {} if path is None and generation_config == "auto" else \
            load_sampling_defaults(generation_config, path or Path())[0]
        self.tokenizer = tokenizer
        try:
            if parallel.backend != "uni":  # rank 0 of several: the workers load and build their own ranks
                self.engine = driver.build_driver_engine(path, parallel, resolve_dtype(dtype, device, path), device,
                                                  engine_args, tokenizer)
                self.model = self.engine.model
                self._finalizer = weakref.finalize(self, self.engine.shutdown)
            else:
                args = EngineArgs(**engine_args)
                transfer = args.kv_transfer_config
                # A kv_producer in encoder-only mode loads what the global KV needs only (issue 29).
                only = {"encoder_only": True} if transfer is not None and transfer.encoder_only else {}
                self.model = (load_model(path, dtype=dtype, device=device, **only) if path is not None
                              else model.eval())
                self.engine = LLMEngine(self.model, args, tokenizer, model_path=path)
        except ValueError as exc:
            if budget is None or "kv_cache_memory_bytes=" not in str(exc):
                raise
            raise ValueError(f"{exc} (the budget of gpu_memory_utilization {budget[0]:g}: {budget[1]} bytes of "
                             f"{budget[2]} free, {budget[3]} of weights)") from exc
        self._ids = itertools.count()
        self._log_config(path, budget)

    def _log_config(self, path: Path | None, budget: tuple[float, int, int, int] | None) -> None:
        """One INFO line of the settings in force on the ``deepseek_v41`` logger, and with ``gpu_memory_utilization``
        one of its budget (an upper bound) beside the pool allocated."""
        engine = self.engine
        log.info("LLM: model %s, dtype %s, device %s, max_model_len %d, max_num_seqs %d, %s",
                 path if path is not None else type(self.model).__name__, self.dtype, self.device,
                 engine.max_model_len, engine.args.max_num_seqs, f"KV pool {options.pool_description(engine)}")
        if budget is not None:
            fraction, nbytes, free, weights = budget
            log.info("gpu_memory_utilization %g: KV pool budget %.0f MiB at most (%.0f MiB free, %.0f MiB of "
                     "weights); allocated %s", fraction, nbytes / 2**20, free / 2**20, weights / 2**20,
                     options.pool_description(engine, with_cap=True))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model's floating weights are in (what ``dtype="auto"`` resolved to)."""
        return next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.get_default_dtype())

    @property
    def device(self) -> torch.device:
        """The device the model runs on."""
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))

    def get_tokenizer(self) -> Any:
        """The tokenizer prompts are encoded with (a ``tokenizers.Tokenizer``: ``encode(text).ids``,
        ``decode(ids)``), as vLLM's ``LLM.get_tokenizer()``; None when the model directory has no tokenizer.json."""
        return self.tokenizer

    def _token_ids(self, ids: Any) -> list[int]:
        """``prompt_token_ids`` as a list of Python ints: a sequence (list, tuple, 1-D tensor or array) of Python
        ints or numpy / torch integer scalars. Raises ValueError naming the first value that is not one (a float,
        a bool, a string, ...); the range ``[0, vocab_size)`` is checked at admission
        (:meth:`LLMEngine.add_request`)."""
        vocab = self.engine.config.vocab_size
        if isinstance(ids, str | bytes | dict) or not hasattr(ids, "__iter__"):
            raise ValueError(f"prompt_token_ids must be a list of integers in [0, {vocab}), got "
                             f"{type(ids).__name__} {ids!r}")
        out = []
        for position, value in enumerate(ids):
            if not _is_integer(value):
                raise ValueError(f"prompt_token_ids[{position}] is {type(value).__name__} {value!r}: token ids are "
                                 f"integers in [0, {vocab}) (Python, numpy or torch integers; not bool or float)")
            out.append(int(value))
        return out

    def prompt_inputs(self, prompt: str | dict, add_special_tokens: bool = True
                    ) -> tuple[str | None, list[int], dict | None]:
        """``(text, token ids, multi_modal_data)`` of one prompt as :meth:`generate` takes it (what
        ``LLMEngine.add_request`` gets). A text prompt with images is tokenized around its image placeholders
        (``<｜deepseek_image｜>`` or ``<｜image2｜>``), each becoming one ``image_token_id``; the engine expands them.
        Raises ValueError for a prompt :meth:`generate` refuses."""
        images = None
        if isinstance(prompt, dict):  # vLLM's TokensPrompt / TextPrompt
            if "prompt_token_ids" not in prompt and not isinstance(prompt.get("prompt"), str):
                raise ValueError("a dict prompt needs 'prompt_token_ids' (a list of ids) or 'prompt' (a string)")
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data", "cache_salt"}
            if unknown:
                raise ValueError(f"unknown prompt keys {sorted(unknown)}; a dict prompt takes 'prompt' or "
                                 f"'prompt_token_ids', and optionally 'multi_modal_data' and 'cache_salt'")
            images = self._multi_modal_data(prompt.get("multi_modal_data"))
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._token_ids(prompt["prompt_token_ids"]), images
            prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer.json: give prompts as "
                             "{'prompt_token_ids': [...]}")
        if images is None:
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids, None
        first, *rest = split_at_placeholders(prompt)
        ids = list(self.tokenizer.encode(first, add_special_tokens=add_special_tokens).ids)
        for piece in rest:
            ids.append(self.engine.config.image_token_id)
            ids += self.tokenizer.encode(piece, add_special_tokens=False).ids
        return prompt, ids, images

    def _multi_modal_data(self, data: Any) -> dict | None:
        """vLLM's ``multi_modal_data``: ``{"image": image or [images]}`` (PIL images, encoded bytes, uint8 RGB arrays
        or ``ProcessedImage``) -> ``{"image": [...]}``; None when absent or without images. ValueError for other
        keys (this model takes images only) or a model without a vision tower."""
        if data is None:
            return None
        if not isinstance(data, dict):
            raise ValueError(f"multi_modal_data must be a dict such as {{'image': [PIL.Image, ...]}}, got "
                             f"{type(data).__name__}")
        unknown = set(data) - {"image"}
        if unknown:
            raise ValueError(f"multi_modal_data keys {sorted(unknown)}: this model takes images only ('image')")
        images = data.get("image")
        images = list(images) if isinstance(images, list | tuple) else [] if images is None else [images]
        if images and self.engine.config.vision_config is None:
            raise ValueError("this model has no vision tower (no vision_config in its config), so it takes text "
                             "only; give the prompt without multi_modal_data")
        return {"image": images} if images else None

    def get_default_sampling_params(self) -> SamplingParams:
        """The ``SamplingParams`` a call without any gets, as vLLM's: its defaults with those of the checkpoint's
        ``generation_config.json`` on top (temperature, top_p, top_k, min_p, repetition_penalty, and
        max_new_tokens as ``max_tokens``; see :mod:`deepseek_v41.engine.generation_config`). A new object each
        call; without a file (or with ``generation_config="vllm"``), plain ``SamplingParams()``."""
        return SamplingParams(**self._sampling_defaults)

    def generate(self, prompts: str | dict | list, sampling_params: SamplingParams | list | None = None,
                 use_tqdm: bool | Callable[..., Any] = True, add_special_tokens: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (a string, ``{"prompt_token_ids": [...]}`` or ``{"prompt": "..."}`` — either
        optionally with ``"cache_salt"``, which keeps its prefix-cache entries apart from other salts, and with
        ``"multi_modal_data": {"image": [...]}`` as vLLM takes it — or a list of them); outputs in prompt order.

        Images (a model with a vision tower): PIL images (any mode), encoded image bytes, uint8 RGB arrays
        [height, width, 3] or preprocessed ``ProcessedImage``; one per image placeholder of the prompt, in order
        (a text prompt writes ``<｜deepseek_image｜>`` or ``<｜image2｜>`` where each image goes; ``prompt_token_ids``
        hold ``image_token_id`` there). The engine expands each placeholder into the image's span.
        ``sampling_params`` is one for all or one per prompt (default: :meth:`get_default_sampling_params`; given
        ones are used as they are).

        ``use_tqdm``: vLLM's "Processed prompts" progress bar on stderr, shown only when stderr is a terminal
        (tqdm's ``disable=None``), so logs and pipes stay clean; False hides it; a callable (e.g. a ``tqdm``
        subclass or ``functools.partial(tqdm, ...)``) is called with the bar's keyword arguments instead.

        Raises ValueError for bad prompts or parameters (token ids that are not integers in ``[0, vocab_size)``, a
        ``cache_salt`` that is not a non-empty string, ``logprobs`` above ``vocab_size``, an unknown prompt key,
        images for a model without a vision tower or not one per placeholder, ...) before anything runs.
        Any exception out of an engine step (KeyboardInterrupt included) aborts all of this call's requests, their
        pages and slots freed, and is re-raised: the LLM stays usable."""
        single = isinstance(prompts, str | dict)
        prompts = [prompts] if single else list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [
            sampling_params if sampling_params is not None else self.get_default_sampling_params()]
        if len(params) == 1:
            params = params * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        encoded = [self.prompt_inputs(p, add_special_tokens) for p in prompts]
        ids: list[str] = []
        try:  # a request failing admission, or a step failing, takes this call's requests out of the engine
            for prompt, (text, tokens, images), p in zip(prompts, encoded, params, strict=True):
                rid = str(next(self._ids))
                salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                extra = {"multi_modal_data": images} if images else {}  # a text prompt takes the text path as is
                self.engine.add_request(rid, tokens, p, prompt=text, cache_salt=salt, **extra)
                ids.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:  # KeyboardInterrupt too: the LLM must stay usable after Ctrl-C
            self._abort(ids)
            raise

    def chat(self, messages: list | list[list], sampling_params: SamplingParams | list | None = None,
             tools: list | None = None, thinking: bool = False, reasoning_effort: Any = None,
             drop_thinking: bool = True, use_tqdm: bool | Callable[..., Any] = True,
             chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tool_choice: str | dict[str, Any] | None = None
             ) -> list[RequestOutput]:
        """Render each conversation with the official encoder (:func:`deepseek_v41.chat.encode_messages`) and
        generate. ``messages`` is one conversation (a list of messages) or a list of conversations;
        ``sampling_params`` (one for all or one per conversation) and ``use_tqdm`` as in :meth:`generate`.
        Image parts (a model with a vision tower) go to the model in prompt order: ``image_url`` / ``input_image``
        with a data URL or a ``file://`` URL (read here), vLLM's ``{"type": "image_pil", "image_pil": image}``;
        http(s) URLs are not fetched in-process (ValueError: pass the image instead).

        vLLM's keyword arguments, with the server's meaning (``/v1/chat/completions``): ``chat_template_kwargs``
        may set ``thinking`` / ``enable_thinking`` (bools, thinking mode), ``drop_thinking`` (bool) and
        ``reasoning_effort`` (as the argument); a key given there wins over the argument of the same meaning.
        ``continue_final_message=True`` leaves the last message (an assistant one) open for the model to continue;
        ``add_generation_prompt=False`` is only served with it (the encoder always opens the assistant turn
        otherwise).

        ``tools`` (OpenAI function tools) and ``tool_choice`` as the server maps them
        (:mod:`deepseek_v41.structured.tool_choice`): None is "auto" with tools and "none" without; "auto" renders
        the tools and constrains a tool block only once the model opens one (free text otherwise); "required" and
        ``{"type": "function", "function": {"name": ...}}`` constrain the answer (after free reasoning in thinking
        mode) to one DSML block of calls (one call of that function) whose arguments are valid under each tool's
        ``parameters`` schema; "none" does not render the tools and returns no calls. The constraint is set on a
        copy of each ``SamplingParams``; a given ``structured_outputs`` wins over "auto" and cannot be combined
        with "required" / named. Every output's ``message`` is the OpenAI assistant message the server returns
        (``content``, ``reasoning_content`` in thinking mode, ``tool_calls`` with JSON ``arguments``), parsed from
        its tokens with special tokens kept (:func:`deepseek_v41.chat.assistant_message`).

        Raises ValueError naming the key or argument for anything else (a ``tool_choice`` that is none of those
        or names a function not in ``tools``, "required" without tools, a tool whose grammar cannot be built)."""
        kwargs = dict(chat_template_kwargs or {})
        unknown = set(kwargs) - set(CHAT_TEMPLATE_KWARGS)
        if unknown:
            raise ValueError(f"unknown chat_template_kwargs keys {sorted(unknown)}; known: "
                             f"{list(CHAT_TEMPLATE_KWARGS)}")
        for key in ("thinking", "enable_thinking", "drop_thinking"):
            if key in kwargs and not isinstance(kwargs[key], bool):
                raise ValueError(f"chat_template_kwargs[{key!r}] must be True or False, got {kwargs[key]!r}")
        thinking = kwargs.get("enable_thinking", kwargs.get("thinking", thinking))
        drop_thinking = kwargs.get("drop_thinking", drop_thinking)
        reasoning_effort = kwargs.get("reasoning_effort", reasoning_effort)
        if not add_generation_prompt and not continue_final_message:
            raise ValueError("add_generation_prompt=False is only supported with continue_final_message=True: the "
                             "V4.1 encoder always opens the assistant turn after the last message")
        mode, name = resolve_tool_choice(tools, tool_choice)
        if continue_final_message and mode in ("required", "named"):
            raise ValueError(f"tool_choice {tool_choice!r} constrains the whole answer, which "
                             "continue_final_message does not start; drop one of them")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if continue_final_message:
            for i, conversation in enumerate(conversations):
                if not conversation or conversation[-1].get("role") != "assistant":
                    raise ValueError(f"continue_final_message needs an assistant message last (conversation {i})")
            conversations = [[*c[:-1], {**c[-1], "wo_eos": True}] for c in conversations]
        # A continued answer starts mid-turn, where no grammar starts: "auto" then runs free (as the server does).
        tag = None if continue_final_message else tool_choice_tag(tools, mode, name, thinking=thinking)
        params = self._with_tool_grammar(sampling_params, len(conversations), tag, mode)
        prompts = []
        for conversation in conversations:
            text, sources = render_messages(conversation, tools=tools if mode != "none" else None, thinking=thinking,
                                            reasoning_effort=reasoning_effort, drop_thinking=drop_thinking)
            images = [read_offline(source, MAX_IMAGE_BYTES) for source in sources]
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}} if images else text)
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm, add_special_tokens=False)
        for output in outputs:
            for completion in output.outputs:
                text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=False)
                completion.message = assistant_message(text, thinking and not continue_final_message,
                                                       tools_active=mode != "none")
        return outputs

    def _with_tool_grammar(self, sampling_params: SamplingParams | list | None, count: int, tag: str | None,
                           mode: str) -> SamplingParams | list | None:
        """``sampling_params`` with the tool-call structural ``tag`` (None: unchanged) on a copy of each: one per
        conversation. A given ``structured_outputs`` wins over "auto"; with "required" / named it is an error."""
        if tag is None:
            return sampling_params
        given = sampling_params if isinstance(sampling_params, list) else [
            sampling_params if sampling_params is not None else self.get_default_sampling_params()] * count
        out = []
        for p in given:
            if p.structured_outputs is not None:
                if mode != "auto":
                    raise ValueError(f"tool_choice {mode!r} constrains the answer to a tool call, so it cannot be "
                                     "combined with sampling_params.structured_outputs; use tool_choice 'auto' or "
                                     "'none'")
                out.append(p)
            else:
                out.append(dataclasses.replace(p, structured_outputs=StructuredOutputsParams(structural_tag=tag)))
        return out

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        engine = self.engine
        done: dict[str, RequestOutput] = {}
        progress = _progress_bar(use_tqdm, len(request_ids))
        prompt_tokens = output_tokens = 0
        start = time.perf_counter()
        try:
            mine = set(request_ids)
            while len(done) < len(request_ids):
                for rid in engine.step_request_ids():  # (only the finished ones' outputs are built)
                    if rid in mine and rid not in done and engine.request_finished(rid):
                        output = done[rid] = engine.request_output(rid)
                        engine.release(rid)
                        if progress is not None:
                            prompt_tokens += len(output.prompt_token_ids)
                            output_tokens += sum(len(c.token_ids) for c in output.outputs)
                            seconds = max(time.perf_counter() - start, 1e-9)
                            progress.set_postfix_str(f"est. speed input: {prompt_tokens / seconds:.2f} toks/s, "
                                                     f"output: {output_tokens / seconds:.2f} toks/s", refresh=False)
                            progress.update(1)
        finally:
            if progress is not None:
                progress.close()
        if engine.prefix_cache is not None:
            engine.prefix_cache.flush()  # pages on their way to disk are there when generate returns
        return [done[r] for r in request_ids]

    def _abort(self, request_ids: list[str]) -> None:
        """Abort and forget ``request_ids`` (finished ones are only forgotten): their pages and slots return to
        the pool and nothing of them stays in the scheduler, so the next call starts from a clean engine."""
        for rid in request_ids:
            self.engine.abort_request(rid)
            self.engine.release(rid)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the cached prefixes of this process (vLLM's ``LLM.reset_prefix_cache``; see
        :meth:`LLMEngine.reset_prefix_cache`): True when reset, False while requests hold KV pages (unless
        ``reset_running_requests``: they are preempted and recompute). After
        changing the model's weights in place, reinstall the CPU fast paths
        (``deepseek_v41.kernels.fast.install(llm.engine.model)``) and reset; the disk and Redis tiers are kept
        (keyed by the checkpoint's fingerprint taken at load): use a new ``LLM`` for them."""
        return self.engine.reset_prefix_cache(reset_running_requests)

    @property
    def stats(self) -> dict[str, Any]:
        return self.engine.stats

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel engine (also done when the LLM is collected and at interpreter
        exit); the LLM cannot generate afterwards. One process: nothing to do."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int) -> Any:
    """vLLM's "Processed prompts" bar for ``total`` requests, or None: ``use_tqdm`` False gives none, True a
    ``tqdm`` that disables itself when stderr is not a terminal (``disable=None``), a callable its own bar."""
    if not use_tqdm:
        return None
    kwargs = {"total": total, "desc": "Processed prompts", "dynamic_ncols": True,
              "postfix": "est. speed input: 0.00 toks/s, output: 0.00 toks/s"}
    if callable(use_tqdm):
        return use_tqdm(**kwargs)
    from tqdm import tqdm

    bar = tqdm(**kwargs, disable=None)
    return None if bar.disable else bar


def _is_integer(value: Any) -> bool:
    """True for a Python int and a numpy or torch integer scalar; False for bools, floats and everything else."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int | np.integer):
        return True
    return isinstance(value, torch.Tensor) and value.dim() == 0 and not value.dtype.is_floating_point \
        and not value.dtype.is_complex and value.dtype is not torch.bool
