"""What an engine did: a run's tokens, timings and page use (`Report`); its load now and
its counts since it was built (`EngineStats`, for monitoring a server)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


@dataclasses.dataclass
class Report:
  """What a run did. Times count from the run's start, when `generate` is called (a
  stream: when it is first advanced; `add_request` finding the engine idle), so they
  include validating the requests: `ttft_s` holds each request's time to its first token
  less its arrival (its `arrival_s`, counted from its `add_request` for one added to a
  run in progress), in the order the first tokens came; `elapsed_s` the whole run.
  `peak_pages_in_use` is the most pages the pool held at once (finished sequences hold
  theirs until their device call returns); `kv_efficiency` is live tokens /
  token slots of the pages held, summed over every decode step: the fraction of reserved
  KV memory holding data. Neither depends on the steps per device call.
  `generated_tokens` counts the tokens delivered (not those of an aborted request that
  its device call produced after the abort)."""

  num_requests: int = 0
  generated_tokens: int = 0
  elapsed_s: float = 0.0
  ttft_s: list[float] = dataclasses.field(default_factory=list)
  peak_pages_in_use: int = 0
  num_pages: int = 0
  kv_efficiency: float = 0.0
  preemptions: int = 0
  aborted: int = 0            # requests dropped by `Engine.abort_request`
  decode_calls: int = 0
  prefill_calls: int = 0
  decode_steps: int = 0       # device decode steps (speculative rounds) run over the rows
  decode_tokens: int = 0      # tokens those steps produced
  decode_s: float = 0.0       # wall time of the decode calls (until their tokens are back)
  prefill_s: float = 0.0      # wall time of the prefill-only calls
  prompt_tokens: int = 0          # context tokens admitted (a preempted one counts again)
  cached_prompt_tokens: int = 0   # ... of which served from the prefix cache
  pages_saved: int = 0            # pages shared (prefix cache hits, forks) instead of filled
  evicted_pages: int = 0          # cached pages evicted to make room
  draft_tokens: int = 0       # speculative drafts verified (`Engine(speculation=...)`)
  accepted_tokens: int = 0    # ... of which kept

  @property
  def prefix_hit_rate(self) -> float:
    return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

  @property
  def tokens_per_s(self) -> float:
    return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

  def __str__(self) -> str:
    ttft = np.asarray(self.ttft_s) * 1e3 if self.ttft_s else np.zeros(1)
    return "\n".join([
        f"requests: {self.num_requests}  generated tokens: {self.generated_tokens}  "
        f"time: {self.elapsed_s:.2f} s",
        f"time to first token: mean {ttft.mean():.1f} ms, p50 {np.median(ttft):.1f} ms, "
        f"max {ttft.max():.1f} ms",
        f"KV pages: peak {self.peak_pages_in_use} of {self.num_pages} in use; memory "
        f"efficiency {self.kv_efficiency:.1%} (live tokens / reserved slots"
        f"{'; above 100%: sequences shared pages' if self.kv_efficiency > 1 else ''})",
        f"prefix cache: {self.cached_prompt_tokens} of {self.prompt_tokens} prompt tokens "
        f"({self.prefix_hit_rate:.1%}) served from cached pages; {self.pages_saved} pages "
        f"shared instead of filled; {self.evicted_pages} evicted",
        f"preemptions: {self.preemptions}  "
        + (f"aborted requests: {self.aborted}  " if self.aborted else "")
        + f"prefill calls: {self.prefill_calls} "
        f"({self.prefill_s:.2f} s)  decode calls: {self.decode_calls} ({self.decode_s:.2f} s, "
        f"{self.decode_steps} steps, {self.decode_tokens / max(1, self.decode_steps):.1f} "
        f"sequences per step, {1e3 * self.decode_s / max(1, self.decode_steps):.2f} ms per "
        f"step)",
        *([f"speculative decoding: {self.accepted_tokens} of {self.draft_tokens} drafts "
           f"kept ({self.accepted_tokens / self.draft_tokens:.1%}); a sequence took "
           f"{self.decode_tokens / max(1, self.decode_tokens - self.accepted_tokens):.2f} "
           "tokens per step"] if self.draft_tokens else []),
        f"throughput: {self.tokens_per_s:.1f} tokens/s",
    ])


class EngineStats(NamedTuple):
  """A snapshot of an engine (`Engine.stats()`): its load now, and counts since it was
  built (every run's, aborted ones included).

  Attributes:
    running: sequences in slots, prefilling or decoding (a request's samples each).
    waiting: sequences submitted and not yet admitted (preempted ones again).
    pages_in_use: pages sequences hold (a shared page once; cached pages no sequence
      uses are free to take, not counted).
    cached_pages: pages the prefix cache holds (in use or not; those no sequence uses
      are evictable).
    num_pages: the pool's pages.
    prompt_tokens: context tokens admitted (a preempted context counts again).
    cached_prompt_tokens: those served from the prefix cache.
    generated_tokens: tokens delivered.
    preemptions: sequences preempted (their pages freed, to be recomputed).
    draft_tokens, accepted_tokens: speculative drafts verified, and kept.
    max_loras: the LoRA adapters the engine holds at once (0: it serves none).
    running_loras, waiting_loras: the adapters of the running and the waiting sequences
      (sorted names, comma-separated; "" for none).
  """

  running: int
  waiting: int
  pages_in_use: int
  cached_pages: int
  num_pages: int
  prompt_tokens: int
  cached_prompt_tokens: int
  generated_tokens: int
  preemptions: int
  draft_tokens: int
  accepted_tokens: int
  max_loras: int = 0
  running_loras: str = ""
  waiting_loras: str = ""
