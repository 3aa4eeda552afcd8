"""Turns scheduled work into forwards over the paged cache, and keeps per-layer token counters (SPEC.md §4.2).

Prefill modes:

- ``exact``: every layer over every prompt token (what the reference ``generate.py`` does).
- ``ced`` (default when the layout allows, MODEL_REFERENCE.md §3.16): the encoder over every token, the first
  decoder layer's compressor and index keys over every token (the decoder's only global KV), and the decoder
  layers only over positions >= the sequence's ``decoder_start`` (the layer plan's
  :meth:`~deepseek_v41.plan.LayerPlan.decoder_start`: max(0, N - sliding_window)), their windows starting there.

Both run in chunks of any size: each chunk is a forward over positions [start, end) of one sequence whose
earlier state (window rings, pending pair, pages, Engram history) is in the cache. Decode runs one token of
every decoding sequence in one batched forward of all layers. After a prefix-cache hit the first chunk starts at
the hit's restart point and first rebuilds the Engram history from the tokens before it (the KV cache manager
marks the sequence; it never runs the model).

Images (MODEL_REFERENCE.md §3.18, VISION_DESIGN.md decision 7): a prefill chunk holding image positions gets the
aligner rows of its IMAGE slots and the learned delimiters in place of the token embeddings, routes those
positions with ``bias_vl``, hashes them as masked in Engram and attends bidirectionally inside each span (the
context's ``key_limit``). Decode and verify rows are generated tokens: always text.

Speculative decoding (DSPARK.md §6, §7): :meth:`ModelRunner.verify` runs T tokens of every sequence (anchor +
drafts, rows padded to one length) in one batched forward and commits nothing that depends on which tokens are
accepted; :meth:`ModelRunner.commit_verify` then sets the ratio-2 pending pairs and the Engram history to those
of the accepted prefix. Window rows and compressed entries of rejected positions stay behind, beyond the
committed length, where no query reads them and the next forward overwrites them.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import threading
from dataclasses import dataclass

import torch

from deepseek_v41 import kernels
from deepseek_v41.cache.kv_cache import PagedKVCache
from deepseek_v41.cache.paged_context import PagedContext
from deepseek_v41.engine.encoder_cache import VisionEncoder
from deepseek_v41.engine.sequence import Sequence
from deepseek_v41.kernels import cpu_share, fast
from deepseek_v41.kernels.fast.moe import rows_alone
from deepseek_v41.kernels.host_memory import keep_freed_memory, release_freed_memory
from deepseek_v41.model.image_processor import TokenType
from deepseek_v41.model.vision import image_token_mask, place_image_embeddings

log = logging.getLogger(__name__)


class PrefillMode(str, enum.Enum):
    EXACT = "exact"
    CED = "ced"


@dataclass
class VerifyState:
    """What :meth:`ModelRunner.commit_verify` needs from a verify forward: the token ids [B, T], the Engram
    history before it [B, depth] (None without Engram) and, per ratio-2 kv source, the compressor's input
    [B, T, D] (the per-position candidates of the pending pair)."""

    ids: torch.Tensor
    history: torch.Tensor | None
    pending_inputs: dict[int, torch.Tensor]


class _Handover:
    """A process-wide setting that overlapping forwards change together: the first one in changes it (``enter()``
    returns what to restore), the last one out restores it (``leave(saved)``); thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.holders = 0
        self.saved = None

    @contextlib.contextmanager
    def hold(self, enter, leave):
        with self.lock:
            if self.holders == 0:
                self.saved = enter()
            self.holders += 1
        try:
            yield
        finally:
            with self.lock:
                self.holders -= 1
                if self.holders == 0:
                    leave(self.saved)


_ONEDNN = _Handover()  # oneDNN turned off for bf16
_THREAD_DEPTH = threading.local()  # few-token forwards open in this thread, torch's count to restore
# Prefill chunks of up to this many tokens batch with other sequences' chunks of their length (prefill_batch): short
# prompts, where a forward's cost is mostly per layer, not per row (issue 25).
BATCHED_PREFILL_TOKENS = 256
BATCHED_PREFILL_MIN = 2 * kernels.FEW_ROWS  # (shorter chunks take other kernels batched than alone: batch_key)
# Seconds the kernels' pool workers spin for the next job from a few-token forward on (a prefill chunk sets 0).
POOL_SPIN = 0.002


