"""Prometheus metrics (vLLM's names under ``dsv41:``) and the periodic throughput log line.

:class:`ServerMetrics` is an observer of :class:`~deepseek_v41.engine.async_engine.AsyncLLMEngine`: it sees
every step's outputs and the engine's stats snapshot. Counters and histograms are updated per step; gauges are
read from the latest snapshot at scrape time. Each server has its own registry (several servers can live in one
process, as in the tests).

Names (``model_name`` label on all): ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
``e2e_request_latency_seconds`` (histograms); ``request_success_total{finished_reason}``, ``prompt_tokens_total``,
``prompt_tokens_cached_total``, ``prompt_tokens_replayed_total``, ``generation_tokens_total``,
``num_preemptions_total``, ``spec_decode_num_drafts_total``, ``spec_decode_num_accepted_tokens_per_pos_total``
(counters); ``num_requests_running``, ``num_requests_waiting``, ``kv_pages_used``, ``kv_pages_total``,
``kv_cache_usage_perc``, ``kv_cache_bytes{kind}``, ``swa_pool_occupancy`` (gauges).

Prefix caching (SPEC.md §4.3), as vLLM counts it in tokens: ``prefix_cache_queries_total`` (prompt tokens looked
up) and ``prefix_cache_hits_total{path}`` (prompt tokens served from the cache, by how the window state was
rebuilt: ``snapshot`` = restored from the SWA pool, ``replay`` = recomputed by replay); from the engine's own
counters ``prefix_cache_page_hits_total{tier}`` (pages shared on the ``device``, loaded from ``disk`` or from
``remote`` = Redis), ``prefix_cache_pages_written_total{tier="disk"|"remote"}``,
``swa_pool_snapshots_total{event="hit"|"written"}``, ``swa_pool_evictions_total``;
``prefix_cache_read_bytes_total{tier}`` and ``prefix_cache_read_seconds_total{tier}``
(what the hits read and how long the reads took: ``disk`` = page files read and decoded, ``swa_pool`` = snapshots
copied out of the host pool, ``remote`` = Redis GET and decode of pages, and of snapshots when Redis is the pool;
their rates' ratio is a tier's read bandwidth); gauges ``swa_pool_used_bytes``, ``swa_pool_capacity_bytes``,
``swa_pool_occupancy`` (used / capacity, 0..1; 0 without a pool or with the Redis pool, which has no capacity)
and ``prefix_cache_disk_bytes``. Replay (per request whose hit rebuilt the window state by replaying, having no
SWA snapshot): ``prefix_cache_replays_total`` (such requests), ``prompt_tokens_replayed_total`` (their replayed
tokens) and the histogram ``prefix_cache_replay_tokens`` (tokens replayed per such hit: at most the window with
bounded replay).
Per finished request, as vLLM (histograms): ``request_queue_time_seconds`` (arrival -> first scheduled),
``request_prefill_time_seconds`` (first scheduled -> first token), ``request_decode_time_seconds`` (first token ->
last), ``request_inference_time_seconds`` (first scheduled -> last), ``request_prompt_tokens``,
``request_generation_tokens`` (all samples of the request); ``request_params_max_tokens`` (once per request when
it starts, whatever its ``n``: a request with ``n > 1`` is one observation of every phase and size histogram);
``iteration_tokens_total`` (tokens the model computed per engine step: the largest per-layer count, so prefill
chunks, replay and speculative verification included; when one observer call spans several steps, their tokens
are spread evenly over them). ``cache_config_info`` (gauge 1) carries the KV cache settings as
labels (vLLM's ``block_size``, ``num_gpu_blocks``, ``cache_dtype``, ``enable_prefix_caching``, and ``replay``).
Images: ``encoder_cache_hits_total`` and ``encoder_cache_misses_total`` (counters, per image a prefill chunk
needed: its aligner rows came from the encoder cache, or the vision tower encoded it; 0 for a text-only model).
Source: SPEC.md §4.6; vLLM ``vllm/v1/metrics/loggers.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from deepseek_v41.cache.prefix_cache import READ_TIERS
from deepseek_v41.engine.async_engine import AsyncLLMEngine, StepOutput

logger = logging.getLogger("deepseek_v41.server")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
_PHASE_BUCKETS = _E2E_BUCKETS  # vLLM uses its request-latency buckets for the queue / prefill / decode phases
FINISH_REASONS = ("stop", "length", "abort")
PREFIX_HIT_PATHS = ("snapshot", "replay")


class ServerMetrics:
    """Prometheus metrics of one server. ``registry`` is what ``/metrics`` exposes.

    Args:
        engine: the async engine to observe (registers itself as an observer).
        model_name: the ``model_name`` label (the first served name).
        spec_positions: how many draft positions the acceptance counters have (the config's
            ``dspark_block_size``); they stay 0 when the engine runs without ``--speculative``.
    """

    def __init__(self, engine: AsyncLLMEngine, model_name: str, spec_positions: int = 0):
        self.engine, self.model_name, self.spec_positions = engine, model_name, spec_positions
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry
        self.ttft = Histogram("dsv41:time_to_first_token_seconds", "Time from arrival to the first output token, "
                              "seconds.", labels, buckets=_TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("dsv41:inter_token_latency_seconds", "Time between two output tokens of a request, "
                             "seconds.", labels, buckets=_ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("dsv41:e2e_request_latency_seconds", "Time from arrival to the last output, seconds.",
                             labels, buckets=_E2E_BUCKETS, registry=reg).labels(model_name)
        success = Counter("dsv41:request_success", "Finished requests (samples) by finish reason.",
                          labels + ["finished_reason"], registry=reg)
        self.finished = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.prompt_tokens = Counter("dsv41:prompt_tokens", "Prompt tokens of requests that started generating.",
                                     labels, registry=reg).labels(model_name)
        self.cached_tokens = Counter("dsv41:prompt_tokens_cached", "Prompt tokens served from the prefix cache.",
                                     labels,
                                     registry=reg).labels(model_name)
        self.replayed_tokens = Counter("dsv41:prompt_tokens_replayed", "Prompt tokens recomputed by bounded replay "
                                       "after a prefix-cache hit.", labels,
                                       registry=reg).labels(model_name)
        self.generation_tokens = Counter("dsv41:generation_tokens", "Generated tokens.", labels,
                                         registry=reg).labels(model_name)
        self.prefix_caching = getattr(engine.engine, "prefix_cache", None) is not None
        self.prefix_queries = Counter("dsv41:prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "(0 with prefix caching off).", labels, registry=reg).labels(model_name)
        hits = Counter("dsv41:prefix_cache_hits", "Prompt tokens served from the prefix cache, by how the window "
                       "state was rebuilt: snapshot (restored from the SWA pool) or replay (recomputed).",
                       labels + ["path"], registry=reg)
        self.prefix_hits = {path: hits.labels(model_name, path) for path in PREFIX_HIT_PATHS}
        self.replays = Counter("dsv41:prefix_cache_replays", "Prefix-cache hits whose window state was rebuilt by "
                               "replay (no SWA snapshot), one per request.", labels, registry=reg).labels(model_name)
        self.transfer_request_bytes = Histogram(
            "dsv41:kv_transfer_request_bytes", "KV bytes a request moved through the KV connector (disaggregated "
            "serving: written by a prefill server, read by a decode server).", labels,
            buckets=[float(2**k) for k in range(10, 36, 2)], registry=reg).labels(model_name)
        self.replay_tokens = Histogram("dsv41:prefix_cache_replay_tokens", "Tokens recomputed by replay per "
                                       "prefix-cache hit that replayed (bounded by the window with bounded replay).",
                                       labels, buckets=_powers_of_two(engine.max_model_len),
                                       registry=reg).labels(model_name)
        self._request_histograms(reg, labels)
        reg.register(_EngineCollector(self))
        self._last_token: dict[str, float] = {}
        self.interval = _Interval()
        engine.add_observer(self.observe)

    def _request_histograms(self, reg: CollectorRegistry, labels: list[str]) -> None:
        """vLLM's per-request phase and size histograms and ``iteration_tokens_total``."""
        name = self.model_name
        args = self.engine.engine.args
        max_len = self.engine.max_model_len

        def histogram(metric: str, doc: str, buckets) -> Any:
            return Histogram(metric, doc, labels, buckets=buckets, registry=reg).labels(name)

        self.queue_time = histogram("dsv41:request_queue_time_seconds", "Time a request waited before it was first "
                                    "scheduled, seconds.", _PHASE_BUCKETS)
        self.prefill_time = histogram("dsv41:request_prefill_time_seconds", "Time from a request's first "
                                      "scheduling to its first token, seconds.", _PHASE_BUCKETS)
        self.decode_time = histogram("dsv41:request_decode_time_seconds", "Time from a request's first token to "
                                     "its last, seconds.", _PHASE_BUCKETS)
        self.inference_time = histogram("dsv41:request_inference_time_seconds", "Time from a request's first "
                                        "scheduling to its last token, seconds.", _PHASE_BUCKETS)
        sizes = _one_two_five(max_len)
        self.request_prompt_tokens = histogram("dsv41:request_prompt_tokens", "Prompt tokens of finished "
                                               "requests.", sizes)
        self.request_generation_tokens = histogram("dsv41:request_generation_tokens", "Generated tokens of "
                                                   "finished requests (all samples).", sizes)
        self.request_max_tokens = histogram("dsv41:request_params_max_tokens", "The max_tokens of each request "
                                            "when it starts.", sizes)
        self.iteration_tokens = histogram("dsv41:iteration_tokens_total", "Tokens the model computed per engine "
                                          "step (prefill chunks, decode, replay and verification).",
                                          _powers_of_two(args.max_num_batched_tokens))
        start = self.engine.stats  # the counts before this server's first step
        self._last_layer_tokens: list[int] | None = list(start["layer_tokens"]) if "layer_tokens" in start else None
        self._last_steps = start.get("num_steps", 0)

    def request_started(self, max_tokens: int) -> None:
        """Record a request's ``max_tokens`` once, whatever its ``n`` (the server calls it once the engine took the
        request), as the phase and size histograms count a request with ``n > 1`` once."""
        self.request_max_tokens.observe(max_tokens)

    def _observe_iterations(self, stats: dict[str, Any]) -> None:
        """``iteration_tokens_total`` from the growth of the per-layer token counts since the last call."""
        layers, steps = stats.get("layer_tokens"), stats.get("num_steps")
        if layers is None or steps is None:
            return
        if self._last_layer_tokens is not None and steps > self._last_steps:
            tokens = max((now - before for now, before in zip(layers, self._last_layer_tokens, strict=False)),
                         default=0)
            count = steps - self._last_steps
            for _ in range(min(count, 1024)):  # bounded work however long the loop slept
                self.iteration_tokens.observe(tokens / count)
        self._last_layer_tokens, self._last_steps = list(layers), steps

    def _observe_finished(self, out: Any, end: float) -> None:
        """The phase and size histograms of a finished request (phases it never reached are not observed)."""
        m = out.metrics
        last = m.finished_time or end
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            self.inference_time.observe(max(0.0, last - m.first_scheduled_time))
            if m.first_token_time is not None:
                self.prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        if m.first_token_time is not None:
            self.decode_time.observe(max(0.0, last - m.first_token_time))
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(sum(len(c.token_ids) for c in out.outputs))
        transfer = out.kv_transfer_params
        if isinstance(transfer, dict) and transfer.get("transfer_bytes"):
            self.transfer_request_bytes.observe(transfer["transfer_bytes"])
            if transfer.get("do_remote_prefill"):  # a prefill-only request: its prompt counts, no token follows
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.cached_tokens.inc(out.num_cached_tokens)
                self.interval.prompt_tokens += len(out.prompt_token_ids) - out.num_cached_tokens

    def observe(self, outputs: list[StepOutput], stats: dict[str, Any]) -> None:
        """Update counters and histograms from one step's outputs (called by the engine loop)."""
        self._observe_iterations(stats)
        for step in outputs:
            out = step.output
            new = sum(len(ids) for ids in step.delta_token_ids)
            arrival = out.metrics.arrival_time
            if new:
                last = self._last_token.get(step.request_id)
                if last is None:
                    self.ttft.observe(max(0.0, step.time - arrival))
                    computed = len(out.prompt_token_ids) - out.num_cached_tokens
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                    self.cached_tokens.inc(out.num_cached_tokens)
                    replayed = getattr(out, "num_replayed_tokens", 0)
                    self.replayed_tokens.inc(replayed)
                    if self.prefix_caching:
                        self.prefix_queries.inc(len(out.prompt_token_ids))
                    if out.num_cached_tokens:  # a snapshot hit replays nothing; a hit without one replays
                        self.prefix_hits["replay" if replayed else "snapshot"].inc(out.num_cached_tokens)
                    if replayed:
                        self.replays.inc()
                        self.replay_tokens.observe(replayed)
                    self.interval.prompt_tokens += computed
                else:
                    self.itl.observe(max(0.0, step.time - last) / max(1, max(len(i) for i in step.delta_token_ids)))
                self._last_token[step.request_id] = step.time
                self.generation_tokens.inc(new)
                self.interval.generation_tokens += new
            for reason in step.finish_reasons:
                if reason is not None:
                    self.finished[reason if reason in self.finished else "stop"].inc()
            if step.finished:
                self.e2e.observe(max(0.0, step.time - arrival))
                self._observe_finished(out, step.time)
                self._last_token.pop(step.request_id, None)

    def log_throughput(self) -> str | None:
        """The periodic line (vLLM's ``LoggingStatLogger``), or None when nothing happened since the last one."""
        stats = self.engine.stats
        line = self.interval.line(stats)
        if line is not None:
            logger.info(line)
        return line


