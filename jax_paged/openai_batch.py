"""Offline batches of OpenAI requests: `jax-paged-batch` / `python -m jax_paged.openai_batch`
(vLLM's `run_batch`, in OpenAI's batch file format).

    jax-paged-batch --checkpoint path/to/model -i requests.jsonl -o results.jsonl

Each input line is a request, as OpenAI's Batch API takes it:

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

with `url` /v1/completions or /v1/chat/completions and `body` what `jax-paged-serve` takes
there (every field, `stream` excepted). Each output line, in the input's order:

    {"id": "batch_req_...", "custom_id": "q1", "error": null,
     "response": {"status_code": 200, "request_id": "...", "body": <the server's answer>}}

A request the server would refuse gets its status code and OpenAI's error object as the
body; a line that is not a request (not JSON, no custom_id, another method or url) gets
`"response": null` and an `error` {"code", "message"}. Every request is submitted at once
and the engine, in this process, batches them (continuous batching over the paged pool),
so a file of thousands runs at the engine's throughput; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from typing import Any, Sequence, TextIO

from jax_paged.cli import (CLIError, _notice, add_engine_arguments, load_model, make_engine,
                           parse_model_args)
from jax_paged.openai_server import (APIError, Answer, Served, add_served_arguments,
                                     engine_refusal, parse_chat, parse_completion,
                                     read_chat_template, resolve_families, served_of)
from jax_paged.serving.engine import Engine

PROG = "jax-paged-batch"
ROUTES = {"/v1/completions": parse_completion, "/v1/chat/completions": parse_chat}
# Seconds between progress lines.
PROGRESS_EVERY = 5.0


def _line_error(custom_id: Any, code: str, message: str) -> dict:
  return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
          "error": {"code": code, "message": message}}


def _line_response(custom_id: Any, status: int, body: dict) -> dict:
  return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
          "response": {"status_code": status, "request_id": uuid.uuid4().hex, "body": body},
          "error": None}


def run_batch(engine: Engine, served: Served, lines: Sequence[str], *,
              seed: int | None = None, progress: TextIO | None = None) -> list[dict]:
  """The output lines (objects) of input `lines` (JSON texts), in their order: each
  request parsed as the server parses it, all of them added to `engine` (idle), which
  runs until every one has finished. `seed` seeds the draws of requests without one
  (None: at random); `progress`, if given, gets a line every few seconds."""
  if engine.has_unfinished_requests():
    raise ValueError("engine has a run in progress: run_batch takes an idle engine")
  rng = random.Random(seed)
  outputs: list[dict | None] = [None] * len(lines)
  custom_ids: dict[int, str] = {}  # line -> its custom_id (requests that run)
  answers: dict[int, tuple[Answer, list[int]]] = {}  # line -> its answer, engine ids
  owner: dict[int, int] = {}  # engine id -> line
  for i, text in enumerate(lines):
    try:
      line = json.loads(text)
    except json.JSONDecodeError as e:
      outputs[i] = _line_error(None, "invalid_json", f"line {i + 1} is not JSON: {e}")
      continue
    custom_id = line.get("custom_id") if isinstance(line, dict) else None
    if not (isinstance(line, dict) and isinstance(custom_id, str)
            and line.get("method") == "POST" and line.get("url") in ROUTES
            and isinstance(line.get("body"), dict)):
      outputs[i] = _line_error(custom_id, "invalid_request", (
          f"line {i + 1} must be {{\"custom_id\": a text, \"method\": \"POST\", \"url\": "
          f"one of {sorted(ROUTES)}, \"body\": an object}}"))
      continue
    try:
      if line["body"].get("stream"):
        raise APIError(400, "stream is not supported in a batch", "stream")
      completion = ROUTES[line["url"]](line["body"], served, rng)
      try:
        ids = engine.add_requests(completion.requests)
      except ValueError as e:  # (the engine's limits: all of the line's prompts or none)
        raise engine_refusal(e) from e
    except APIError as e:
      outputs[i] = _line_response(custom_id, e.status, e.body())
      continue
    answers[i] = (Answer(completion, served), ids)
    custom_ids[i] = custom_id
    owner.update((rid, i) for rid in ids)
  start = last = time.perf_counter()
  tokens = 0
  left = len(answers)
  while engine.has_unfinished_requests():
    by_line: dict[int, list] = {}
    for event in engine.step():
      by_line.setdefault(owner[event.request_id], []).append(event)
    for i, events in by_line.items():
      answer, ids = answers[i]
      tokens += len(events)
      if answer.take(events, ids) and all(c.finish_reason is not None
                                          for c in answer.choices):
        left -= 1
    if progress is not None and time.perf_counter() - last > PROGRESS_EVERY:
      last = time.perf_counter()
      print(f"{PROG}: {len(answers) - left} of {len(answers)} requests done, "
            f"{tokens / (last - start):,.0f} tokens/s", file=progress, flush=True)
  for i, (answer, _) in answers.items():
    outputs[i] = _line_response(custom_ids[i], 200, answer.whole())
  return outputs


def parse_args(argv: Sequence[str] | None, families) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog=PROG, description="Run a file of OpenAI completions / chat completions requests "
                             "(OpenAI's batch format, JSON lines) through the engine and "
                             "write their answers.")
  p.add_argument("-i", "--input-file", required=True, metavar="FILE",
                 help="the requests, one JSON object per line ('-': stdin)")
  p.add_argument("-o", "--output-file", required=True, metavar="FILE",
                 help="where the answers go, one per line in the input's order ('-': stdout)")
  add_served_arguments(p, families)
  # Throughput, not latency: generation's steps per device call.
  add_engine_arguments(p, steps_per_call=128)
  return parse_model_args(p, argv)


def main(argv: Sequence[str] | None = None, family_refs: Sequence[str] | None = None
         ) -> int:
  """The command; `family_refs` as `openai_server.main`'s."""
  try:
    families = resolve_families(family_refs)
    args = parse_args(argv, families)
    try:
      source = sys.stdin if args.input_file == "-" else open(args.input_file,
                                                              encoding="utf-8")
    except OSError as e:
      raise CLIError(f"cannot read --input-file: {e}") from e
    with source:
      lines = [line for line in source.read().splitlines() if line.strip()]
    chat_template = read_chat_template(args.chat_template, args.checkpoint)
    loaded = load_model(args, families, PROG)
    engine = make_engine(args, loaded)
    served = served_of(args, engine.spec, loaded.codec, chat_template)
    start = time.perf_counter()
    outputs = run_batch(engine, served, lines, progress=sys.stderr)
    try:
      sink = sys.stdout if args.output_file == "-" else open(args.output_file, "w",
                                                             encoding="utf-8")
    except OSError as e:
      raise CLIError(f"cannot write --output-file: {e}") from e
    with sink:
      for out in outputs:
        sink.write(json.dumps(out) + "\n")
    failed = sum(out["response"] is None or out["response"]["status_code"] != 200
                 for out in outputs)
    _notice(f"{len(outputs)} requests in {time.perf_counter() - start:.1f} s, {failed} "
            "failed", PROG)
    return 0
  except CLIError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