@contextlib.contextmanager
def step_threads(device: torch.device, share: cpu_share.CpuShare | None = None):
    """An engine step's threads on a machine other processes share (kernels/cpu_share.py): torch's count in this
    thread stays the ceiling, and the step runs on the cores ``share`` (default: the process's
    :data:`~deepseek_v41.kernels.cpu_share.SHARE`) finds free, at least one: torch's count and, when larger, the
    kernels' pool lowered meanwhile, torch's count restored after. On CUDA (or any other device) nothing changes."""
    if device.type != "cpu":
        yield
        return
    ceiling = torch.get_num_threads()
    threads = (share or cpu_share.SHARE).threads(ceiling) if ceiling > 1 else 1
    if kernels.threads() > threads:
        kernels.set_threads(threads)
    if threads == ceiling:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(ceiling)


@contextlib.contextmanager
def few_token_kernels(model_dtype: torch.dtype, device: torch.device):
    """Matmul kernels and threads for a forward of a few tokens per sequence (decode, speculative verify); on CUDA
    (or any other device) nothing changes.

    Threads: torch's intra-op threads go to the fused kernels' pool (:func:`kernels.set_threads`) and torch runs
    one thread meanwhile: at a few tokens ATen's threaded GEMVs gain nothing here, while the kernels' projections
    and experts read their weights on every core, and the two pools never spin on the same core (bench/README.md).

    oneDNN: its bf16 GEMM (what PyTorch uses for bf16 when it is enabled) costs about 50 µs per call whatever the
    row count, twice a small fp32 GEMV, while ATen's own bf16 kernel reads the weights in about the fp32 time; for
    large row counts (prefill chunks) oneDNN's AMX path is several times faster. So bf16 decode and verify forwards
    run with oneDNN off.

    torch's thread count belongs to the calling thread: the outermost such forward in a thread (an engine step
    around its runner's forward nests) sets it and restores it. oneDNN's switch is process-wide: while such a
    forward runs, other threads see oneDNN off too; overlapping forwards (two engines in one process) are
    counted, and the last one out restores what the first one in found. The pool's size is process-wide: it
    follows the thread count of the last forward to enter.
    """
    if device.type != "cpu":
        yield
        return
    with contextlib.ExitStack() as stack:
        if kernels.library() is not None:
            stack.enter_context(_threads_to_kernels())
        if model_dtype == torch.bfloat16:
            stack.enter_context(_ONEDNN.hold(_onednn_off, _onednn_restore))
        yield


@contextlib.contextmanager
def _threads_to_kernels():
    """The first few-token forward in a thread hands the thread's torch count to the pool; the last one out of
    that thread gives it back (counted, so overlapping forwards of one thread need not nest)."""
    here = _THREAD_DEPTH
    if getattr(here, "depth", 0) == 0:
        here.threads = torch.get_num_threads()
        kernels.set_threads(here.threads)
        kernels.set_spin(POOL_SPIN)
        torch.set_num_threads(1)
    here.depth = getattr(here, "depth", 0) + 1
    try:
        yield
    finally:
        here.depth -= 1
        if here.depth == 0:
            torch.set_num_threads(here.threads)


def _onednn_off() -> bool:
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    return enabled


def _onednn_restore(enabled: bool) -> None:
    torch.backends.mkldnn.enabled = enabled


