"""A continuous-batching generation engine over the paged KV pool (vLLM v1's engine loop).

Each iteration the scheduler plans one device call (`jax_paged.serving.scheduler`), the
runner executes it over the pool (`jax_paged.serving.runner`), and the scheduler takes
the new tokens, which the engine streams and counts in its `Report`, then the pool's
page state:

    plan = scheduler.schedule(now)                 # bookkeeping, a prefill, a decode chunk
    kv, out = runner.execute(kv, plan)             # jitted calls, pool donated
    events = scheduler.take_tokens(plan, out.first, out.decoded, ...)   # streamed
    scheduler.settle(plan, out.page_table, out.num_free)           # page accounting

`generate` / `stream` run a list of requests to completion. A caller serving requests as
they come submits each with `add_request` and calls `step()` (one iteration) while
`has_unfinished_requests()`, as with vLLM's `LLMEngine`:

    engine.add_request(Request(prompt, 64))
    while engine.has_unfinished_requests():
      for event in engine.step():
        ...                                        # and add_request() as requests come

Each token is drawn with the key `fold_in(key(seed), index)` where index counts the
sample's own tokens (and seed is the sample's, `request.sample_seed`), so results do not
depend on batching, arrival order, preemption or the prefix cache.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import itertools
import os
import re
import time
from typing import Callable, Iterator, Sequence

import jax
import numpy as np

from jax_paged import pool as pool_lib
from jax_paged import sampling as sampling_lib
from jax_paged import tensor_parallel
from jax_paged.guided import Guide
from jax_paged.kernels import kv_quant
from jax_paged.kernels import validation
from jax_paged.kernels.validation import check_positive_int
from jax_paged.paged_model import PagedModel
from jax_paged.serving import admission as admission_lib
from jax_paged.lora import LoraAdapter
from jax_paged.serving.adapter_slots import AdapterSlots
from jax_paged.serving.kv_cache_manager import KVCacheManager
from jax_paged.serving.report import EngineStats, Report
from jax_paged.serving.request import Request, TokenEvent, is_int, validate_requests
from jax_paged.serving import runner as runner_lib
from jax_paged.serving.scheduler import Scheduler, check_scheduling_policy
from jax_paged.serving.speculative import DraftSpeculation, NgramSpeculation


# Engine.warmup's sampling kinds: the settings of the throwaway requests that compile each.
def _any_tokens(vocab_size: int) -> Guide:
  """A guide that allows every token (`Engine.warmup`'s guided runs: their shapes)."""
  return Guide(np.zeros((1, vocab_size), np.int16), np.zeros(1, bool), np.ones(1, bool),
               "any tokens")


WARMUP_SAMPLING = {"greedy": {}, "sampled": dict(temperature=1.0),
                   "top_p": dict(temperature=1.0, top_p=0.9),
                   "min_p": dict(temperature=1.0, min_p=0.05),
                   "top_k": dict(temperature=1.0, top_k=50)}


class Engine:
  """Continuous batching for any model meeting `jax_paged.PagedModel`.

  Args:
    model: the model (its `spec` gives the context limit and the pool's shapes).
    max_batch: decode slots (pool sequences) run together. A decode call runs over the
      slots up to the last occupied one, in powers of two times 16 (`runner.decode_width`),
      so a large capacity costs no idle rows; each such width compiles once, on first use
      (`warmup()` compiles them ahead).
    num_pages: pages in the pool; or None to size it from `memory_fraction` of the
      device's free memory (`pool.size_pool`, accelerators only; with a mesh, of the
      device with the least).
    memory_fraction: the fraction of free device memory for the pool, in (0, 1].
    page_size: tokens per page. The GPU kernels of `jax_paged.nn`'s layers take powers of
      two in [8, 128] (with head dims 64, 80, 96, 128, 256); other sizes run attention on
      XLA's slower gather path, and the layers warn as they trace
      (`validation.ReferencePathWarning`).
    steps_per_call: the most decode steps per device call (one host round trip per
      chunk; streamed tokens arrive per chunk). 128 was the fastest measured (GPT-2 124M
      on an H200: benchmarks/RESULTS.md, "Generation throughput (bench_generate)"). Above
      `runner.STEPS_PER_CHECK` (16), calls that can end early are rounded down to whole
      groups of it.
    max_prefill_tokens: the most (padded) tokens one prefill call processes at once
      (bounding prefill memory); more admissions go into further calls before the next
      chunk, grouped by length so that short prompts are not padded to long ones. (A
      call's second phase, requests starting on a prefix its first phase computes, runs
      after the first and has a budget of its own.)
    admission: "optimistic" (vLLM's policy: admit when the prompt's pages are free, and
      preempt the newest request when the pool runs out mid-decode) or "peak" (admit only
      while every running request can still reach its max_new_tokens; never preempts;
      best when requests rarely stop early). See `jax_paged.serving.admission`.
    eos_token_id: ends every request when generated (optional).
    detokenize: token ids -> text (e.g. a tokenizer's `decode`), for requests with stop
      texts (`Request.stop`); None: the engine works in token ids only.
    cache_dtype: the pool dtype (default: the model's compute dtype): a float dtype, or
      int8 / float8_e4m3fn for a quantized cache (one scale per token per kv head; ~1.9x
      the tokens of bf16 in the same memory at head dim 64, attention reads ~half the
      bytes; float8 needs a GPU of compute capability >= 8.9).
    prefix_caching: keep the full pages of prompts (and of preempted contexts) in a prefix
      cache, so that a request starting with the same tokens shares those pages and
      prefills only the rest; cached pages no sequence uses are evicted, least recently
      used first, when the pool needs room (`jax_paged.serving.kv_cache_manager`). The
      cache outlives a run, as vLLM's does: a later `generate` / `stream` on this engine
      starts on the pages earlier runs cached (`reset_prefix_cache()` drops them). Tokens
      are the same either way.
    mesh: None runs on one device; a 1-D mesh (`jax_paged.tensor_parallel.make_mesh(N)`,
      axis "tp") runs the model tensor parallel over its N devices: attention heads, the
      pool's K/V (by kv head) and the MLPs split, the pool's bookkeeping replicated
      (`jax_paged.tensor_parallel`). The model must list its splits
      (`tensor_parallel_splits()`) and N divide its heads, kv heads and MLP width.
      Tokens are those of one device up to floating point summation order. The model's
      parameters may live anywhere, e.g. on the host CPU for a model no single device
      holds (built or loaded under `jax.default_device(jax.devices("cpu")[0])`): each
      device receives only its blocks.
    scheduling_policy: "fcfs" (first come, first served) or "priority" (vLLM's: arrived
      requests are admitted by `Request.priority`, lower first, then by arrival; a full
      pool preempts the lowest priority's newest sequence). A request that arrives does
      not preempt running ones: it goes first when slots and pages free up.
    speculation: None, a `NgramSpeculation` or a `DraftSpeculation`: decode calls run
      speculative rounds (`jax_paged.serving.speculative`): each verifies up to
      `num_tokens` drafts in one forward, keeping those its own draws confirm; drafts
      from a sequence's own context (prompt lookup: faster where text repeats its
      context) or a draft model's greedy tokens (its K/V in the same pool after the
      model's, so a page holds both: faster where the draft agrees often; split as the
      model under tensor parallelism; no LoRA). The tokens are the same as without (greedy or sampled, with every
      request setting); a round that keeps one token costs more than a step. The model
      needs `prefill_hidden` and `logits`.
    max_loras: LoRA adapters held on the device at once (0: none served). Adapters are
      registered by name (`add_lora`: PEFT checkpoints, any number) and named per
      request (`Request.lora`); rows of different adapters and of the base model run in
      the same batches (`jax_paged.lora`: every adapted projection adds its rows' product
      with all the slots' A, and that times B as one more step of its GEMM). A request
      waits (FCFS) while every slot holds an adapter in use; an idle slot is reloaded,
      least recently used first. The model must list its `lora_targets()`.
    max_lora_rank: the largest adapter rank the slots take (each slot's memory and the
      added GEMMs grow with it).
  """

  def __init__(self, model: PagedModel, *, max_batch: int = 32,
               num_pages: int | None = None, memory_fraction: float = 0.9,
               page_size: int = 16, steps_per_call: int = 128,
               max_prefill_tokens: int = 16384, admission: str = "optimistic",
               eos_token_id: int | None = None, cache_dtype=None,
               prefix_caching: bool = True, mesh=None,
               detokenize: Callable[[Sequence[int]], str] | None = None,
               scheduling_policy: str = "fcfs",
               speculation: NgramSpeculation | DraftSpeculation | None = None,
               max_loras: int = 0,
               max_lora_rank: int = 16):
    self.max_batch = check_positive_int("max_batch", max_batch)
    self.page_size = check_positive_int("page_size", page_size)
    self.steps_per_call = check_positive_int("steps_per_call", steps_per_call)
    self.max_prefill_tokens = check_positive_int("max_prefill_tokens", max_prefill_tokens)
    if admission not in admission_lib.ADMISSION_POLICIES:
      raise ValueError(f"admission must be one of {admission_lib.ADMISSION_POLICIES}, got "
                       f"{admission!r}")
    self.admission = admission
    self.scheduling_policy = check_scheduling_policy(scheduling_policy)
    self.eos_token_id = eos_token_id
    if detokenize is not None and not callable(detokenize):
      raise ValueError(f"detokenize must be a function of token ids returning text, got "
                       f"{detokenize!r}")
    self.detokenize = detokenize
    self.prefix_caching = bool(prefix_caching)
    if is_int(max_loras) and max_loras == 0:
      self.adapters = None
    else:
      self.adapters = AdapterSlots(check_positive_int("max_loras", max_loras))
    lora = None
    if self.adapters is not None:
      lora = (max_loras, check_positive_int("max_lora_rank", max_lora_rank))
    self.runner = runner_lib.ModelRunner(model, mesh, speculation, lora)
    self.mesh = mesh
    self.spec = spec = self.runner.spec
    cache_dtype = validation.check_cache_dtype(
        "cache_dtype", spec.dtype if cache_dtype is None else cache_dtype)
    kv_quant.check_fp8_device(cache_dtype, "cache_dtype")
    self.cache_dtype = cache_dtype
    # Each device of a mesh holds 1 / N of the kv heads (of `pool_kv_heads`: replicated
    # where the model has fewer than N; checked by the runner) and the same pages.
    local_kv_heads = spec.num_kv_heads if mesh is None else (
        tensor_parallel.pool_kv_heads(spec.num_kv_heads, tensor_parallel.mesh_size(mesh))
        // tensor_parallel.mesh_size(mesh))
    if num_pages is None:
      if isinstance(memory_fraction, bool) or not (
          isinstance(memory_fraction, (int, float)) and 0.0 < memory_fraction <= 1.0):
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
      try:
        # The device with the least free memory sizes the pool (the first also holds the
        # caller's whole model if it was built there).
        devices = [None] if mesh is None else list(mesh.devices.flat)
        self.sizing = min((pool_lib.size_pool(num_layers=spec.num_layers,
                                              num_kv_heads=local_kv_heads,
                                              head_dim=spec.head_dim, page_size=page_size,
                                              dtype=cache_dtype, utilization=memory_fraction,
                                              device=device)
                           for device in devices), key=lambda sizing: sizing.num_pages)
      except ValueError as e:
        raise ValueError(f"num_pages=None sizes the pool from memory_fraction="
                         f"{memory_fraction} of the device's free memory, which failed ({e}): "
                         "pass num_pages") from e
      num_pages = self.sizing.num_pages
    else:
      self.sizing = None
    self.num_pages = check_positive_int("num_pages", num_pages)
    if jax.default_backend() == "gpu":  # the kernels' page arrays (a device's kv heads)
      kv_quant.check_compiled(jax.ShapeDtypeStruct(
          (spec.num_layers, local_kv_heads, num_pages, page_size, spec.head_dim),
          cache_dtype), "num_pages gives")
    self.max_pages_per_seq = -(-spec.max_positions // page_size)
    self.kv = self.runner.create_pool(num_pages=num_pages, page_size=page_size,
                                      max_seqs=max_batch,
                                      max_pages_per_seq=self.max_pages_per_seq,
                                      dtype=cache_dtype)
    self.report = Report(num_pages=self.num_pages)
    self._run: _Run | None = None  # a run holds the pool: one at a time
    self._streaming = False  # the run belongs to a generate / stream
    self._next_id = 0  # add_request's next id: ids go on from run to run
    # The host's page accounting, kept from run to run with the pool: pages cached by a
    # run (its prompts' full pages) serve the next run's requests too, until evicted.
    self._cache: KVCacheManager | None = None
    # `stats()`'s counts of the runs that have ended (prompt tokens, cached ones,
    # generated tokens, preemptions, drafts verified, drafts kept).
    self._ended_counts = (0,) * 6

  def add_lora(self, name: str, adapter: str | os.PathLike | LoraAdapter) -> None:
    """Registers a LoRA adapter under `name` for requests to name (`Request.lora`): a PEFT
    checkpoint directory (adapter_config.json, adapter_model.safetensors) or a loaded
    `LoraAdapter`. It reaches the device when a request needs it. Registering a name
    again replaces its adapter (no cached prefix computed under the old one is reused).

    Raises:
      ValueError: the engine serves no adapters (max_loras=0), the name is not a
        non-empty string or its adapter is in use, or the adapter does not fit the model
        (a module it does not serve, a rank above max_lora_rank, another shape).
      FileNotFoundError: no PEFT adapter at the path.
    """
    if self.adapters is None:
      raise ValueError("this Engine serves no LoRA adapters: build it with "
                       "Engine(..., max_loras=N)")
    if not isinstance(name, str) or not name:
      raise ValueError(f"name must be a non-empty string, got {name!r}")
    if not isinstance(adapter, LoraAdapter):
      adapter = LoraAdapter.load(adapter)
    self.runner.lora_layout.check(adapter)  # (the slots' arrays are built when it loads)
    if self._waiting_for(name):
      raise ValueError(f"LoRA adapter {name!r} is named by waiting requests")
    self.adapters.add(name, adapter)

  def remove_lora(self, name: str) -> None:
    """Unregisters a LoRA adapter (its slot freed, its cached prefixes left to eviction).

    Raises:
      KeyError: no adapter of that name.
      ValueError: requests waiting or running name it.
    """
    if self.adapters is None or name not in self.adapters.adapters:
      raise KeyError(f"no LoRA adapter named {name!r}; registered: {self.loras}")
    if self.adapters.in_use(name) or self._waiting_for(name):
      raise ValueError(f"LoRA adapter {name!r} is named by waiting or running requests")
    self.adapters.remove(name)

  def _waiting_for(self, lora: str) -> bool:
    """Whether a waiting request of the run in progress names LoRA adapter `lora`."""
    if self._run is None:
      return False
    scheduler = self._run.scheduler
    return any(scheduler.requests[rid].lora == lora for rid, _, _ in scheduler.waiting)

  @property
  def loras(self) -> list[str]:
    """The names of the registered LoRA adapters."""
    return [] if self.adapters is None else sorted(self.adapters.adapters)

  @property
  def num_cached_pages(self) -> int:
    """Pages the prefix cache holds between runs (evictable: a run takes them when it
    needs room)."""
    return 0 if self._cache is None else self._cache.num_cached_pages

  def stats(self) -> EngineStats:
    """The engine's load now and its counts since it was built (`EngineStats`): cheap
    (no device access), for a server's monitoring between steps."""
    counts = [a + b for a, b in zip(self._ended_counts, self._run_counts())]
    running = waiting = 0
    loras = ()
    if self._run is not None:
      scheduler = self._run.scheduler
      running = sum(s is not None for s in scheduler.slots)
      waiting = sum(scheduler.requests[rid].n if sample is None else 1
                    for rid, sample, _ in scheduler.waiting)
    if self.adapters is not None:  # (vLLM's lora_requests_info)
      names = lambda rs: ",".join(sorted({r.lora for r in rs if r.lora is not None}))
      loras = (self.adapters.max_loras, "", "")
      if self._run is not None:
        loras = (self.adapters.max_loras,
                 names(s.request for s in scheduler.slots if s is not None),
                 names(scheduler.requests[rid] for rid, _, _ in scheduler.waiting))
    cache = self._cache
    if cache is None:
      return EngineStats(running, waiting, 0, 0, self.num_pages, *counts, *loras)
    return EngineStats(running, waiting, cache.num_used_pages, cache.num_cached_pages,
                       self.num_pages, *counts, *loras)

  def _run_counts(self) -> tuple[int, ...]:
    """`stats()`'s counts of the run in progress (zeros if none)."""
    if self._run is None:
      return (0,) * 6
    cache, report = self._cache, self.report
    return (cache.prompt_tokens, cache.cached_prompt_tokens, report.generated_tokens,
            self._run.scheduler.num_preemptions, report.draft_tokens, report.accepted_tokens)

  def _end_run(self) -> None:
    """Forgets the run in progress, its counts kept for `stats()`."""
    self._ended_counts = tuple(a + b for a, b in zip(self._ended_counts, self._run_counts()))
    self._run = None
    if self.adapters is not None:  # (an aborted run's sequences held theirs)
      self.adapters.drop_holds()

  def reset_prefix_cache(self) -> int:
    """Drops every cached page (vLLM's `reset_prefix_cache`): the next run starts cold, on
    an empty pool. Returns the pages freed."""
    if self._run is not None:
      raise RuntimeError("reset_prefix_cache() during a run: finish it (a generate / "
                         "stream exhausted or closed, step() until no request is left) or "
                         "abort() it first")
    if self._cache is None:
      return 0
    evicted = self._cache.evict_for(self.num_pages)
    self.kv = self.runner.update_pages(self.kv, evict=evicted)
    return len(evicted)

  def warmup(self, max_prompt_tokens: int | None = None,
             sampling: Sequence[str] = ("greedy",), prefix_hits: bool = False,
             max_samples: int = 1, short_chunks: bool = False,
             logprobs: bool = False, top_logprobs: bool = False,
             logits_processors: bool = False, guided: bool = False) -> int:
    """Compiles, before anything is served, the device calls that batches take (as vLLM
    captures its CUDA graphs at start-up): a run otherwise compiles each new batch shape
    when it first turns up, stalling every request ~1 s (GPT-2 on an H200;
    benchmarks/RESULTS.md, "Serving requests as they arrive").

    Serves throwaway requests: a prefill of n prompts of w tokens for every bucketed row
    count n (1, 2, 4, ... up to max_batch) and width w (page_size, 2 page_size, ... up to
    `max_prompt_tokens`, default the model's context) whose n x w padded tokens fit
    `max_prefill_tokens` (and whose pages fit the pool), then decode calls over every
    decode width (`runner.decode_width`), with and without checks; all of it once per
    `sampling` kind; then the page bookkeeping of every count of cached pages one call
    can hold or drop. Leaves the pool empty and the prefix cache dropped. Requests with up
    to `runner.MIN_STOP_IDS` stop tokens (the eos included) and the chunks of long prompts
    run in these shapes too (with `prefix_hits` for a chunk after the first). Still
    compiled on first use: prefix-cache hits (unless `prefix_hits`), parallel samples
    (unless `max_samples`), decode chunks cut short by a pool running out of free pages
    (unless `short_chunks`), requests that ask for log-probabilities (unless `logprobs` /
    `top_logprobs`), requests with logits processors (unless `logits_processors`; with
    it, still their prefills whose context is wider than their prompt's width, a long
    prompt's later chunks, a preempted request's, and more than
    `runner.MIN_BIAS_TOKENS` logit_bias entries), requests admitted together that
    share uncached pages (a call's second phase), and in a pool too small to admit a
    shape's prompts with all their samples together, parallel samples in that shape.
    One compilation per shape: GPT-2 124M, 256 slots, prompts up to 512 tokens, greedy,
    on an H200: 75-103 s, 79 compilations (an engine of another steps_per_call on the
    same model then 13 s: prefill programs are shared); 34 s from jax's persistent
    compilation cache.

    Then, as vLLM does after its start-up, it moves every object alive (the compiled
    programs and their traces among them) out of Python's garbage collector's reach
    (`gc.freeze()`): a full collection would otherwise walk them all, now and then
    stalling serving for ~0.5 s (GPT-2 above on the H200's host; benchmarks/LOG.md). Later
    objects are collected as usual.

    Args:
      max_prompt_tokens: the longest prompt to prepare for.
      sampling: the batches to prepare for, each its own compilations: "greedy" (every
        row greedy), "sampled" (some row samples, none filters), "top_p" (some row
        samples with top_p, none with top_k), "min_p" (some row samples with min_p, none
        with top_p or top_k) and "top_k" (some row samples with a top_k up to
        `sampling.CHUNKED_TOP_K`; a larger one sorts, compiled on first use).
      prefix_hits: also the prefills of n prompts that start on a cached page (as behind a
        shared system prompt once cached) and add w tokens: twice the prefill runs.
      max_samples: also the prefills of prompts with up to this many parallel samples
        (`Request.n`): the prefill runs again per power of two from 2 up to it (the last
        one max_samples), for the row counts whose samples fit the slots.
      short_chunks: also the decode calls that a pool short of free pages cuts below a
        group of checked steps (`runner.STEPS_PER_CHECK`): loops of 1, 2, 4, ... steps
        over every decode width, checked or not (serving near the pool's capacity; the
        GPT-2 warm-up above: 47 s and 60 compilations more).
      logprobs: also every call above with a request that asks for its tokens'
        log-probabilities (`Request.logprobs`): twice the runs.
      top_logprobs: also every call above with a request that asks for top_logprobs (its
        own compilations: one more time the runs).
      logits_processors: also every call above with a request that has logits
        processors (`Request.processes_logits`: penalties, logit_bias, min_tokens; their
        own compilations, twice the runs), and such decode calls over every decode width
        with each width of the contexts they send (`runner.MIN_CONTEXT_WIDTH` times a
        power of two, up to the model's context), checked or not.
      guided: also every call above with a guided request (`Request.guide`; their own
        compilations, twice the runs), for guides that fit `runner.MIN_GUIDE_STATES`
        states together.

    Returns:
      the throwaway runs served.
    """
    if self._run is not None:
      raise RuntimeError("warmup() during a run: finish or abort() it first")
    limit = self.spec.max_positions - 1  # a prompt and one new token
    if max_prompt_tokens is not None:
      limit = min(check_positive_int("max_prompt_tokens", max_prompt_tokens), limit)
    settings = WARMUP_SAMPLING
    if isinstance(sampling, str) or not sampling or any(k not in settings for k in sampling):
      raise ValueError(f"sampling must be a non-empty list of {tuple(settings)}, got "
                       f"{sampling!r}")
    if check_positive_int("max_samples", max_samples) > self.max_batch:
      raise ValueError(f"max_samples={max_samples} exceeds max_batch={self.max_batch}: a "
                       "prompt's samples each take a slot")

    def fits(lengths: Sequence[int], new: int, cached: int = 0) -> bool:
      """Whether prompts of `lengths` tokens behind `cached` pages they share are admitted
      together (the optimistic policy counts each prompt's pages, cached ones too, and a
      page of headroom) and then add `new` tokens each without running out of pages."""
      pages = lambda n: -(-n // self.page_size)
      return (sum(pages(cached * self.page_size + n) + 1 for n in lengths) <= self.num_pages
              and cached + sum(pages(n + new - 1) for n in lengths) <= self.num_pages)

    def prefill_run(rows: int, width: int, cached: int = 0) -> tuple[int, ...] | None:
      """Lengths of prompts behind `cached` pages whose prefill (one new token) takes the
      shape of `rows` rows and `width` tokens (both bucketed) and fits the pool: a full
      batch of the widest, else the fewest rows of the fewest tokens that make the shape
      (a pool too small for the full batch still meets the shape with such prompts);
      None if neither fits."""
      longest = min(width, limit - cached * self.page_size)
      shortest = width // 2 + 1 if width > self.page_size else 1
      if shortest > longest:
        return None
      for lengths in ((longest,) * min(rows, self.max_batch),
                      (shortest,) + (1,) * (rows // 2)):
        if fits(lengths, 1, cached):
          return lengths
      return None

    def distinct(lengths: Sequence[int]) -> list[list[int]]:
      """Prompts of `lengths` tokens with distinct first tokens: none starts on another's
      cached page."""
      return [[i % self.spec.vocab_size] + [0] * (n - 1) for i, n in enumerate(lengths)]

    # Each run: its prompts' lengths, new tokens and (prefills) the lengths of prompts
    # behind a cached page in its shape.
    runs_of = []
    rows = 1
    while rows < 2 * self.max_batch:  # prefill rows are bucketed past max_batch
      width = self.page_size
      while rows * width <= self.max_prefill_tokens:
        lengths = prefill_run(rows, width)
        if lengths:
          runs_of.append((lengths, 1, prefill_run(rows, width, cached=1)))
        if width >= limit:
          break
        width *= 2
      rows *= 2
    # Decode over each width, with the fewest sequences that make it (`decode_width`): a
    # first call that runs every step unchecked (a row's budget lasts it), then a checked
    # one (every budget ends within it).
    new = self.steps_per_call + 2
    length = max(1, min(self.page_size, self.spec.max_positions - new))
    fewest = {}  # decode width -> the fewest sequences that run over it
    for n in range(1, self.max_batch + 1):
      fewest.setdefault(runner_lib.decode_width([0] * n + [None] * (self.max_batch - n)), n)
    for n in fewest.values():
      if length + new <= self.spec.max_positions and fits((length,) * n, new):
        runs_of.append(((length,) * n, new, None))
    # Parallel samples: a prefill samples its rows times the next power of two (runner).
    samples, k = [1], 2
    while k < 2 * max_samples:
      samples.append(min(k, max_samples))
      k *= 2
    runs = 0
    # Each kind's rows asking for no log-probabilities, the tokens', and the top ones too
    # (`runner._Sampling`'s logprobs and top_logprobs): (logprobs, top_logprobs) each;
    # without logits processors and with (`runner.processor_arrays`).
    variants = [(False, 0)] + [(True, 0)] * logprobs + [(True, 1)] * top_logprobs
    for kind, (with_logprobs, top), processed, with_guide in itertools.product(
        dict.fromkeys(sampling), variants,
        (False, True) if logits_processors else (False,),
        (False, True) if guided else (False,)):
      # The decode calls of empty rows below take the filter method of this kind's rows.
      filter_by = sampling_lib.filter_method(settings[kind].get("temperature", 0.0),
                                             settings[kind].get("top_k", 0),
                                             settings[kind].get("top_p", 1.0),
                                             settings[kind].get("min_p", 0.0))
      setting = dict(settings[kind], logprobs=with_logprobs, top_logprobs=top,
                     repetition_penalty=1.1 if processed else 1.0,
                     guide=_any_tokens(self.spec.vocab_size) if with_guide else None)
      idle = dict(greedy=kind == "greedy", filter_by=filter_by, logprobs=with_logprobs,
                  top_logprobs=sampling_lib.MAX_TOP_LOGPROBS * top)
      for lengths, new, hits in runs_of:
        for n_samples in samples if new == 1 else samples[:1]:
          if len(lengths) * n_samples > self.max_batch:  # each sample takes a slot
            break
          self.reset_prefix_cache()  # the last run's prompts would be hits: another shape
          self.generate([Request(p, new, n=n_samples, **setting) for p in distinct(lengths)])
          runs += 1
          if prefix_hits and hits:
            # A page cached, then the prompts starting on it: they prefill their own
            # tokens only (as a long prompt's chunks after the first do). Only that page:
            # the first fresh prompt, all zeros, would make the first of these a hit on
            # all but its last page (another shape).
            prefix = [0] * self.page_size
            self.reset_prefix_cache()
            self.generate([Request(prefix + [0], 1)])
            self.generate([Request(prefix + p, 1, n=n_samples, **setting)
                           for p in distinct(hits)])
            runs += 2
      # Decode calls with logits processors send contexts of any width up to the model's
      # (`runner.processor_arrays`); 0: none.
      widest = runner_lib.bucket(self.spec.max_positions, runner_lib.MIN_CONTEXT_WIDTH)
      context_widths = [runner_lib.MIN_CONTEXT_WIDTH << k for k in range(
          (widest // runner_lib.MIN_CONTEXT_WIDTH).bit_length())] if processed else [0]
      # A decode chunk that the free pages cut below a group of checked steps runs in a
      # loop of its length rounded up to a power of two (runner): empty rows, nothing
      # written.
      per_check, steps = runner_lib.steps_per_check(self.steps_per_call), 1
      while short_chunks and steps <= runner_lib.bucket(per_check - 1, 1):
        for width, context_width, checked in itertools.product(
            fewest, context_widths, (True, False)):
          self.kv = self.runner.idle_decode(self.kv, width, steps, checked=checked,
                                            context_width=context_width, **idle)
        steps *= 2
      for width, context_width, checked in itertools.product(
          fewest, context_widths if processed else [], (True, False)):
        self.kv = self.runner.idle_decode(self.kv, width, self.steps_per_call,
                                          checked=checked, context_width=context_width,
                                          **idle)
    self.reset_prefix_cache()
    # A call's page bookkeeping is shaped by the cached pages it holds or drops, up to the
    # whole pool (bench_serving at 1000 requests/s met 8192 and 16384 at once). -1 is
    # padding: these calls change nothing.
    holds = runner_lib.MIN_HOLDS
    while True:
      self.kv = self.runner.update_pages(self.kv, retain=[-1] * holds)
      if holds >= self.num_pages:
        break
      holds *= 2
    self.report = Report(num_pages=self.num_pages)
    self._ended_counts = (0,) * 6  # (`stats()` counts served requests, not these)
    gc.collect()  # (what the warm-up left for collection is freed, not frozen)
    gc.freeze()
    return runs

  def generate(self, requests: Sequence[Request],
               on_token: Callable[[TokenEvent], None] | None = None
               ) -> tuple[list, Report]:
    """Runs every request to completion; returns (outputs, report). outputs[i] is the new
    tokens of request i, or for a request with n > 1 samples a list of n such lists.
    `on_token` gets each token as an event as soon as the host has it, with its
    log-probabilities for a request that asks (`Request.logprobs`, `top_logprobs`); it
    may end a request (`abort_request`), whose output then holds the tokens it got."""
    outputs = collections.defaultdict(list)  # (request id, sample) -> its tokens
    if on_token is None:
      for seq in self._run_all(requests):  # (validated first)
        outputs[seq[:2]] += seq[2]
    else:
      for event in self._live_events(self._run_all(requests)):
        outputs[event.request_id, event.sample].append(event.token)
        on_token(event)
    return [outputs[i, 0] if r.n == 1 else [outputs[i, j] for j in range(r.n)]
            for i, r in enumerate(requests)], self.report

  def stream(self, requests: Sequence[Request]) -> Iterator[TokenEvent]:
    """Yields each token as soon as the host has it. `self.report` is complete once the
    iterator is exhausted; closing it early (or breaking out of a loop over it) ends the
    run and frees every page."""
    yield from self._live_events(self._run_all(requests))

  def add_request(self, request: Request) -> int:
    """Submits a request while the engine runs, for a caller that serves requests as they
    come (vLLM's `LLMEngine.add_request`): it joins the run in progress, or starts one,
    and is admitted at a later `step()` no earlier than `request.arrival_s` after now. Its
    tokens come from `step()`, under the returned id (0, 1, ... in submission order, going
    on from run to run), and are the same as in a `generate` of it alone. Call from the
    thread that calls `step()`, between steps. `self.report` covers the run: from the
    request that found the engine idle to the step that finished the last.

    Raises:
      ValueError: the engine cannot serve the request (named by the id it would have had;
        nothing is submitted).
      RuntimeError: a `generate` / `stream` owns the run.
    """
    if self._streaming:
      raise RuntimeError("add_request() during a generate / stream: its run takes only "
                         "the requests it was given")
    rid = self._next_id
    if self._run is None:
      self._begin([request], first_id=rid)
    else:
      run = self._run
      prompt, = self._validate([request], first_id=rid)
      run.scheduler.add(request, prompt, time.perf_counter() - run.start + request.arrival_s)
      self.report.num_requests += 1
    self._next_id += 1
    return rid

  def add_requests(self, requests: Sequence[Request]) -> list[int]:
    """`add_request` of each, all or none (a server's request of several prompts):
    returns their ids. If the engine cannot serve one, those already added are aborted
    and ValueError names it by its index (`requests[i]: ...`; a single request's message
    without a name).

    Raises:
      ValueError: as above.
      RuntimeError: a `generate` / `stream` owns the run.
    """
    ids = []
    try:
      for request in requests:
        ids.append(self.add_request(request))
    except ValueError as e:
      for rid in ids:
        self.abort_request(rid)
      # `add_request` names the request by the id it would have had: here, by its index.
      message = re.sub(r"^request \d+: ", "", str(e))
      raise ValueError(f"requests[{len(ids)}]: {message}" if len(requests) > 1
                       else message) from e
    return ids

  def has_unfinished_requests(self) -> bool:
    """Whether a run is in progress: a request added by `add_request` has yet to finish."""
    return self._run is not None

  def step(self) -> list[TokenEvent]:
    """Runs one device call of the run in progress (waiting first, if no request has
    arrived yet, until one does) and returns the tokens it produced, in `TokenEvent`s;
    [] when no run is in progress. The step that finishes the last request ends the run:
    its pages go back to the pool (the prefix cache keeps the full prompt pages) and
    `self.report` is complete. If the step raises, the run is aborted (`abort`).

    Raises:
      RuntimeError: a `generate` / `stream` owns the run.
    """
    if self._streaming:
      raise RuntimeError("step() during a generate / stream: it runs its own steps")
    if self._run is None:
      return []
    try:
      return [event for seq in self._step() for event in _events(*seq)]
    except BaseException:
      self.abort()
      raise

  def abort_request(self, request_id: int, sample: int | None = None) -> bool:
    """Drops one request of the run in progress, every sample of it, or only its `sample`
    (vLLM's `abort_request`: its client has gone, or met a stop string of its own): it
    leaves the queue or the batch, its pages go back (full pages already cached stay
    cached), and none of its tokens come after this call, from `step()`, `stream` or
    `generate`'s `on_token` (from which it may be called: the tokens of the same device
    call that follow are dropped; `generate` returns the tokens given). A request whose
    every sample was aborted one by one counts as aborted (`Report.aborted`). Call from
    the thread that runs the engine: between steps, in an `on_token` callback, or while
    consuming a stream. Returns whether it (the sample) was unfinished (False: finished,
    or already aborted).

    Raises:
      ValueError: request_id is not an int >= 0, or not an id of the run in progress;
        sample is not an int in [0, n).
    """
    run = self._run
    if not is_int(request_id):
      raise ValueError(f"request_id must be an int, got {request_id!r}")
    if request_id < 0:
      raise ValueError(f"request_id must be >= 0, got {request_id}")
    if run is None:  # nothing in progress: every request has finished
      return False
    rid = request_id - run.first_id
    if not 0 <= rid < len(run.scheduler.requests):
      raise ValueError(f"request_id {request_id}: the run in progress has ids "
                       f"{run.first_id} to {run.first_id + len(run.scheduler.requests) - 1}")
    n = run.scheduler.requests[rid].n
    if sample is not None and not (is_int(sample) and 0 <= sample < n):
      raise ValueError(f"sample must be None (every sample) or an int in [0, n={n}) for "
                       f"request {request_id}, got {sample!r}")
    if request_id in run.aborted or (request_id, sample) in run.aborted_samples:
      return False
    if sample is not None:
      if not run.scheduler.unfinished(rid, sample):
        return False
      run.aborted_samples.add((request_id, sample))
      left = [j for j in range(n) if (request_id, j) not in run.aborted_samples
              and run.scheduler.unfinished(rid, j)]
      if left:  # the request goes on without this sample
        if self._streaming:
          run.aborting.append((rid, sample))
        else:
          run.scheduler.abort(rid, sample)
        return True
    elif not run.scheduler.unfinished(rid):
      return False
    run.aborted.add(request_id)
    self.report.aborted += 1
    if self._streaming:  # mid-call (a callback, a stream's consumer): at the next step
      run.aborting.append((rid, None))
    else:
      run.scheduler.abort(rid)
      if run.scheduler.finished:
        self._finish()
    return True

  def abort(self) -> None:
    """Ends the run in progress at once, its unfinished requests dropped: every page goes
    back, the prefix cache's too, and the next run starts on a fresh accounting. No-op
    when no run is in progress.

    Raises:
      RuntimeError: a `generate` / `stream` owns the run (close the stream instead).
    """
    if self._streaming:
      raise RuntimeError("abort() during a generate / stream: close() the stream instead")
    if self._run is None:
      return
    self._end_run()
    self._cache = None
    # (A pool deleted by a failed donated call is beyond repair here.)
    if not self.kv.page_table.is_deleted():
      self.kv = self.runner.clear(self.kv)

  def _validate(self, requests: Sequence[Request], first_id: int = 0) -> list:
    return validate_requests(requests, self.spec, page_size=self.page_size,
                             max_pages=min(self.num_pages, self.max_pages_per_seq),
                             max_batch=self.max_batch, first_id=first_id,
                             scores_prompts=self.runner.scores_prompts,
                             detokenizes=self.detokenize is not None,
                             prioritizes=self.scheduling_policy == "priority",
                             loras=self.loras)

  def _begin(self, requests: Sequence[Request], first_id: int = 0) -> None:
    """Starts a run of `requests` (validated here), whose ids are first_id, first_id + 1,
    ...: its clock, scheduler and report."""
    # The run's clock (time to first token, arrivals, elapsed) starts before validation
    # and set-up: a caller waits for them too (a 256-request burst's prompts take ~3 ms to
    # convert on the dev CPU, more on the device machine's host).
    start = time.perf_counter()
    prompts = self._validate(requests, first_id)
    if self._cache is None:
      self._cache = KVCacheManager(num_pages=self.num_pages, page_size=self.page_size,
                                   max_seqs=self.max_batch,
                                   max_pages_per_seq=self.max_pages_per_seq,
                                   prefix_caching=self.prefix_caching)
    cache = self._cache
    cache.reset_counters()
    policy = admission_lib.make_policy(self.admission, cache,
                                       max_positions=self.spec.max_positions,
                                       steps_per_call=self.steps_per_call)
    scheduler = Scheduler(requests, max_batch=self.max_batch, cache=cache, admission=policy,
                          steps_per_call=self.steps_per_call,
                          max_prefill_tokens=self.max_prefill_tokens,
                          eos_token_id=self.eos_token_id, prompts=prompts,
                          scheduling_policy=self.scheduling_policy,
                          adapters=self.adapters)
    self.report = Report(num_requests=len(requests), num_pages=self.num_pages)
    self._run = _Run(start, scheduler, first_id)

  def _live_events(self, seqs: Iterator[tuple]) -> Iterator[TokenEvent]:
    """The events of `_step`'s sequences, one at a time; a request aborted while its
    events are taken (`abort_request` by their consumer) gets no more, and the report
    does not count them."""
    for seq in seqs:
      for j, event in enumerate(_events(*seq)):
        if self._run.dropped(seq[0], seq[1]):
          self.report.generated_tokens -= len(seq[2]) - j
          break
        yield event

  def _run_all(self, requests: Sequence[Request]) -> Iterator[tuple]:
    """A generate / stream: a run of `requests`, stepped until every one has finished."""
    if self._run is not None:
      raise RuntimeError("this Engine is already running (a generate / stream, or requests "
                         "added by add_request), and a run holds the whole pool: finish "
                         "or abort() it first")
    self._begin(requests)
    self._streaming = True
    try:
      while self._run is not None:
        yield from self._step()
    finally:
      # Stopped early (its stream abandoned, a callback or a check raised): abort.
      self._streaming = False
      self.abort()

  def _step(self) -> Iterator[tuple]:
    """schedule -> execute -> take_tokens / settle, once. Yields (request id, sample, new
    tokens, finish reason, their log-probabilities, their top log-probabilities, the
    prompt's and its top ones, the stop text completed: each None unless asked for and
    due) per sequence that produced tokens, before the page bookkeeping; a sample meeting
    a stop text ends there. Ends the run when every request has finished. (The
    scheduler's ids count from 0 in each run; the caller's from the run's first_id.)"""
    run, report = self._run, self.report
    scheduler = run.scheduler
    for rid, sample in run.aborting:  # (aborted during the last call's events)
      scheduler.abort(rid, sample)
    run.aborting.clear()
    if scheduler.finished:  # (every request left was aborted)
      self._finish()
      return
    plan = scheduler.schedule(time.perf_counter() - run.start)
    if plan is None:  # the next request has not arrived yet
      time.sleep(max(0.0, scheduler.next_arrival() - (time.perf_counter() - run.start)))
      return
    called = time.perf_counter()
    self.kv, out = self.runner.execute(self.kv, plan)
    seconds = time.perf_counter() - called
    if plan.prefill:
      report.prefill_calls += 1
    if plan.decode_steps:
      report.decode_calls += 1
      produced = (out.decoded >= 0).sum(axis=0)
      report.decode_tokens += int(produced.sum())
      if out.speculated is None:
        report.decode_steps += int(produced.max())
      else:
        report.decode_steps += int(out.speculated[0])
        report.draft_tokens += int(out.speculated[1])
        report.accepted_tokens += int(out.speculated[2])
    # A call with both is counted as decode time: its prefill interleaves.
    if plan.decode_steps:
      report.decode_s += seconds
    else:
      report.prefill_s += seconds
    events = scheduler.take_tokens(plan, out.first, out.decoded, out.first_logprobs,
                                   out.decoded_logprobs, out.prompt_logprobs)
    now = time.perf_counter()
    for rid, sample, new, reason, logprobs, top, *prompt in events:
      if run.dropped(run.first_id + rid, sample):  # (its slot retires at the next step)
        continue
      if rid not in run.started:
        run.started.add(rid)
        report.ttft_s.append(now - run.start - scheduler.arrivals[rid])
      stop_text = None
      if len(scheduler.requests[rid].stop):
        tokens = run.generated.setdefault((rid, sample), [])
        found = _find_stop(tokens, new, scheduler.requests[rid].stop, self.detokenize)
        if found is not None:  # the sample ends at that token: later ones are dropped
          end, stop_text = found
          new, reason = new[:end], "stop"
          logprobs, top = (x if x is None else x[:end] for x in (logprobs, top))
          run.aborting.append((rid, sample))  # (its slot retires at the next step)
        tokens += new
      report.generated_tokens += len(new)
      yield run.first_id + rid, sample, new, reason, logprobs, top, *prompt, stop_text
      if stop_text is not None:  # (once its tokens are delivered) no more of them
        run.aborted_samples.add((run.first_id + rid, sample))
    # The page bookkeeping once the caller has the tokens.
    scheduler.settle(plan, out.page_table, out.num_free)
    report.peak_pages_in_use = self._cache.peak_used_pages
    if scheduler.finished:
      self._finish()

  def _finish(self) -> None:
    """Ends a run whose requests have all finished: every sequence's pages back (the
    cached ones stay for the next run) and the report completed."""
    run, report, cache = self._run, self.report, self._cache
    retain, release = run.scheduler.pending_release()
    self.kv = self.runner.update_pages(self.kv, retain=retain, release=release)
    self._end_run()
    report.preemptions = run.scheduler.num_preemptions
    report.elapsed_s = time.perf_counter() - run.start
    report.kv_efficiency = cache.efficiency
    report.prompt_tokens = cache.prompt_tokens
    report.cached_prompt_tokens = cache.cached_prompt_tokens
    report.pages_saved = cache.pages_saved
    report.evicted_pages = cache.evicted_pages


@dataclasses.dataclass
class _Run:
  """A run in progress: its clock's start, its scheduler, its first request's id, the
  requests (scheduler ids) that have had their first token, the requests aborted
  (`Engine.abort_request`) and those still to drop from the scheduler."""

  start: float
  scheduler: Scheduler
  first_id: int = 0
  started: set[int] = dataclasses.field(default_factory=set)
  aborted: set[int] = dataclasses.field(default_factory=set)  # caller's ids
  # (caller's id, sample) of samples aborted alone
  aborted_samples: set[tuple[int, int]] = dataclasses.field(default_factory=set)
  # (scheduler id, sample or None: every sample), pending
  aborting: list[tuple[int, int | None]] = dataclasses.field(default_factory=list)

  # (scheduler id, sample) -> the tokens generated so far, of samples with stop texts
  generated: dict[tuple[int, int], list[int]] = dataclasses.field(default_factory=dict)

  def dropped(self, request_id: int, sample: int) -> bool:
    """Whether this sample's tokens are no longer delivered (caller's id)."""
    return request_id in self.aborted or (request_id, sample) in self.aborted_samples


def _events(rid: int, sample: int, tokens: list[int], reason: str | None,
            logprobs: list[float] | None = None, top_logprobs: list[tuple] | None = None,
            prompt_logprobs: tuple | None = None, prompt_top_logprobs: tuple | None = None,
            stop_text: str | None = None) -> Iterator[TokenEvent]:
  """A sequence's new tokens as events, the finish reason (and stop text) on the last and
  the prompt's log-probabilities on the first."""
  last = len(tokens) - 1
  for j, token in enumerate(tokens):
    yield TokenEvent(rid, token, reason if j == last else None, sample,
                     None if logprobs is None else logprobs[j],
                     None if top_logprobs is None else top_logprobs[j],
                     *((prompt_logprobs, prompt_top_logprobs) if j == 0 else (None, None)),
                     stop_text if j == last else None)


def _find_stop(tokens: list[int], new: list[int], stops: Sequence[str],
               detokenize: Callable[[Sequence[int]], str]) -> tuple[int, str] | None:
  """(how many of `new` run up to the first whose text completes one of `stops`, that
  stop text), or None: `tokens` are the sample's earlier tokens (whose text holds none).
  Each token's check decodes only the last tokens that can hold a stop text (a character
  takes at most 4 byte-level tokens), so a long completion costs no more per token; the
  replacement characters at the ends of that text are left out (a character cut at the
  window's start, or not yet complete at its end: the next tokens may complete it)."""
  window = 4 * max(map(len, stops)) + 2
  context = tokens[-window:] + new
  for j in range(len(new)):
    end = len(context) - len(new) + j + 1
    text = detokenize(context[max(0, end - window):end]).strip("\ufffd")
    found = [(at, stop) for stop in stops if (at := text.find(stop)) >= 0]
    if found:
      return j + 1, min(found)[1]
  return None
