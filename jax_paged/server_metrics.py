"""The OpenAI server's metrics in Prometheus' text format (`GET /metrics`), named as vLLM
names its own with this package's prefix (`vllm:time_to_first_token_seconds` is
`jax_paged:time_to_first_token_seconds` here), so that a vLLM dashboard needs only the
prefix changed.

Two sources: the server counts what its clients see (requests, their times to the first
token and to the last, tokens, finish reasons, responses by status), and the engine
reports its load and page use after each device call (`EngineStats`, which crosses from
the engine's process with its events).
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Sequence

from jax_paged.serving.report import EngineStats

PREFIX = "jax_paged:"

# vLLM's buckets (seconds; below 10 ms per output token, finer ones of our own: GPT-2 on
# an H200 decodes a step in ~1 ms).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

FINISH_REASONS = ("stop", "length", "abort")


class Histogram:
  """A Prometheus histogram: counts of observations at or below each bound, their sum."""

  def __init__(self, bounds: Sequence[float]):
    self.bounds = tuple(bounds)
    self.counts = [0] * (len(self.bounds) + 1)  # per bucket; the last: above every bound
    self.sum = 0.0

  def observe(self, value: float) -> None:
    self.counts[bisect.bisect_left(self.bounds, value)] += 1
    self.sum += value

  def lines(self, name: str, labels: str) -> list[str]:
    out, total = [], 0
    for bound, count in zip(self.bounds + (float("inf"),), self.counts):
      total += count
      le = "+Inf" if bound == float("inf") else repr(float(bound))
      out.append(f'{name}_bucket{{{labels},le="{le}"}} {total}')
    return out + [f"{name}_sum{{{labels}}} {self.sum!r}", f"{name}_count{{{labels}}} {total}"]


class ServerMetrics:
  """What a server counts, from its connections' threads (one lock), rendered by
  `render`.

  Per completion request (one HTTP request; its prompts and samples together):
  `received` when its body is parsed and the engine took it, `first_token` once, when
  its first token reaches the server, `finished` when its answer has been sent (or its
  client has gone). `responded` counts every response by status code.
  """

  def __init__(self, model_name: str):
    self.labels = f'model_name="{_escape(model_name)}"'
    self._lock = threading.Lock()
    self.prompt_tokens = 0
    self.generation_tokens = 0
    self.finished_choices = dict.fromkeys(FINISH_REASONS, 0)
    self.responses: dict[int, int] = {}
    self.ttft = Histogram(TTFT_BUCKETS)
    self.tpot = Histogram(TPOT_BUCKETS)
    self.latency = Histogram(LATENCY_BUCKETS)

  def received(self, prompt_tokens: int) -> None:
    with self._lock:
      self.prompt_tokens += prompt_tokens

  def first_token(self, seconds: float) -> None:
    with self._lock:
      self.ttft.observe(seconds)

  def finished(self, seconds: float, tokens: int, reasons: Sequence[str | None],
               per_token: float | None = None) -> None:
    """A request's end: `seconds` since it was received, the `tokens` it got, each
    choice's finish reason (None: unfinished, counted as "abort"), and the seconds per
    output token after its first (None: it had fewer than two)."""
    with self._lock:
      self.latency.observe(seconds)
      if per_token is not None:
        self.tpot.observe(per_token)
      self.generation_tokens += tokens
      for reason in reasons:
        self.finished_choices[reason or "abort"] += 1

  def responded(self, status: int) -> None:
    with self._lock:
      self.responses[status] = self.responses.get(status, 0) + 1

  def render(self, stats: EngineStats | None) -> str:
    """Every metric, in Prometheus' text format (version 0.0.4); the engine's from
    `stats` (None: not reported yet, rendered as zeros)."""
    if stats is None:
      stats = EngineStats(*[0] * (len(EngineStats._fields) - len(EngineStats._field_defaults)))
    labels = self.labels
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
      out.append(f"# HELP {PREFIX}{name} {help_}")
      out.append(f"# TYPE {PREFIX}{name} {kind}")
      out.extend(f"{PREFIX}{name}{{{labels}{extra}}} {value!r}" for extra, value in samples)

    with self._lock:
      metric("num_requests_running", "gauge",
             "Sequences in the engine's batch, prefilling or decoding (a request's "
             "samples each).", [("", stats.running)])
      metric("num_requests_waiting", "gauge",
             "Sequences waiting to be admitted (preempted ones again).",
             [("", stats.waiting)])
      metric("kv_cache_usage_perc", "gauge",
             "Fraction of the KV pool's pages that sequences hold (1 = full; cached pages "
             "no sequence uses are free to take).",
             [("", stats.pages_in_use / stats.num_pages if stats.num_pages else 0.0)])
      if stats.max_loras:  # (vLLM's: the labels say it, the value is when)
        metric("lora_requests_info", "gauge",
               "The LoRA adapters of the running and the waiting requests, and the slots.",
               [(f',running_lora_adapters="{stats.running_loras}",'
                 f'waiting_lora_adapters="{stats.waiting_loras}",'
                 f'max_lora="{stats.max_loras}"', time.time())])
      metric("num_preemptions_total", "counter",
             "Sequences preempted (pages freed, context recomputed).",
             [("", stats.preemptions)])
      metric("spec_decode_num_draft_tokens_total", "counter",
             "Speculative drafts verified.", [("", stats.draft_tokens)])
      metric("spec_decode_num_accepted_tokens_total", "counter",
             "Speculative drafts kept.", [("", stats.accepted_tokens)])
      metric("prompt_tokens_total", "counter",
             "Prompt tokens of the requests received (a prompt once, whatever n).",
             [("", self.prompt_tokens)])
      metric("generation_tokens_total", "counter", "Tokens generated and delivered.",
             [("", self.generation_tokens)])
      metric("prefix_cache_queries_total", "counter",
             "Context tokens the engine admitted and looked up in its prefix cache.",
             [("", stats.prompt_tokens)])
      metric("prefix_cache_hits_total", "counter",
             "Context tokens served from the prefix cache's pages.",
             [("", stats.cached_prompt_tokens)])
      metric("request_success_total", "counter",
             "Choices (a request's prompts x samples) ended, by finish reason (abort: "
             "unfinished, its client gone or the engine failed).",
             [(f',finished_reason="{r}"', n) for r, n in self.finished_choices.items()])
      metric("http_responses_total", "counter", "HTTP responses, by status code.",
             [(f',status="{code}"', n) for code, n in sorted(self.responses.items())])
      for name, help_, histogram in (
          ("time_to_first_token_seconds",
           "Time from a request's arrival to its first token reaching the server.",
           self.ttft),
          ("time_per_output_token_seconds",
           "A request's time per output token after its first (its longest choice's).",
           self.tpot),
          ("e2e_request_latency_seconds",
           "Time from a request's arrival to its answer's end.", self.latency)):
        out.append(f"# HELP {PREFIX}{name} {help_}")
        out.append(f"# TYPE {PREFIX}{name} histogram")
        out.extend(histogram.lines(PREFIX + name, labels))
    return "\n".join(out) + "\n"


def _escape(value: str) -> str:
  """A label value as Prometheus' text format writes it."""
  return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