def _few_tokens(method):
    """Run a ModelRunner forward under :func:`few_token_kernels`; inside one of this thread (an engine step runs its
    decodes under one) a non-bf16 forward has nothing to add (a bf16 one takes its own oneDNN hold: the one held
    may be another thread's)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if getattr(_THREAD_DEPTH, "depth", 0) and self.dtype != torch.bfloat16:
            return method(self, *args, **kwargs)
        with few_token_kernels(self.dtype, self.device):
            return method(self, *args, **kwargs)

    return run


class ModelRunner:
    """Runs the model over the cache. ``layer_tokens[j]`` counts the tokens layer j has processed."""

    def __init__(self, model, cache: PagedKVCache, prefill_mode: PrefillMode, install_fast: bool = True):
        self.model = model
        self.cache = cache
        self.prefill_mode = prefill_mode
        self.plan = model.plan
        self.device = cache.device
        self.dtype = next(model.parameters()).dtype
        self.layer_tokens = [0] * len(model.layers)
        self.entries_written: dict[int, int] = {}  # compressed entries written per kv-source layer
        self.max_decode_batch = 0
        # The longest prefill chunk that batches with others (batch_key).
        self.max_batched_chunk = min(BATCHED_PREFILL_TOKENS, model.config.sliding_window)
        # The vision encode stage (engine/encoder_cache.py) that gives prefill chunks their images' rows; the
        # engine sets it for a model with a vision tower.
        self.vision: VisionEncoder | None = None
        # The CPU fast paths, chosen once here for this model (kernels/fast): the model itself is reference math.
        # A helper runner on the engine's model (the speculator's cost measurement) reuses the engine's install
        # instead of packing the expert copies again (install_fast=False).
        self.fast = fast.install(model) if install_fast else fast.installed(model)
        if install_fast:
            log.info("CPU fast paths: %s", ", ".join(f"{n} {k}" for k, n in self.fast.modules.items())
                     if self.fast else f"none ({self.fast.reason})")
        if self.device.type == "cpu":  # the step's temporaries reuse freed heap instead of faulting in new pages
            outcome = keep_freed_memory()
            if install_fast and outcome == "set":
                release_freed_memory()  # what loading and packing freed (e.g. the experts before stacking)
            log.debug("glibc malloc thresholds: %s", outcome)

    # ------------------------------------------------------------------ helpers
    def _context(self, seqs: list[Sequence], positions: torch.Tensor, ends: list[int],
                 key_limit: torch.Tensor | None = None) -> PagedContext:
        """The paged context of a forward; ``key_limit`` [B, T]: the window keys of image-span queries (None: text)."""
        return PagedContext(self.cache, [s.slot for s in seqs], [s.block_table for s in seqs], positions, ends,
                            self.dtype, [s.write_from for s in seqs], key_limit)

    def _image_layout(self, seq: Sequence, start: int, end: int, positions: torch.Tensor
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Token types [1, T], image mask [1, T] and window ``key_limit`` [1, T] of positions [start, end) of
        ``seq`` (``positions`` [1, T]), or three Nones when no image span overlaps them (text: the forward runs
        exactly as without vision)."""
        types = seq.token_types(start, end)
        if types is None:
            return None, None, None
        token_types = torch.tensor([types], dtype=torch.long, device=self.device)
        return token_types, image_token_mask(token_types), self.model.key_limit(token_types, positions)

    def _place_images(self, seq: Sequence, start: int, end: int, streams: torch.Tensor,
                      token_types: torch.Tensor) -> torch.Tensor:
        """The embedding streams [1, T, hc, D] of positions [start, end) with the image spans filled in: the
        aligner rows of the IMAGE slots in the chunk (from the encoder stage, in reading order; a chunk that
        starts inside a span, a replay's restart point, takes the rest of that image's rows) and the learned
        delimiters (:func:`~deepseek_v41.model.vision.place_image_embeddings`), as the exact forward fills them."""
        items = seq.images_in(start, end)
        if self.vision is None:
            raise ValueError("this prompt has images but the engine has no vision encoder")
        image = int(TokenType.IMAGE)
        parts = []
        for item, rows in zip(items, self.vision.rows(items), strict=True):
            span = seq.mm_inputs.token_types
            lo, hi = max(start, item.offset), min(end, item.offset + item.length)
            skip = sum(1 for t in span[item.offset:lo] if t == image)
            take = sum(1 for t in span[lo:hi] if t == image)
            parts.append(rows[skip:skip + take])
        model = self.model
        h = streams[:, :, 0]  # every hc stream starts as the token embedding
        h, _ = place_image_embeddings(h, token_types, torch.cat(parts), model.image_start, model.image_newline,
                                      model.image_end)
        return h[:, :, None, :].expand_as(streams).contiguous()

    def _count_entries(self, ctx: PagedContext) -> None:
        for layer, n in ctx.entries_written.items():
            self.entries_written[layer] = self.entries_written.get(layer, 0) + n

    def _engram(self, seqs: list[Sequence], ids: torch.Tensor, image_mask: torch.Tensor | None = None):
        """Engram rows of this forward and the histories after it (from the cache slots); image positions
        (``image_mask`` [B, T]) hash as masked, as in ``Transformer.forward`` (ENGRAM.md §7)."""
        hasher = self.model.hasher
        if hasher is None:
            return None, None
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        history = self.cache.engram_history[slots][:, : hasher.depth]
        rows = hasher(ids, image_mask, history)
        return rows, (slots, hasher.next_history(ids, image_mask, history))

    def _rebuild_engram_history(self, seq: Sequence, start: int) -> None:
        """The slot's Engram history from the real tokens before ``start`` (a prefix hit's restart point: the
        cache restored pages and windows, but the hash history is the last ``depth`` token ids, recomputed; image
        positions among them masked)."""
        seq.rebuild_engram_history = False
        hasher = self.model.hasher
        if hasher is None:
            return
        depth = hasher.depth
        first = max(0, start - depth)
        before = torch.tensor([seq.token_at(first, start)], dtype=torch.long, device=self.device)
        types = seq.token_types(first, start)
        mask = None if types is None else image_token_mask(torch.tensor([types], device=self.device))
        history = hasher.next_history(before, mask, hasher.start_history(1, self.device))
        self.cache.engram_history[seq.slot, :depth] = history[0]

    def _commit_engram(self, update) -> None:
        if update is not None:
            slots, history = update
            self.cache.engram_history[slots, : history.shape[1]] = history

    def _count(self, layers, tokens: int) -> None:
        for j in layers:
            self.layer_tokens[j] += tokens

    # ------------------------------------------------------------------ forwards
    def batch_key(self, seq: Sequence, start: int, end: int) -> tuple[int, int] | None:
        """What a prefill chunk [start, end) of ``seq`` must share with others to run in one forward with them
        (:meth:`prefill_batch`): its length and, in CED mode, where its decoder starts relative to ``start`` (the
        decoder's rows then line up too). None when it runs alone: it holds image positions, or its decoder
        resumes from an SWA snapshot before ``start`` (its decoder inputs then come from the cache), or its length is
        outside [``BATCHED_PREFILL_MIN``, min(``BATCHED_PREFILL_TOKENS``, sliding window)], or the model is bf16.

        Why: a batched row must get the bits of its chunk alone (a sequence's greedy tokens must not depend on the
        other sequences of its step). The CPU fast paths choose kernels by a forward's token count: up to
        ``kernels.FEW_ROWS`` tokens the few-token kernels, and for bf16 the GEMV kernel up to ``kernels.GEMV_MACS``
        multiply-adds, so such chunks would take other kernels batched; the MoE runs each row alone
        (:func:`rows_alone`). Measured on the bundled checkpoint (fp32): rows of 24-64 tokens (its window) are
        bit-identical to alone; rows of 17, and of 65-128, differ by ~1e-6 (not traced: for the longer ones from the
        first CED decoder layer on), hence the bounds. Long chunks gain nothing from batching (a forward's fixed
        cost is small beside theirs)."""
        if (not BATCHED_PREFILL_MIN <= end - start <= self.max_batched_chunk or self.dtype == torch.bfloat16
                or (seq.mm_inputs is not None and seq.token_types(start, end) is not None)):
            return None
        offset = 0
        if self.prefill_mode is PrefillMode.CED and self.plan.ced:
            offset = max(seq.decoder_start, seq.decoder_done) - start
            if offset < 0:
                return None
            offset = min(offset, end - start)  # at or past the chunk's end: no decoder row in this chunk
        return end - start, offset

    @torch.no_grad()
    def prefill(self, seq: Sequence, start: int, end: int, taps: dict | None = None) -> torch.Tensor | None:
        """Forward positions [start, end) of ``seq``; fp32 logits [V] of the last position when it is the last
        token of the sequence, else None. Image spans in the chunk (it never ends inside one; it may start inside
        one at a replay restart point) get their rows from the vision encoder (:attr:`vision`), route with
        ``bias_vl``, hash as masked in Engram and attend bidirectionally inside their span (the context's
        ``key_limit``), as in ``Transformer.forward``. ``taps`` receives each layer's input streams [1, n, hc, D] of the
        positions that layer ran over, which end at ``end`` (CED decoder layers: from the decoder start).
        Raises ValueError for an empty chunk (``end <= start``) or one beyond the sequence: the scheduler never
        plans one."""
        return self.prefill_batch([(seq, start, end)], taps)[0]

    @torch.no_grad()
    def prefill_batch(self, chunks: list[tuple[Sequence, int, int]], taps: dict | None = None
                      ) -> list[torch.Tensor | None]:
        """Forward several prefill chunks ``(seq, start, end)`` of different sequences in one batched forward
        (rows [B, T]); per chunk what :meth:`prefill` returns for it alone (fp32 logits [V] of a chunk that ends its
        sequence, else None). ``taps`` receives each layer's input streams [B, n, hc, D] (row b: ``chunks[b]``).

        Several chunks must share :meth:`batch_key` (equal lengths, decoders starting at the same offset, text
        only): each row's positions, window rows, pending pairs, compressed entries and Engram history are then
        exactly those of its chunk alone, with no padding position. A single chunk may be anything
        :meth:`prefill` takes. One forward for many short prompts instead of one each (issue 25: 32 prompts of 64
        tokens took ~21 ms each through the torch code, mostly per-layer overhead independent of the rows).
        Raises ValueError for an empty chunk, one beyond its sequence, or chunks whose keys differ."""
        for seq, start, end in chunks:
            if not 0 <= start < end <= seq.num_tokens:
                raise ValueError(f"a prefill chunk is positions [start, end) with 0 <= start < end <= "
                                 f"{seq.num_tokens} (the sequence's tokens), got [{start}, {end})")
        if len(chunks) > 1:
            keys = {self.batch_key(*chunk) for chunk in chunks}
            if len(keys) != 1 or None in keys:
                raise ValueError(f"chunks batched in one prefill forward need one batch key (equal lengths, equal "
                                 f"decoder offsets, text only), got {sorted(keys, key=str)}")
        with rows_alone() if len(chunks) > 1 else contextlib.nullcontext():
            return self._prefill_forward(chunks, taps)

    def _prefill_forward(self, chunks: list[tuple[Sequence, int, int]], taps: dict | None
                         ) -> list[torch.Tensor | None]:
        """The forward of :meth:`prefill_batch` (its checks done)."""
        model, plan = self.model, self.plan
        seqs = [seq for seq, _, _ in chunks]
        starts = [start for _, start, _ in chunks]
        ends = [end for _, _, end in chunks]
        for seq, start, _ in chunks:
            if seq.rebuild_engram_history:
                self._rebuild_engram_history(seq, start)
        # torch's own threads run this chunk's matmuls: the kernels' pool workers (left spinning by a decode step)
        # sleep after each job instead of spinning on the cores those threads need. The chunk's kernels (index
        # selection, mHC mixing, top-k) run on as many threads as torch's (issue 25: until a decode step had set
        # it, the pool had one thread; its workers sleep between jobs, so they take no core from torch's threads).
        kernels.set_spin(0.0)
        if kernels.library() is not None and kernels.threads() != torch.get_num_threads():
            kernels.set_threads(torch.get_num_threads())
        T = ends[0] - starts[0]
        ids = torch.tensor([seq.token_at(start, end) for seq, start, end in chunks], dtype=torch.long,
                           device=self.device)
        positions = torch.tensor(starts, device=self.device)[:, None] + torch.arange(T, device=self.device)
        token_types = image_mask = key_limit = None
        if len(chunks) == 1:
            token_types, image_mask, key_limit = self._image_layout(seqs[0], starts[0], ends[0], positions)
        ctx = self._context(seqs, positions, ends, key_limit)
        rows, engram = self._engram(seqs, ids, image_mask)
        streams, pre = model.embed_streams(ids)
        if token_types is not None:
            streams = self._place_images(seqs[0], starts[0], ends[0], streams, token_types)
        want = [end == seq.num_tokens for seq, _, end in chunks]
        run_head = True
        if self.prefill_mode is PrefillMode.CED and plan.ced:
            firsts = [max(seq.decoder_start, seq.decoder_done) for seq in seqs]
            if firsts[0] < starts[0]:  # a single chunk (batch_key): its decoder resumes from an SWA snapshot
                # The decoder's inputs before this chunk are the snapshot's, read before this chunk writes its
                # own rows (a chunk longer than the ring's slack overwrites them).
                old_streams, old_pre = self.cache.read_residuals(seqs[0].slot, firsts[0], starts[0])  # copies
            streams, pre = model.ced_encode(streams, pre, ctx, rows, taps, image_mask=image_mask)
            self._count(plan.encoder_layers, len(chunks) * T)
            if self.cache.residuals:
                self.cache.write_residual_rows([seq.slot for seq in seqs], starts, streams, pre)
            run_head = firsts[0] < ends[0]
            if run_head:
                if firsts[0] < starts[0]:
                    streams = torch.cat((old_streams[None].to(streams.dtype), streams), 1)
                    pre = torch.cat((old_pre[None].to(pre.dtype), pre), 1)
                else:
                    streams, pre = streams[:, firsts[0] - starts[0]:], pre[:, firsts[0] - starts[0]:]
                n = ends[0] - firsts[0]
                tail_positions = (torch.tensor(firsts, device=self.device)[:, None]
                                  + torch.arange(n, device=self.device))
                tail_mask = tail_limit = None
                if len(chunks) == 1:
                    _, tail_mask, tail_limit = self._image_layout(seqs[0], firsts[0], ends[0], tail_positions)
                tail = self._context(seqs, tail_positions, ends, tail_limit)
                streams, pre = model.ced_decode(streams, pre, tail, rows, taps, image_mask=tail_mask)
                self._count(plan.decoder_layers, len(chunks) * n)
                for seq, end in zip(seqs, ends, strict=True):
                    seq.decoder_done = end
        else:
            layers = range(len(model.layers))
            streams, pre = model.run_layers(layers, streams, pre, ctx, image_mask, rows, taps)
            self._count(layers, len(chunks) * T)
            for seq, end in zip(seqs, ends, strict=True):
                seq.decoder_done = end
        logits: list[torch.Tensor | None] = [None] * len(chunks)
        if run_head:
            # The LM head one row at a time: a row's logits then round as they do when its chunk runs alone.
            for row in (r for r in range(len(chunks)) if want[r]):
                logits[row] = model.logits(streams[row:row + 1, -1:], pre[row:row + 1, -1:])[0, -1]
        self._commit_engram(engram)
        self._count_entries(ctx)
        return logits

    @torch.no_grad()
    @_few_tokens
    def decode(self, seqs: list[Sequence], taps: dict | None = None) -> torch.Tensor:
        """One token of every sequence in ``seqs`` (its last token, at position ``num_computed``), all layers.
        ``taps`` receives each layer's input streams [B, 1, hc, D]. Returns fp32 logits [B, V]. The token is text
        (the scheduler never ends a chunk inside an image span, so an image position is never decoded alone):
        RuntimeError otherwise."""
        for seq in seqs:
            if seq.mm_inputs is not None and seq.token_types(seq.num_computed, seq.num_computed + 1) is not None:
                raise RuntimeError(f"request {seq.request_id}: position {seq.num_computed} lies in an image span and "
                                   f"cannot run as a one-token decode (image spans run whole in prefill chunks)")
        ids = torch.tensor([seq.token_at(seq.num_computed, seq.num_computed + 1) for seq in seqs],
                           dtype=torch.long, device=self.device)
        positions = torch.tensor([[seq.num_computed] for seq in seqs], device=self.device)
        ctx = self._context(seqs, positions, [seq.num_computed + 1 for seq in seqs])
        rows, engram = self._engram(seqs, ids)
        streams, pre = self.model.embed_streams(ids)
        plan = self.plan
        if self.cache.residuals and plan.ced:  # keep the decoder inputs for SWA snapshots
            streams, pre = self.model.run_layers(plan.encoder_layers, streams, pre, ctx, None, rows, taps)
            self.cache.write_residual_rows([seq.slot for seq in seqs], [seq.num_computed for seq in seqs], streams,
                                           pre)
            streams, pre = self.model.run_layers(plan.decoder_layers, streams, pre, ctx, None, rows, taps)
        else:
            streams, pre = self.model.run_layers(range(len(self.model.layers)), streams, pre, ctx, None, rows,
                                                 taps)
        self._count(range(len(self.model.layers)), len(seqs))
        for seq in seqs:
            seq.decoder_done = seq.num_computed + 1
        self.max_decode_batch = max(self.max_decode_batch, len(seqs))
        self._commit_engram(engram)
        self._count_entries(ctx)
        return self.model.logits(streams, pre)[:, -1]

    @torch.no_grad()
    @_few_tokens
    def verify(self, seqs: list[Sequence], ids: torch.Tensor, taps: dict | None = None
               ) -> tuple[torch.Tensor, VerifyState]:
        """Speculative verify forward: row b runs ``ids[b]`` [T] (anchor + drafts) at positions
        ``num_computed .. num_computed + T - 1`` of ``seqs[b]``, all layers, in one batched forward.

        Writes window rows, compressed entries and residuals of all T positions (the caller guarantees
        ``T - 1 <= window_slack_rows``) but leaves the Engram history and the meaning of the pending pairs to
        :meth:`commit_verify`. ``taps`` receives each layer's input streams [B, T, hc, D].
        Returns fp32 logits [B, T, V] (float64 for a float64 model) and the :class:`VerifyState`.
        """
        B, T = ids.shape
        starts = [seq.num_computed for seq in seqs]
        positions = torch.tensor(starts, device=self.device)[:, None] + torch.arange(T, device=self.device)
        ctx = self._context(seqs, positions, [s + T for s in starts])
        rows, engram = self._engram(seqs, ids)
        history = None
        if engram is not None:
            history = self.cache.engram_history[engram[0]][:, : self.model.hasher.depth]
        captured: dict[int, torch.Tensor] = {}
        hooks = []
        for layer in self.cache.pending_layers:  # the pending pair of any accepted length is one of these inputs
            def keep(module, args, layer=layer):
                captured[layer] = args[0]

            hooks.append(self.model.layers[layer].attn.compressor.register_forward_pre_hook(keep))
        try:
            streams, pre = self.model.embed_streams(ids)
            plan = self.plan
            if self.cache.residuals and plan.ced:
                streams, pre = self.model.run_layers(plan.encoder_layers, streams, pre, ctx, None, rows, taps)
                self.cache.write_residual_rows([seq.slot for seq in seqs], starts, streams, pre)
                streams, pre = self.model.run_layers(plan.decoder_layers, streams, pre, ctx, None, rows, taps)
            else:
                streams, pre = self.model.run_layers(range(len(self.model.layers)), streams, pre, ctx, None, rows,
                                                     taps)
        finally:
            for hook in hooks:
                hook.remove()
        self._count(range(len(self.model.layers)), B * T)
        self.max_decode_batch = max(self.max_decode_batch, B)
        self._count_entries(ctx)
        return self.model.logits(streams, pre), VerifyState(ids, history, captured)

    @torch.no_grad()
    def commit_verify(self, seqs: list[Sequence], state: VerifyState, accepted: list[int]) -> None:
        """Make the cache state that of the accepted prefix: row b keeps ``accepted[b] + 1`` of its verified
        tokens (anchor + accepted drafts), so its committed length becomes n' = num_computed + accepted + 1
        (``num_computed`` is not changed here). Ratio-2 pending pair: the (kv, score) of position n' - 1 when n'
        is odd, none when even (DSPARK.md §7); Engram history: advanced by the kept tokens only."""
        device = self.device
        slots = torch.tensor([s.slot for s in seqs], device=device)
        keep = torch.tensor(accepted, device=device)
        ends = torch.tensor([s.num_computed for s in seqs], device=device) + keep + 1
        rows = torch.arange(len(seqs), device=device)
        for k, layer in enumerate(self.cache.pending_layers):
            if layer not in state.pending_inputs:
                continue
            x = state.pending_inputs[layer][rows, keep][:, None]  # the input of position n' - 1
            compressor = self.model.layers[layer].attn.compressor
            # One token at an even position opens a pair: the compressor returns exactly its (kv, score).
            _, _, (kv, score) = compressor(x, torch.zeros_like(ends)[:, None], None)
            odd = (ends % 2 == 1)[:, None]
            pending = torch.stack((torch.where(odd, kv, 0.0), torch.where(odd, score, 0.0)), 1)
            self.cache.pending[slots, k] = pending.to(self.cache.pending.dtype)
        if state.history is not None:
            hasher = self.model.hasher
            for b, a in enumerate(accepted):
                after = hasher.next_history(state.ids[b:b + 1, : a + 1], None, state.history[b:b + 1])
                self.cache.engram_history[seqs[b].slot, : after.shape[1]] = after[0]
        for seq, end in zip(seqs, ends.tolist(), strict=True):
            seq.decoder_done = end