def _one_two_five(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's ``build_1_2_5_buckets``)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


def _powers_of_two(limit: int) -> list[float]:
    """1, 2, 4, ... below ``limit``, then ``limit`` (the largest step the scheduler builds, drafts aside)."""
    out, value = [], 1
    while value < limit:
        out.append(float(value))
        value *= 2
    return [*out, float(limit)]


class _Interval:
    """Token counts since the last throughput line."""

    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.start = time.monotonic()
        self._idle_logged = False

    def line(self, stats: dict[str, Any]) -> str | None:
        now = time.monotonic()
        elapsed = max(1e-9, now - self.start)
        busy = self.prompt_tokens or self.generation_tokens or stats["num_running"] or stats["num_waiting"]
        if not busy and self._idle_logged:
            self.start = now
            return None
        self._idle_logged = not busy
        total = max(1, stats["kv_pages_total"])
        line = (f"Avg prompt throughput: {self.prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self.generation_tokens / elapsed:.1f} tokens/s, "
                f"Running: {stats['num_running']} reqs, Waiting: {stats['num_waiting']} reqs, "
                f"KV pages used: {100.0 * stats['kv_pages_used'] / total:.1f}%, "
                f"Preemptions: {stats['num_preemptions']}")
        self.prompt_tokens = self.generation_tokens = 0
        self.start = now
        return line


class _EngineCollector:
    """Gauges (and engine-owned counters) read from the engine's stats snapshot at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        stats = m.engine.stats
        name = m.model_name

        def gauge(metric: str, doc: str, value: float, **labels: str):
            family = GaugeMetricFamily(metric, doc, labels=["model_name", *labels])
            family.add_metric([name, *labels.values()], value)
            return family

        args = m.engine.engine.args
        info = GaugeMetricFamily("dsv41:cache_config_info", "KV cache settings (labels); the value is 1.",
                                 labels=["model_name", "block_size", "num_gpu_blocks", "cache_dtype",
                                         "enable_prefix_caching", "replay"])
        info.add_metric([name, str(args.block_size), str(stats["kv_pages_total"]), "auto",
                         str(m.prefix_caching), args.replay], 1.0)
        yield info
        yield gauge("dsv41:num_requests_running", "Sequences in the running batch.", stats["num_running"])
        yield gauge("dsv41:num_requests_waiting", "Sequences waiting to be scheduled.", stats["num_waiting"])
        yield gauge("dsv41:kv_pages_used", "KV pages in use (global KV pool, the null page excluded).",
                    stats["kv_pages_used"])
        yield gauge("dsv41:kv_pages_total", "KV pages in the global pool.", stats["kv_pages_total"])
        yield gauge("dsv41:kv_cache_usage_perc", "Fraction of KV pages in use, 0..1.",
                    stats["kv_pages_used"] / max(1, stats["kv_pages_total"]))
        window = stats["window_bytes_per_sequence_allocated"]
        by_kind = GaugeMetricFamily("dsv41:kv_cache_bytes", "Cache bytes allocated by kind: global = the paged "
                                    "pool (main KV + index keys), window = the per-sequence window rings.",
                                    labels=["model_name", "kind"])
        by_kind.add_metric([name, "global"], stats["kv_global_bytes"])
        by_kind.add_metric([name, "window"], window * m.engine.engine.args.max_num_seqs)
        yield by_kind
        in_use = GaugeMetricFamily("dsv41:kv_cache_used_bytes", "Cache bytes held by live sequences, by kind.",
                                   labels=["model_name", "kind"])
        pages_total = max(1, stats["kv_pages_total"])
        in_use.add_metric([name, "global"], stats["kv_global_bytes"] * stats["kv_pages_used"] / (pages_total + 1))
        in_use.add_metric([name, "window"], window * stats["num_running"])
        yield in_use
        yield from self._prefix_cache(stats, gauge)
        preemptions = CounterMetricFamily("dsv41:num_preemptions", "Sequences preempted (recomputed later).",
                                          labels=["model_name"])
        preemptions.add_metric([name], stats["num_preemptions"])
        yield preemptions
        yield from self._kv_transfer(stats, name)
        encoder = stats.get("encoder_cache") or {}
        for key, doc in (("hits", "Images whose aligner rows came from the encoder cache (not encoded again)."),
                         ("misses", "Images the encoder cache did not hold, encoded by the vision tower.")):
            family = CounterMetricFamily(f"dsv41:encoder_cache_{key}", doc, labels=["model_name"])
            family.add_metric([name], encoder.get(key, 0))
            yield family
        yield from ec_metric_families(name, encoder.get("ec_transfer"))
        for key, doc in (("num_drafts", "Speculative draft blocks verified (one per sequence and step)."),
                         ("num_draft_tokens", "Draft tokens verified by the target."),
                         ("num_accepted_tokens", "Draft tokens accepted (bonus tokens not counted)."),
                         ("num_plain_steps", "Sequence-steps the adaptive DSpark scheduler ran as plain decode "
                                             "steps (no draft forward).")):
            family = CounterMetricFamily(f"dsv41:spec_decode_{key}", doc, labels=["model_name"])
            family.add_metric([name], stats.get(f"spec_decode_{key}", 0))
            yield family
        lengths = CounterMetricFamily("dsv41:spec_decode_verify_length", "Sequence-steps by the number of drafts "
                                      "verified: length 0 counts plain decode steps and speculative steps that "
                                      "verified nothing.",
                                      labels=["model_name", "length"])
        for length, count in enumerate(stats.get("spec_decode_verify_lengths", [])):
            lengths.add_metric([name, str(length)], count)
        yield lengths
        accepted = CounterMetricFamily("dsv41:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at "
                                       "each draft position.",
                                       labels=["model_name", "position"])
        per_pos = list(stats.get("spec_decode_num_accepted_tokens_per_pos", []))
        for pos in range(max(m.spec_positions, len(per_pos))):
            accepted.add_metric([name, str(pos)], per_pos[pos] if pos < len(per_pos) else 0)
        yield accepted

    @staticmethod
    def _kv_transfer(stats: dict[str, Any], name: str):
        """``dsv41:kv_transfer_*`` by direction (sent = pages a prefill server wrote to its KV connector, received =
        pages a decode server read): KV payload bytes, pages, the prompt tokens those pages hold (bytes / tokens =
        KV bytes per token) and seconds in the connector's calls. Zero without a --kv-transfer-config."""
        transfer = stats.get("kv_transfer") or {}
        for key, doc in (("bytes", "KV bytes (page payload, without file headers) moved through the KV connector."),
                         ("pages", "KV pages moved through the KV connector."),
                         ("prompt_tokens", "Prompt tokens whose KV pages moved through the KV connector."),
                         ("seconds", "Seconds spent in the KV connector's put (sent) and get (received) calls.")):
            family = CounterMetricFamily(f"dsv41:kv_transfer_{key}", doc, labels=["model_name", "direction"])
            for direction in ("sent", "received"):
                values = transfer.get(direction) or {}
                family.add_metric([name, direction], values.get("tokens" if key == "prompt_tokens" else key, 0))
            yield family

    def _prefix_cache(self, stats: dict[str, Any], gauge):
        """The engine-owned prefix-cache metrics (all 0 with prefix caching off)."""
        name = self.metrics.model_name
        pc = stats.get("prefix_cache") or {}

        def counter(metric: str, doc: str, label: str, values: dict[str, float]):
            family = CounterMetricFamily(metric, doc, labels=["model_name", label])
            for key, value in values.items():
                family.add_metric([name, key], value)
            return family

        remote = pc.get("remote") or {}
        read_bytes, read_seconds = pc.get("read_bytes") or {}, pc.get("read_seconds") or {}
        yield counter("dsv41:prefix_cache_read_bytes", "Bytes the prefix cache read on hits, by tier: disk = page "
                      "files, swa_pool = SWA snapshots copied out of the host pool, remote = Redis values (pages, "
                      "and snapshots with Redis as the pool).", "tier",
                      {tier: read_bytes.get(tier, 0) for tier in READ_TIERS})
        yield counter("dsv41:prefix_cache_read_seconds", "Seconds the prefix cache spent on those reads (read and "
                      "decode; the copy for swa_pool), by tier: bytes / seconds is the read bandwidth.", "tier",
                      {tier: read_seconds.get(tier, 0.0) for tier in READ_TIERS})
        yield counter("dsv41:prefix_cache_page_hits", "Pages of matched prefixes by tier: device = shared from the "
                      "KV pool, disk = loaded from the persistent store, remote = loaded from Redis.", "tier",
                      {"device": pc.get("device_pages_hit", 0), "disk": pc.get("disk_pages_read", 0),
                       "remote": pc.get("remote_pages_read", 0)})
        yield counter("dsv41:prefix_cache_pages_written", "Pages written to the persistent store (disk) and to "
                      "Redis (remote).", "tier",
                      {"disk": pc.get("disk_pages_written", 0), "remote": remote.get("pages_written", 0)})
        errors = CounterMetricFamily("dsv41:prefix_cache_remote_errors", "Redis commands of the prefix cache that "
                                     "failed or got no answer in time; each makes its lookup a miss and marks Redis "
                                     "down until a background check finds it back.", labels=["model_name"])
        errors.add_metric([name], remote.get("errors", 0))
        yield errors
        yield counter("dsv41:prefix_cache_remote_skipped", "Redis work skipped while Redis was down: read = lookups "
                      "answered as misses without asking, write = writes dropped (also when the write queue was "
                      "full).", "op", {"read": remote.get("unavailable", 0), "write": remote.get("dropped", 0)})
        yield counter("dsv41:swa_pool_snapshots", "SWA window snapshots: hit = restored for a prefix-cache hit, "
                      "written = taken at a page boundary.", "event",
                      {"hit": pc.get("snapshots_hit", 0), "written": pc.get("snapshots_written", 0)})
        evictions = CounterMetricFamily("dsv41:swa_pool_evictions", "SWA snapshots evicted to stay within the "
                                        "pool's capacity.", labels=["model_name"])
        evictions.add_metric([name], (pc.get("swa_pool") or {}).get("evictions", 0))
        yield evictions
        used = pc.get("swa_pool_occupancy_bytes", 0) or 0
        capacity = self._swa_capacity(pc)
        yield gauge("dsv41:swa_pool_used_bytes", "Bytes of the stored SWA snapshots.", used)
        yield gauge("dsv41:swa_pool_capacity_bytes", "Byte capacity of the SWA snapshot pool (0 without a pool or "
                    "with the Redis pool).", capacity)
        yield gauge("dsv41:swa_pool_occupancy", "Fraction of the SWA snapshot pool in use, 0..1 (0 without "
                    "prefix caching, without a pool or with the Redis pool).",
                    min(1.0, used / capacity) if capacity else 0.0)
        yield gauge("dsv41:prefix_cache_disk_bytes", "Bytes of the page files in the persistent prefix cache.",
                    (pc.get("disk") or {}).get("bytes_used", 0))

    def _swa_capacity(self, pc: dict[str, Any]) -> int:
        """The SWA pool's byte capacity: the engine's stats key when it reports one, else the in-memory pool's
        ``capacity_bytes``; 0 without a pool and for the Redis pool (no capacity)."""
        if pc.get("swa_pool_capacity_bytes") is not None:
            return int(pc["swa_pool_capacity_bytes"])
        prefix_cache = getattr(self.metrics.engine.engine, "prefix_cache", None)
        pool = getattr(prefix_cache, "swa_pool", None)
        return int(getattr(pool, "capacity_bytes", 0) or 0)


def ec_metric_families(model_name: str, ec: dict[str, Any] | None) -> Iterator[CounterMetricFamily]:
    """Prometheus counters of one :meth:`~deepseek_v41.engine.encoder_cache.VisionEncoder.stats` ``"ec_transfer"``
    dict (None: all 0), for every role: ``dsv41:ec_transfer_bytes{direction="sent"|"received"}`` (file bytes
    written / read, headers included), ``dsv41:ec_transfer_images{direction}``,
    ``dsv41:ec_transfer_seconds{direction}`` (writing / reading and decoding), and the consumer's lookups
    ``dsv41:ec_transfer_hits`` / ``dsv41:ec_transfer_misses``. Source: DISAGG_DESIGN.md (metric names)."""
    ec = ec or {}
    for metric, doc in (
            ("bytes", "Encoder-cache transfer bytes (aligner rows' files, headers included) by direction."),
            ("images", "Images whose aligner rows moved through the EC connector, by direction."),
            ("seconds", "Seconds spent writing (sent) or reading and decoding (received) EC files.")):
        family = CounterMetricFamily(f"dsv41:ec_transfer_{metric}", doc, labels=["model_name", "direction"])
        for direction in ("sent", "received"):
            family.add_metric([model_name, direction], ec.get(f"{direction}_{metric}", 0))
        yield family
    for key, doc in (("hits", "Encoder-cache misses answered by the EC connector (rows read, not encoded)."),
                     ("misses", "Encoder-cache misses the EC connector did not hold (encoded here).")):
        family = CounterMetricFamily(f"dsv41:ec_transfer_{key}", doc, labels=["model_name"])
        family.add_metric([model_name], ec.get(key, 0))
        yield family
