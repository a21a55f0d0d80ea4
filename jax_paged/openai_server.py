"""An OpenAI-compatible HTTP server: `jax-paged-serve` / `python -m jax_paged.openai_server`.

Serves one model (a Hugging Face checkpoint, or a preset with random weights) with the
continuous-batching engine, as `vllm serve` does, so that OpenAI clients and tools
(the `openai` package, lm-evaluation-harness' `local-completions`, curl) use it as is:

    GET  /v1/models             the served model (and its LoRA adapters)
    POST /v1/completions        OpenAI's completions: prompts (text or token ids) in,
                                completions out; "stream": true sends server-sent events
    POST /v1/chat/completions   OpenAI's chat completions: messages rendered by the
                                model's chat template (its checkpoint's, or
                                --chat-template), an assistant message out; streamed too
    POST /tokenize              vLLM's: a prompt text or chat messages -> token ids
    POST /detokenize            vLLM's: token ids -> text
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter
                                vLLM's runtime LoRA updates (--allow-lora-updates)
    GET  /health                200 while serving
    GET  /metrics               Prometheus metrics (`jax_paged.server_metrics`): requests
                                running and waiting, KV cache use, tokens, prefix cache
                                hits, times to the first token, per token and to the
                                end, finish reasons

With `--api-key` (or the environment's JAX_PAGED_API_KEY), every route but /health and
/metrics needs the header `Authorization: Bearer <key>` (else 401, as OpenAI answers).

Every HTTP connection gets a thread (the standard library's `ThreadingHTTPServer`); each
request's prompts go to the engine, which runs in a process of its own
(`jax_paged.serving.engine_loop.EngineProcess`), batching them with every other request's
and sending back their tokens as each device call ends. A completion whose client
disconnects is aborted (noticed at its next device call), freeing its pages.

Request fields: OpenAI's (`prompt`, `max_tokens` (default 16; null: the rest of the
model's context), `temperature` (default 1), `top_p`, `n`, `stream`, `stream_options`,
`stop`, `seed`, `logprobs`, `echo`, `presence_penalty`, `frequency_penalty`,
`logit_bias`, `best_of` (= n only), `user`) and vLLM's sampling extras (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `return_token_ids`:
the choices carry `token_ids` (streamed: each chunk's) and `prompt_token_ids`, for
clients that work in token ids or models without a tokenizer; `priority`, lower first,
with `--scheduling-policy priority`; `guided_choice`, texts the answer is one of: the most
likely, each scored whole after the prompt, or drawn by their likelihoods with a
temperature); structured output (`jax_paged.guided`): OpenAI's `response_format`
(json_object, json_schema) and vLLM's `guided_json`, `guided_regex` and
`structured_outputs` (json, regex, choice, json_object), each answer guided token by token
to a match. An unknown field,
a wrong type or a value out of range is answered 400 with an OpenAI error object naming
the field. `max_tokens: 0` with `echo` scores the prompt (lm-evaluation-harness'
log-likelihoods). Without a `seed`, each request draws one at random. Chat completions
take `messages` (text content only; assistants' `tool_calls` and `tool` messages too),
`max_completion_tokens` (or `max_tokens`; default: the rest of the context), `logprobs`
(true / false), `top_logprobs`, `add_generation_prompt` (default true), and `tools`,
`tool_choice` ("auto", the default with tools, needs `--tool-call-parser`; "none" leaves
the tools out of the prompt; "required" or a named function guides the answer to calls of
the tools) and `parallel_tool_calls` instead of the prompt fields; the calls an answer
writes come back as OpenAI's `tool_calls`.

Text: a completion's text leaves out the stop text that ended it and a final stop token
(eos), as OpenAI's and vLLM's do; its tokens count in `usage`. A streamed text holds
back a character until its bytes are complete and, with stop texts, what could be the
start of one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import hmac
import http.server
import importlib
import json
import math
import os
import random
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from typing import Any, Callable, Iterator, Sequence

from jax_paged.cli import (BYTES, CLIError, Codec, _float_in, _notice, add_engine_arguments,
                           add_model_arguments, load_model, load_tokenizer, make_engine,
                           model_families, parse_model_args)
from jax_paged.guided import Guide, GuideCache
from jax_paged.paged_model import ModelFamily, ModelSpec
from jax_paged.reasoning import REASONING_PARSERS, ThinkParser
from jax_paged.serving.engine import WARMUP_SAMPLING, Engine
from jax_paged.serving.engine_loop import EngineClosed, EngineLoop, EngineProcess, Submission
from jax_paged.serving.request import MAX_TOP_LOGPROBS, Request, TokenEvent, is_int
from jax_paged.serving.scheduler import SCHEDULING_POLICIES
from jax_paged.server_metrics import ServerMetrics
from jax_paged.tool_calls import (PARSERS as TOOL_PARSERS, NamedCallParser,
                                  RequiredCallsParser, ToolCall, ToolParser,
                                  required_calls_schema)

PROG = "jax-paged-serve"
# The fields both endpoints take: OpenAI's, then vLLM's sampling extras.
SAMPLING_FIELDS = (
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
    "seed", "presence_penalty", "frequency_penalty", "logit_bias", "user",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "return_token_ids", "priority", "guided_choice", "response_format", "guided_json",
    "guided_regex", "structured_outputs")
COMPLETION_FIELDS = SAMPLING_FIELDS + ("prompt", "logprobs", "echo", "best_of", "suffix")
CHAT_FIELDS = SAMPLING_FIELDS + ("messages", "max_completion_tokens", "logprobs",
                                 "top_logprobs", "add_generation_prompt", "tools",
                                 "tool_choice", "parallel_tool_calls", "chat_template_kwargs")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
TOKENIZE_FIELDS = ("model", "prompt", "messages", "add_special_tokens",
                   "add_generation_prompt", "return_token_strs", "chat_template_kwargs")
# What a template renders from the request's own fields, not from chat_template_kwargs.
_TEMPLATE_ARGUMENTS = ("messages", "tools", "add_generation_prompt")
DETOKENIZE_FIELDS = ("model", "tokens")
LOAD_LORA_FIELDS = ("lora_name", "lora_path")
# The routes anyone may read without the API key (a load balancer's, a scraper's).
OPEN_ROUTES = ("/health", "/metrics")
API_KEY_ENV = "JAX_PAGED_API_KEY"
# The largest request body read (a batch of long prompts as token ids is a few MB).
MAX_BODY_BYTES = 64 << 20


class APIError(Exception):
  """An error answered as OpenAI's error object, with its HTTP status."""

  def __init__(self, status: int, message: str, param: str | None = None,
               kind: str = "invalid_request_error", code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.kind, self.code = (
        status, message, param, kind, code)

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code}}


class ChatTemplate:
  """A Hugging Face chat template (Jinja), rendered as transformers' `apply_chat_template`
  renders it: a sandboxed environment with `trim_blocks` and `lstrip_blocks`, loop
  controls, the `tojson` filter and `raise_exception` / `strftime_now`; the tokenizer's
  special tokens (`bos_token`, `eos_token`, ...) as variables.

  Raises ValueError if the template does not parse, ImportError without jinja2.
  """

  def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
    import jinja2  # pylint: disable=import-outside-toplevel
    import jinja2.ext  # pylint: disable=import-outside-toplevel
    import jinja2.sandbox  # pylint: disable=import-outside-toplevel
    self._error = jinja2.TemplateError

    def raise_exception(message):
      raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
      return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                        sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
      self._template = env.from_string(source)
    except jinja2.TemplateError as e:
      raise ValueError(f"the chat template does not parse: {e}") from e
    self.special_tokens = dict(special_tokens or {})

  def render(self, messages: list[dict], add_generation_prompt: bool = True,
             tools: list[dict] | None = None, extra: dict[str, Any] | None = None) -> str:
    """The conversation (and the tools it may call, OpenAI's function objects, as
    transformers passes them) as the model's text, with `extra` variables (a request's
    chat_template_kwargs, e.g. Qwen3's enable_thinking); raises APIError if the template
    refuses it."""
    try:
      return self._template.render(**{**self.special_tokens, **(extra or {})},
                                   messages=messages, tools=tools,
                                   add_generation_prompt=add_generation_prompt)
    except self._error as e:
      raise APIError(400, f"the chat template refused the messages: {e}", "messages") from e


def read_chat_template(path: str | None, checkpoint: str | None) -> ChatTemplate | None:
  """The chat template of `path` (a Jinja file), else of the checkpoint (its
  tokenizer_config.json's "chat_template", or chat_template.jinja), with the
  checkpoint's special tokens; None if neither has one. Raises CLIError."""
  config = {}
  if checkpoint:
    try:
      with open(os.path.join(checkpoint, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    except FileNotFoundError:
      pass
    except (OSError, ValueError) as e:
      raise CLIError(f"{checkpoint}/tokenizer_config.json: not a readable JSON file "
                     f"({e})") from e
  source = config.get("chat_template")
  if isinstance(source, list):  # named templates: the default one
    source = next((t.get("template") for t in source if t.get("name") == "default"), None)
  where = "--chat-template"
  if path is None and checkpoint and source is None:
    path = os.path.join(checkpoint, "chat_template.jinja")
    where = "the checkpoint's chat_template.jinja"
    if not os.path.exists(path):
      return None
  if path is not None:
    try:
      with open(path, encoding="utf-8") as f:
        source = f.read()
    except (OSError, UnicodeDecodeError) as e:
      raise CLIError(f"{where} {path}: {e}") from e
  if source is None:
    return None
  special = {}
  for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
    token = config.get(name)
    token = token.get("content") if isinstance(token, dict) else token
    if isinstance(token, str):
      special[name] = token
  try:
    return ChatTemplate(source, special)
  except ImportError as e:
    raise CLIError("a chat template needs the `jinja2` package (pip install jinja2)") from e
  except ValueError as e:
    raise CLIError(str(e)) from e


@dataclasses.dataclass(frozen=True)
class Served:
  """What the server serves: the model's name in the API, its spec, its text codec (None:
  token ids only), the tokens that end a completion unless `ignore_eos`, its chat
  template (None: no chat completions), tool call parser (None: no tool calls), whether
  requests' `priority` orders them, its adapters and how chat answers' reasoning is
  split from their content (None: not split)."""

  name: str
  spec: ModelSpec
  codec: Codec | None
  eos_token_ids: tuple[int, ...]
  chat_template: ChatTemplate | None = None
  tool_parser: ToolParser | None = None  # how chat answers' tool calls are read
  prioritizes: bool = False  # the engine schedules by priority (`Request.priority`)
  # LoRA adapters served as models of their own names (a list: runtime updates change it)
  loras: Sequence[str] = ()
  lora_updates: bool = False  # adapters may be loaded and unloaded over the API
  reasoning_parser: ThinkParser | None = None
  # Structured output's guides over the codec's vocabulary (None without a codec).
  guides: GuideCache | None = dataclasses.field(default=None, compare=False, repr=False)

  def __post_init__(self):
    object.__setattr__(self, "loras", list(self.loras))
    if self.guides is None and self.codec is not None:
      object.__setattr__(self, "guides", GuideCache(self.codec.token_bytes,
                                                    self.eos_token_ids))


@dataclasses.dataclass
class Completion:
  """A parsed request: one engine request per prompt (its `n` samples are the choices
  prompt-major), and how to answer."""

  requests: list[Request]
  prompts: list[list[int]]
  chat: bool  # a chat completion (else a text completion)
  echo: bool
  logprobs: int | None  # top log-probabilities per token, None: none
  stream: bool
  include_usage: bool
  scores_only: bool  # max_tokens 0 with echo: the generated token is dropped
  return_token_ids: bool  # choices carry their token ids (vLLM's return_token_ids)
  tool_parser: ToolParser | None = None  # reads the choices' tool calls (chat, tools given)
  parallel_tool_calls: bool = True  # else a choice keeps its first call only
  # (guided_choice) the choices' texts and token ids: `requests` score each after each
  # prompt, prompt-major, and each answer's choice is drawn from their likelihoods.
  guided: tuple[list[str], list[list[int]]] | None = None
  samples: int = 1  # (guided_choice) choices drawn per prompt
  temperature: float = 0.0  # (guided_choice) of the draw; 0: the most likely
  seed: int = 0  # (guided_choice) of the draw

  @property
  def n(self) -> int:
    """Choices per prompt."""
    return self.requests[0].n if self.guided is None else self.samples


def _number(body: dict, name: str, default, lo: float, hi: float, *, lo_open: bool = False,
            what: str) -> float:
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      (lo < value if lo_open else lo <= value) and value <= hi):
    raise APIError(400, f"{name} must be {what}, got {value!r}", name)
  return float(value)


def _integer(body: dict, name: str, default, lo: int, hi: float = float("inf")) -> int:
  value = body.get(name)
  if value is None:
    return default
  if not is_int(value) or not lo <= value <= hi:
    span = f">= {lo}" if hi == float("inf") else f"in [{lo}, {hi}]"
    raise APIError(400, f"{name} must be an integer {span}, got {value!r}", name)
  return int(value)


def _boolean(body: dict, name: str, default: bool = False) -> bool:
  value = body.get(name, default)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise APIError(400, f"{name} must be true or false, got {value!r}", name)
  return value


def _check_body(body: Any, served: Served, fields: tuple[str, ...]) -> dict:
  if not isinstance(body, dict):
    raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}")
  unknown = sorted(set(body) - set(fields))
  if unknown:
    raise APIError(400, f"unknown fields {unknown}; this endpoint takes "
                        f"{', '.join(fields)}", unknown[0])
  model = body.get("model")
  if model is not None and model != served.name and model not in served.loras:
    raise APIError(404, f"the model {model!r} does not exist: this server serves "
                        f"{', '.join(map(repr, (served.name, *served.loras)))}", "model",
                   code="model_not_found")
  return body


def _lora(body: dict, served: Served) -> str | None:
  """The LoRA adapter a request's `model` names (vLLM's way), or None: the base model."""
  model = body.get("model")
  return model if model in served.loras else None


def _prompts(body: dict, served: Served) -> list[list[int]]:
  """`prompt` as token ids: a text, a list of texts, a list of token ids, or a list of
  lists of token ids."""
  prompt = body.get("prompt")
  if isinstance(prompt, str):
    prompt = [prompt]
  elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
    prompt = [prompt]
  if not (isinstance(prompt, list) and prompt and all(
      isinstance(p, str) or (isinstance(p, list) and all(is_int(t) for t in p))
      for p in prompt)):
    raise APIError(400, "prompt must be a text, a list of texts, a list of token ids or a "
                        f"list of lists of token ids (none empty), got {prompt!r:.200}",
                   "prompt")
  if any(isinstance(p, str) for p in prompt) and served.codec is None:
    raise APIError(400, "this model has no tokenizer: give prompt as token ids", "prompt")
  ids = [served.codec.encode(p) if isinstance(p, str) else p for p in prompt]
  for i, p in enumerate(ids):
    if not p:
      raise APIError(400, f"prompt[{i}] is empty", "prompt")
    bad = [t for t in p if not 0 <= t < served.spec.vocab_size]
    if bad:
      raise APIError(400, f"prompt[{i}]: token ids {bad[:5]} outside [0, vocab_size="
                          f"{served.spec.vocab_size})", "prompt")
  return ids


def parse_completion(body: Any, served: Served, rng: random.Random) -> Completion:
  """A completion request's JSON body (POST /v1/completions) as engine requests; raises
  APIError naming the field at fault."""
  _check_body(body, served, COMPLETION_FIELDS)
  if body.get("suffix") is not None:
    raise APIError(400, "suffix (insertion) is not supported", "suffix")
  prompts = _prompts(body, served)
  echo = _boolean(body, "echo")
  max_tokens = body.get("max_tokens", 16)
  scores_only = False
  if max_tokens is not None:
    max_tokens = _integer(body, "max_tokens", 16, 0)
    if max_tokens == 0:
      if not echo:
        raise APIError(400, "max_tokens 0 generates nothing: give it with echo (scoring "
                            "the prompt) or ask for at least 1", "max_tokens")
      if _boolean(body, "stream"):
        raise APIError(400, "max_tokens 0 (scoring) is not streamed: give stream false",
                       "stream")
      max_tokens, scores_only = 1, True
  n = _integer(body, "n", 1, 1)
  if body.get("best_of") is not None and body["best_of"] != n:
    raise APIError(400, f"best_of must equal n ({n}): completions are not ranked",
                   "best_of")
  logprobs = body.get("logprobs")
  if logprobs is not None:
    logprobs = _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
  return _completion(body, served, rng, prompts, max_tokens, chat=False, echo=echo,
                     logprobs=logprobs, scores_only=scores_only)


def _message_text(message: Any, i: int) -> dict:
  """A chat message as the template takes it: its role and its content as one text; an
  assistant's tool calls with their arguments as objects (templates write them as JSON;
  the API sends JSON text), and its content may then be absent."""
  if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
    raise APIError(400, f"messages[{i}] must be an object with a role in {CHAT_ROLES}, got "
                        f"{message!r:.200}", "messages")
  calls = message.get("tool_calls")
  if calls is not None:
    if message["role"] != "assistant" or not isinstance(calls, list):
      raise APIError(400, f"messages[{i}].tool_calls: a list, in an assistant's message",
                     "messages")
    parsed = []
    for j, call in enumerate(calls):
      function = call.get("function") if isinstance(call, dict) else None
      try:
        arguments = json.loads(function["arguments"])
      except (TypeError, KeyError, ValueError):
        arguments = None
      if not (isinstance(arguments, dict) and isinstance(function.get("name"), str)):
        raise APIError(400, f"messages[{i}].tool_calls[{j}] must be {{\"id\": ..., \"type\": "
                            f"\"function\", \"function\": {{\"name\": ..., \"arguments\": "
                            f"JSON text of an object}}}}, got {call!r:.200}", "messages")
      parsed.append(dict(call, function=dict(function, arguments=arguments)))
    message = dict(message, tool_calls=parsed)
    if message.get("content") is None:
      return dict(message, content="")
  content = message.get("content")
  if isinstance(content, list):  # parts: only text ones
    if not all(isinstance(part, dict) and part.get("type") == "text"
               and isinstance(part.get("text"), str) for part in content):
      raise APIError(400, f"messages[{i}].content: only text parts ({{\"type\": \"text\", "
                          f"\"text\": ...}}) are supported, got {content!r:.200}", "messages")
    content = "".join(part["text"] for part in content)
  if not isinstance(content, str):
    raise APIError(400, f"messages[{i}].content must be a text or a list of text parts, "
                        f"got {content!r:.200}", "messages")
  return dict(message, content=content)


def _tools(body: dict, served: Served
           ) -> tuple[list[dict] | None, ToolParser | None, dict | None]:
  """`tools` and `tool_choice`: (the tools the prompt shows, the parser of the answer's
  calls, the JSON schema a guide holds the answer to), all None without tools or with
  tool_choice "none". "auto" (the default with tools) needs the server's
  --tool-call-parser (the model's format, unguided); "required" (a list of calls,
  `required_calls_schema`) and a named function (its arguments) are guided (vLLM's)."""
  tools, choice = body.get("tools"), body.get("tool_choice")
  if tools is None:
    if choice not in (None, "none"):
      raise APIError(400, "tool_choice needs tools", "tool_choice")
    return None, None, None
  name = re.compile(r"[A-Za-z0-9_-]{1,64}")
  if not (isinstance(tools, list) and tools and all(
      isinstance(t, dict) and t.get("type") == "function" and set(t) <= {"type", "function"}
      and isinstance(f := t.get("function"), dict)
      and set(f) <= {"name", "description", "parameters", "strict"}
      and isinstance(f.get("name"), str) and name.fullmatch(f["name"])
      and isinstance(f.get("description", ""), str)
      and isinstance(f.get("parameters", {}), dict) for t in tools)):
    raise APIError(400, "tools must be a non-empty list of {\"type\": \"function\", "
                        "\"function\": {\"name\" (letters, digits, _ or -, up to 64), "
                        "\"description\", \"parameters\" (a JSON schema)}}", "tools")
  choice = "auto" if choice is None else choice
  if choice == "none":
    return None, None, None
  if choice == "required":
    return (tools, RequiredCallsParser(),
            required_calls_schema(tools, _boolean(body, "parallel_tool_calls", True)))
  if isinstance(choice, dict):
    named = choice.get("function", {}).get("name") if isinstance(
        choice.get("function"), dict) else None
    chosen = [t for t in tools if t["function"]["name"] == named]
    if choice.get("type") != "function" or not chosen:
      raise APIError(400, f"tool_choice {choice!r:.100} must be {{\"type\": \"function\", "
                          "\"function\": {\"name\": NAME}} naming one of the tools",
                     "tool_choice")
    schema = chosen[0]["function"].get("parameters") or {"type": "object"}
    return tools, NamedCallParser(named), schema
  if choice != "auto":
    raise APIError(400, f"tool_choice must be \"auto\", \"none\", \"required\" or a "
                        f"named function, got {choice!r:.100}", "tool_choice")
  if served.tool_parser is None:
    raise APIError(400, "tool calls need the server started with --tool-call-parser "
                        f"({', '.join(TOOL_PARSERS)}, the model's format)", "tool_choice")
  return tools, served.tool_parser, None


def _chat_prompt(body: dict, served: Served, add_special_tokens: bool = False,
                 tools: list[dict] | None = None) -> list[int]:
  """`messages` (and `add_generation_prompt`, `tools`) rendered by the model's chat
  template and tokenized, by default without the tokenizer's own special tokens (the
  template writes them)."""
  if served.chat_template is None or served.codec is None:
    raise APIError(400, "this model has no chat template (its checkpoint's "
                        "tokenizer_config.json has none): start the server with "
                        "--chat-template FILE, or use /v1/completions", "messages")
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise APIError(400, "messages must be a non-empty list of messages", "messages")
  extra = body.get("chat_template_kwargs")
  if extra is not None and not (isinstance(extra, dict) and all(
      isinstance(k, str) and k not in _TEMPLATE_ARGUMENTS for k in extra)):
    raise APIError(400, "chat_template_kwargs must be an object of the template's extra "
                        f"variables (not {', '.join(_TEMPLATE_ARGUMENTS)}, which are "
                        f"fields of their own), got {extra!r:.200}", "chat_template_kwargs")
  text = served.chat_template.render([_message_text(m, i) for i, m in enumerate(messages)],
                                     _boolean(body, "add_generation_prompt", True), tools,
                                     extra)
  ids = served.codec.encode(text, add_special_tokens=add_special_tokens)
  if not ids:
    raise APIError(400, "the chat template made the messages an empty text", "messages")
  return ids


def tokenize(body: Any, served: Served) -> dict:
  """POST /tokenize (vLLM's): `prompt`, a text (with the tokenizer's special tokens, a
  BOS, unless `add_special_tokens` is false), or `messages`, rendered as a chat
  completion renders them (`add_generation_prompt`; specials only with
  `add_special_tokens` true), as token ids: {"count", "max_model_len", "tokens",
  "token_strs" (with `return_token_strs`, each token's text, special tokens included;
  else null)}."""
  _check_body(body, served, TOKENIZE_FIELDS)
  if served.codec is None:
    raise APIError(400, "this model has no tokenizer", "prompt")
  if ("prompt" in body) == ("messages" in body):
    raise APIError(400, "give either prompt (a text) or messages", "prompt")
  if "prompt" in body:
    if body.get("add_generation_prompt") is not None:
      raise APIError(400, "add_generation_prompt goes with messages", "add_generation_prompt")
    if not isinstance(body["prompt"], str):
      raise APIError(400, f"prompt must be a text, got {body['prompt']!r:.200}", "prompt")
    ids = served.codec.encode(body["prompt"],
                              add_special_tokens=_boolean(body, "add_special_tokens", True))
  else:
    ids = _chat_prompt(body, served, _boolean(body, "add_special_tokens", False))
  strs = None
  if _boolean(body, "return_token_strs"):
    strs = [served.codec.decode([t], skip_special_tokens=False) for t in ids]
  return {"count": len(ids), "max_model_len": served.spec.max_positions, "tokens": ids,
          "token_strs": strs}


def update_loras(path: str, body: Any, served: Served,
                 loop: EngineLoop | EngineProcess) -> dict:
  """POST /v1/load_lora_adapter ({"lora_name", "lora_path"}: a PEFT adapter directory on
  the server's machine) or /v1/unload_lora_adapter ({"lora_name"}), vLLM's runtime LoRA
  updates: the engine registers or drops the adapter between device calls, and its name
  is a model of its own from then on (or no longer). Only with `served.lora_updates`."""
  if not served.lora_updates:
    raise APIError(403, "runtime LoRA updates are off: start the server with "
                        "--allow-lora-updates", kind="permission_error")
  load = path == "/v1/load_lora_adapter"
  fields = LOAD_LORA_FIELDS if load else LOAD_LORA_FIELDS[:1]
  if not isinstance(body, dict):
    raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}")
  unknown = sorted(set(body) - set(fields))
  if unknown:
    raise APIError(400, f"unknown fields {unknown}; this endpoint takes {', '.join(fields)}",
                   unknown[0])
  for field in fields:
    if not isinstance(body.get(field), str) or not body[field]:
      raise APIError(400, f"{field} must be a non-empty string, got {body.get(field)!r}",
                     field)
  name = body["lora_name"]
  if name == served.name:
    raise APIError(400, f"lora_name {name!r} is the served model's name", "lora_name")
  try:
    names = loop.add_lora(name, body["lora_path"]) if load else loop.remove_lora(name)
  except KeyError as e:
    raise APIError(404, str(e.args[0]), "lora_name", code="model_not_found") from e
  except (ValueError, FileNotFoundError) as e:
    raise APIError(400, str(e), "lora_path" if load else "lora_name") from e
  served.loras[:] = names
  return {"object": "list", "data": [{"id": n, "object": "model", "parent": served.name}
                                     for n in names]}


def detokenize(body: Any, served: Served) -> dict:
  """POST /detokenize (vLLM's): `tokens`, token ids, as {"prompt": their text, special
  tokens included}."""
  _check_body(body, served, DETOKENIZE_FIELDS)
  if served.codec is None:
    raise APIError(400, "this model has no tokenizer", "tokens")
  tokens = body.get("tokens")
  if not (isinstance(tokens, list) and all(is_int(t) for t in tokens)):
    raise APIError(400, f"tokens must be a list of token ids, got {tokens!r:.200}", "tokens")
  size = served.codec.vocab_size  # (the tokenizer's: a model's may be padded beyond it)
  bad = [t for t in tokens if not 0 <= t < size]
  if bad:
    raise APIError(400, f"token ids {bad[:5]} outside the tokenizer's [0, {size})", "tokens")
  return {"prompt": served.codec.decode(tokens, skip_special_tokens=False)}


def engine_refusal(error: ValueError) -> APIError:
  """The 400 of a completion the engine cannot serve (`Engine.add_requests`' error,
  naming its prompt)."""
  return APIError(400, str(error).replace("requests[", "prompt["))


# Structured output's fields, each a way to give the one guide of a request.
GUIDE_FIELDS = ("response_format", "guided_json", "guided_regex", "structured_outputs")


def _guide(body: dict, served: Served, tool_schema: dict | None) -> Guide | None:
  """The guide of `response_format` (OpenAI's json_object / json_schema), vLLM's
  `guided_json` / `guided_regex` and `structured_outputs` (json, regex, choice,
  json_object), or tool_choice's `tool_schema`: at most one; None without."""
  given = [name for name in GUIDE_FIELDS if body.get(name) is not None]
  fmt = body.get("response_format")
  if fmt is not None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text" and set(fmt) == {"type"}:
      given.remove("response_format")
    elif not (kind == "json_object" and set(fmt) == {"type"}) and not (
        kind == "json_schema" and set(fmt) == {"type", "json_schema"}
        and isinstance(fmt["json_schema"], dict) and isinstance(
            fmt["json_schema"].get("schema", {}), (dict, bool))):
      raise APIError(400, "response_format must be {\"type\": \"text\"}, {\"type\": "
                          "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                          "{\"name\", \"schema\", \"strict\"}}", "response_format")
  if tool_schema is not None:
    given.append("tool_choice")
  if len(given) + (body.get("guided_choice") is not None and bool(given)) > 1:
    fields = given + ["guided_choice"] * (body.get("guided_choice") is not None)
    raise APIError(400, f"{' and '.join(fields)} each set what the answer must be: give "
                        "one", fields[-1])
  if not given:
    return None
  field = given[0]
  if served.guides is None:
    raise APIError(400, f"{field} needs a tokenizer, and this model has none", field)
  value = body.get(field)
  # With ignore_eos a guide neither writes nor ends on the eos tokens.
  guides, ends = served.guides, not _boolean(body, "ignore_eos")
  try:
    if field == "tool_choice":
      return guides.json_schema(tool_schema, ends=ends)
    if field == "response_format":
      return guides.json_schema(value["json_schema"].get("schema", True)
                                if value["type"] == "json_schema" else None, ends=ends)
    if field == "guided_json":
      if not isinstance(value, (dict, str)):
        raise APIError(400, "guided_json must be a JSON schema (an object, or its text)",
                       field)
      return guides.json_schema(value, ends=ends)
    if field == "guided_regex":
      if not isinstance(value, str):
        raise APIError(400, "guided_regex must be a regular expression (a text)", field)
      return guides.regex(value, ends=ends)
    kinds = {"json", "regex", "choice", "json_object"}
    if not (isinstance(value, dict) and len(value) == 1 and set(value) <= kinds):
      raise APIError(400, "structured_outputs must hold one of json (a schema), regex, "
                          "choice (a list of texts) or json_object (true)", field)
    (kind, spec), = value.items()
    if kind == "json" and isinstance(spec, (dict, str, bool)):
      return guides.json_schema(spec, ends=ends)
    if kind == "regex" and isinstance(spec, str):
      return guides.regex(spec, ends=ends)
    if kind == "choice" and isinstance(spec, list):
      return guides.choices(spec, ends=ends)
    if kind == "json_object" and spec is True:
      return guides.json_schema(None, ends=ends)
    raise APIError(400, f"structured_outputs.{kind} has the wrong type: {spec!r:.100}",
                   field)
  except ValueError as e:  # (RegexError, SchemaError: what is not supported, and why)
    raise APIError(400, f"{field}: {e}", field) from None


def _guided_choice(body: dict, served: Served, prompts: list[list[int]], *, chat: bool,
                   n: int, stream: bool, include_usage: bool, temperature: float, seed: int,
                   priority: int) -> Completion:
  """vLLM's `guided_choice`: each answer is one of the given texts. Here each text is
  scored after each prompt (its tokens' log-probabilities, as lm-evaluation-harness
  scores choices: one engine request per prompt and text) and the answer is the most
  likely text (temperature 0) or drawn in proportion to its likelihood ** (1 /
  temperature) (`seed`), n per prompt; not vLLM's token-by-token constrained decoding,
  which may end on a less likely text."""
  texts = body["guided_choice"]
  if not (isinstance(texts, list) and texts and all(isinstance(t, str) and t for t in texts)):
    raise APIError(400, f"guided_choice must be a non-empty list of non-empty texts, got "
                        f"{texts!r:.200}", "guided_choice")
  if served.codec is None:
    raise APIError(400, "guided_choice needs a tokenizer, and this model has none",
                   "guided_choice")
  for name in ("logprobs", "top_logprobs", "echo", "stop", "tools", "logit_bias",
               "min_tokens"):
    if body.get(name) not in (None, False, [], {}, 0):
      raise APIError(400, f"{name} does not go with guided_choice", name)
  ids = [served.codec.encode(t, add_special_tokens=False) for t in texts]
  limit = served.spec.max_positions
  requests = []
  for i, prompt in enumerate(prompts):
    for text, choice in zip(texts, ids):
      if len(prompt) + len(choice) > limit:
        raise APIError(400, f"prompt[{i}] and the choice {text!r:.50} take "
                            f"{len(prompt) + len(choice)} tokens: this model's context holds "
                            f"{limit}", "guided_choice")
      # Scored from the text on: the prompt's pages are computed once and read from the
      # prefix cache by the other texts' requests.
      requests.append(Request(prompt + choice, 1, prompt_logprobs=True,
                              prompt_logprobs_start=len(prompt), priority=priority,
                              lora=_lora(body, served)))
  return Completion(requests, prompts, chat, False, None, stream, include_usage, True,
                    _boolean(body, "return_token_ids"), guided=(texts, ids), samples=n,
                    temperature=temperature, seed=seed)


def parse_chat(body: Any, served: Served, rng: random.Random) -> Completion:
  """A chat completion request's JSON body (POST /v1/chat/completions) as an engine
  request: its messages rendered by the model's chat template, then tokenized without
  the tokenizer's own special tokens (the template writes them), as transformers'
  `apply_chat_template` does. Raises APIError naming the field at fault."""
  _check_body(body, served, CHAT_FIELDS)
  tools, parser, forced = _tools(body, served)
  parallel = _boolean(body, "parallel_tool_calls", True)
  ids = _chat_prompt(body, served, tools=tools)
  name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else (
      "max_tokens")
  max_tokens = _integer(body, name, None, 1)
  top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
  logprobs = _boolean(body, "logprobs")
  if top is not None and not logprobs:
    raise APIError(400, "top_logprobs needs logprobs true", "top_logprobs")
  return dataclasses.replace(
      _completion(body, served, rng, [ids], max_tokens, chat=True, echo=False,
                  logprobs=(top or 0) if logprobs else None, scores_only=False,
                  tool_schema=forced),
      tool_parser=parser, parallel_tool_calls=parallel)


def _completion(body: dict, served: Served, rng: random.Random, prompts: list[list[int]],
                max_tokens: int | None, *, chat: bool, echo: bool, logprobs: int | None,
                scores_only: bool, tool_schema: dict | None = None) -> Completion:
  """The fields both endpoints share, and the engine requests (`max_tokens` None: the rest
  of the model's context; `tool_schema`: the JSON schema tool_choice holds the answer
  to)."""
  n = _integer(body, "n", 1, 1)
  stream = _boolean(body, "stream")
  options = body.get("stream_options")
  if options is not None and not (stream and isinstance(options, dict) and set(options)
                                  <= {"include_usage"}):
    raise APIError(400, "stream_options must be {\"include_usage\": true|false}, with "
                        "stream true", "stream_options")
  include_usage = _boolean(options or {}, "include_usage")
  temperature = _number(body, "temperature", 1.0, 0.0, float("inf"), what="a number >= 0")
  top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True, what="in (0, 1]")
  top_k = body.get("top_k")
  if top_k is not None and not (is_int(top_k) and top_k >= -1):
    raise APIError(400, f"top_k must be an integer >= 1, or 0 / -1 for all, got {top_k!r}",
                   "top_k")
  min_p = _number(body, "min_p", 0.0, 0.0, 1.0, what="in [0, 1]")
  presence = _number(body, "presence_penalty", 0.0, -2.0, 2.0, what="in [-2, 2]")
  frequency = _number(body, "frequency_penalty", 0.0, -2.0, 2.0, what="in [-2, 2]")
  repetition = _number(body, "repetition_penalty", 1.0, 0.0, float("inf"), lo_open=True,
                       what="a number > 0")
  stop = body.get("stop")
  stop = [stop] if isinstance(stop, str) else stop or []
  if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
    raise APIError(400, f"stop must be a text or a list of non-empty texts, got "
                        f"{body.get('stop')!r}", "stop")
  if stop and served.codec is None:
    raise APIError(400, "stop texts need a tokenizer, and this model has none", "stop")
  stop_ids = body.get("stop_token_ids") or []
  if not (isinstance(stop_ids, list) and all(
      is_int(t) and 0 <= t < served.spec.vocab_size for t in stop_ids)):
    raise APIError(400, f"stop_token_ids must be a list of token ids in [0, "
                        f"{served.spec.vocab_size}), got {stop_ids!r}", "stop_token_ids")
  if not _boolean(body, "ignore_eos"):
    stop_ids = list(served.eos_token_ids) + stop_ids
  bias = body.get("logit_bias")
  if bias is not None:
    if not isinstance(bias, dict):
      raise APIError(400, "logit_bias must map token ids to numbers in [-100, 100]",
                     "logit_bias")
    try:
      bias = {int(k): v for k, v in bias.items()}
    except ValueError:
      raise APIError(400, f"logit_bias keys must be token ids, got {list(bias)!r:.200}",
                     "logit_bias") from None
    for token, value in bias.items():
      if not 0 <= token < served.spec.vocab_size:
        raise APIError(400, f"logit_bias token {token} is not in [0, vocab_size="
                            f"{served.spec.vocab_size})", "logit_bias")
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
          -100 <= value <= 100):
        raise APIError(400, f"logit_bias[{token}] must be a number in [-100, 100], got "
                            f"{value!r}", "logit_bias")
  seed = body.get("seed")
  if seed is not None and not is_int(seed):
    raise APIError(400, f"seed must be an integer, got {seed!r}", "seed")
  # The engine's seeds are 32-bit: a wider one (OpenAI's are 64-bit) is folded.
  seed = rng.getrandbits(32) if seed is None else seed % 2 ** 32
  min_tokens = _integer(body, "min_tokens", 0, 0)
  priority = _integer(body, "priority", 0, -2 ** 31, 2 ** 31 - 1)
  if priority and not served.prioritizes:
    raise APIError(400, "priority needs the server started with --scheduling-policy "
                        "priority", "priority")
  user = body.get("user")
  if user is not None and not isinstance(user, str):
    raise APIError(400, f"user must be a text, got {user!r}", "user")
  limit = served.spec.max_positions
  guide = _guide(body, served, tool_schema)
  if body.get("guided_choice") is not None:
    return _guided_choice(body, served, prompts, chat=chat, n=n, stream=stream,
                          include_usage=include_usage, temperature=temperature, seed=seed,
                          priority=priority)
  requests = []
  for i, ids in enumerate(prompts):
    new = limit - len(ids) + 1 if max_tokens is None else max_tokens
    if new < 1 or len(ids) + new - 1 > limit:
      what = "the messages" if chat else f"prompt[{i}]"
      raise APIError(400, f"{what} take {len(ids)} tokens and max_tokens is "
                          f"{'null' if max_tokens is None else max_tokens}: this model's "
                          f"context holds {limit} tokens (the prompt and max_tokens - 1)",
                     "max_tokens" if max_tokens is not None else "messages")
    if min_tokens > new:
      raise APIError(400, f"min_tokens {min_tokens} exceeds max_tokens {new}", "min_tokens")
    requests.append(Request(
        ids, new, temperature=temperature, top_k=top_k if top_k and top_k > 0 else None,
        top_p=None if top_p == 1.0 else top_p, min_p=min_p, seed=seed,
        stop_token_ids=stop_ids, stop=stop, n=n, logprobs=logprobs is not None,
        top_logprobs=logprobs or 0, prompt_logprobs=echo and logprobs is not None,
        repetition_penalty=repetition, frequency_penalty=frequency,
        presence_penalty=presence, logit_bias=bias, min_tokens=min_tokens,
        priority=priority, guide=guide, lora=_lora(body, served)))
  return Completion(requests, prompts, chat, echo, logprobs, stream, include_usage,
                    scores_only, _boolean(body, "return_token_ids"))


@dataclasses.dataclass
class _Choice:
  """One choice (a sample of a prompt) as its events come."""

  index: int
  prompt: list[int]
  tokens: list[int] = dataclasses.field(default_factory=list)
  events: list[TokenEvent] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  stop_text: str | None = None
  prompt_event: TokenEvent | None = None  # the first, with prompt log-probabilities
  sent_first: bool = False  # its first chunk was streamed
  sent_chars: int = 0  # completion text (a chat answer's content) streamed so far
  sent_reasoning: int = 0  # a chat answer's reasoning streamed so far
  sent_tokens: int = 0  # tokens streamed so far (log-probabilities, ids)
  sent_offset: int = 0  # text_offset of the next streamed token
  sent_calls: bool = False  # its tool calls were streamed
  # Its text decoded so far (`Answer._decoded`): that of tokens[:read]; tokens[prefix:read]
  # are decoded again with the next ones.
  text: str = ""
  prefix: int = 0
  read: int = 0

  def take(self, event: TokenEvent) -> None:
    if self.prompt_event is None:
      self.prompt_event = event
    self.tokens.append(event.token)
    self.events.append(event)
    if event.finish_reason is not None:
      self.finish_reason, self.stop_text = event.finish_reason, event.stop_text


class Answer:
  """Turns a completion's events into OpenAI's objects: a text completion's
  ("text_completion", its chunks too) or a chat completion's ("chat.completion", chunks
  "chat.completion.chunk" with deltas)."""

  def __init__(self, completion: Completion, served: Served):
    self.completion, self.served = completion, served
    chat = completion.chat
    self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    self.object = "chat.completion" if chat else "text_completion"
    self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
    self.created = int(time.time())
    n = completion.n
    self.choices = [_Choice(i * n + j, prompt) for i, prompt in enumerate(completion.prompts)
                    for j in range(n)]
    self.stop_ids = set(completion.requests[0].stop_token_ids)
    stops = completion.requests[0].stop
    self.hold = max(map(len, stops)) - 1 if len(stops) else 0
    self._scored: dict[int, tuple] = {}  # (guided_choice) engine id -> prompt logprobs
    # A guided answer is its guide's text from its first token: no thinking to split.
    self.reasoning = served.reasoning_parser if (
        chat and completion.guided is None and completion.requests[0].guide is None
    ) else None

  def take(self, events: list[TokenEvent], request_ids: list[int]) -> set[int]:
    """Adds events (`request_ids`: the engine's ids of the prompts; with guided_choice,
    of the scoring requests); returns the indices of the choices they went to (with
    guided_choice, every choice once the last text is scored: `_choose`)."""
    if self.completion.guided is not None:
      self._scored.update((e.request_id, e.prompt_logprobs) for e in events
                          if e.prompt_logprobs is not None)
      if len(self._scored) < len(request_ids):
        return set()
      self._choose([self._scored[rid] for rid in request_ids])
      return set(range(len(self.choices)))
    n = self.completion.n
    prompt_of = {rid: i for i, rid in enumerate(request_ids)}
    touched = set()
    for e in events:
      choice = self.choices[prompt_of[e.request_id] * n + e.sample]
      if self.completion.scores_only:  # (its one token was not asked for)
        choice.prompt_event, choice.finish_reason = e, "length"
      else:
        choice.take(e)
      touched.add(choice.index)
    return touched

  def _choose(self, prompt_logprobs: Sequence[Sequence[float | None]]) -> None:
    """(guided_choice) Each choice's answer, from the scoring requests' prompt
    log-probabilities (prompt-major, a text after each prompt): each text's total over its
    own tokens; the most likely (temperature 0), else n drawn in proportion to
    exp(total / temperature) by a generator seeded with the request's seed and the
    prompt's index."""
    texts, ids = self.completion.guided
    k, n = len(texts), self.completion.n
    for i in range(len(self.completion.prompts)):
      totals = [sum(prompt_logprobs[i * k + j][-len(ids[j]):]) for j in range(k)]
      if self.completion.temperature == 0:
        picks = [max(range(k), key=totals.__getitem__)] * n
      else:
        top = max(totals)
        weights = [math.exp((t - top) / self.completion.temperature) for t in totals]
        picks = random.Random(self.completion.seed * 1_000_003 + i).choices(
            range(k), weights, k=n)
      for s, j in enumerate(picks):
        c = self.choices[i * n + s]
        c.tokens, c.finish_reason = list(ids[j]), "stop"

  def _decode(self, tokens: Sequence[int]) -> str:
    codec = self.served.codec
    return codec.decode(tokens) if codec else ""

  def _decoded(self, c: _Choice, tokens: Sequence[int]) -> str:
    """The text of `tokens` (the choice's, less a final stop token), decoding only the
    tokens since its last whole character and those of the step before (vLLM's
    incremental detokenization): each chunk of a long stream costs the same, where
    decoding every token each time cost O(length) per chunk (4,096 tokens: 125 µs per
    chunk, 32 ms per answer, dev CPU). The text of the step before is decoded again
    with them because a token's text may depend on the one before it (SentencePiece's
    leading space); the new tokens' text is settled once it ends on a whole character."""
    if self.served.codec is None:
      return ""
    before = self._decode(tokens[c.prefix:c.read])
    new = self._decode(tokens[c.prefix:])[len(before):]
    if new and not new.endswith("\ufffd"):
      c.text += new
      c.prefix, c.read = c.read, len(tokens)
      return c.text
    return c.text + new

  def _token_text(self, token: int) -> str:
    codec = self.served.codec
    return codec.decode([token]) if codec else f"<{token}>"

  def _text(self, c: _Choice) -> tuple[str | None, str, bool, list[ToolCall]]:
    """The choice's reasoning (None: not split, or none) and completion text (a split
    answer's content) as far as they are settled, whether they are whole, and the tool
    calls once it is (their text is not the answer's)."""
    tokens = c.tokens
    done = c.finish_reason is not None
    if done and c.finish_reason == "stop" and c.stop_text is None and tokens and (
        tokens[-1] in self.stop_ids):
      tokens = tokens[:-1]  # (a stop token's text is not the completion's)
    text = self._decoded(c, tokens)
    if c.stop_text is not None and (at := text.find(c.stop_text)) >= 0:
      text = text[:at]
    elif not done:  # an unfinished character, or the start of a stop text, may follow
      text = text.rstrip("\ufffd")
      text = text[:max(0, len(text) - self.hold)]
    reasoning = None
    if self.reasoning is not None:
      reasoning, text = self.reasoning.split(text, done)
    parser = self.completion.tool_parser
    if parser is None:
      return reasoning, text, done, []
    if not done:  # (what may be calls is held back)
      return reasoning, text[:parser.content_end(text)], done, []
    content, calls = parser.parse(text)
    return reasoning, content, done, calls[:None if self.completion.parallel_tool_calls else 1]

  def _tool_calls(self, c: _Choice, calls: list[ToolCall]) -> list[dict]:
    """OpenAI's tool call objects (ids per choice and call, the same in every chunk)."""
    return [{"id": f"call-{self.id}-{c.index}-{i}", "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for i, call in enumerate(calls)]

  @staticmethod
  def _finish_reason(c: _Choice, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason

  def _logprobs(self, c: _Choice, events: Sequence[TokenEvent], offset: int,
                prompt: bool) -> tuple[dict, int]:
    """The logprobs object for `events` (after the prompt's tokens if `prompt`): a text
    completion's (tokens, token_logprobs, top_logprobs, text offsets from `offset`) or a
    chat completion's ({"content": [{token, logprob, bytes, top_logprobs}, ...]}); and
    the offset after them."""
    k = self.completion.logprobs
    if self.completion.chat:
      def entry(token: int, value: float) -> dict:
        text = self._token_text(token)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}
      return {"content": [dict(entry(e.token, e.logprob), top_logprobs=[
          entry(t, v) for t, v in (e.top_logprobs or ())[:k]]) for e in events]}, offset
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(token: int, value: float | None, top) -> None:
      nonlocal offset
      text = self._token_text(token)
      out["tokens"].append(text)
      out["token_logprobs"].append(value)
      out["top_logprobs"].append(
          None if top is None else {self._token_text(t): v for t, v in top[:k]})
      out["text_offset"].append(offset)
      offset += len(text)

    if prompt:
      e = c.prompt_event
      tops = e.prompt_top_logprobs or [None if i == 0 else () for i in range(len(c.prompt))]
      for token, value, top in zip(c.prompt, e.prompt_logprobs, tops):
        add(token, value, top)
    for e in events:
      add(e.token, e.logprob, e.top_logprobs or ())
    return out, offset

  def usage(self) -> dict:
    prompt_tokens = sum(map(len, self.completion.prompts))
    generated = sum(len(c.tokens) for c in self.choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated}

  def whole(self) -> dict:
    """The answer to a request that is not streamed, once every choice has finished."""
    choices = []
    for c in self.choices:
      reasoning, text, _, calls = self._text(c)
      logprobs = None
      if self.completion.logprobs is not None:
        logprobs, _ = self._logprobs(c, c.events, 0, self.completion.echo)
      if self.completion.echo:
        text = self._decode(c.prompt) + text
      choice = {"index": c.index}
      if self.completion.chat:
        choice["message"] = {"role": "assistant", "content": text or None if (
            calls or reasoning is not None) else text}
        if self.reasoning is not None:
          choice["message"]["reasoning_content"] = reasoning
        if calls:
          choice["message"]["tool_calls"] = self._tool_calls(c, calls)
      else:
        choice["text"] = text
      choice.update(logprobs=logprobs, finish_reason=self._finish_reason(c, calls))
      if self.completion.return_token_ids:
        choice.update(prompt_token_ids=c.prompt, token_ids=c.tokens)
      choices.append(choice)
    return dict(self._object(self.object, choices), usage=self.usage())

  def chunk(self, indices: set[int]) -> dict | None:
    """A streamed chunk with what the choices `indices` gained, or None if nothing."""
    choices = []
    for i in sorted(indices):
      c = self.choices[i]
      reasoning, text, done, calls = self._text(c)
      delta = text[c.sent_chars:]
      thought = (reasoning or "")[c.sent_reasoning:]
      first = not c.sent_first
      prefix = self._decode(c.prompt) if self.completion.echo and first else ""
      events = c.events[c.sent_tokens:]
      if not (delta or thought or prefix or done or (events and (
          self.completion.logprobs is not None or self.completion.return_token_ids))):
        continue
      logprobs = None
      if self.completion.logprobs is not None:
        logprobs, c.sent_offset = self._logprobs(c, events, c.sent_offset,
                                                 self.completion.echo and first)
      choice = {"index": c.index}
      if self.completion.chat:  # (the role with the first delta; the calls, whole, last)
        choice["delta"] = dict({"role": "assistant"} if first else {},
                               **({"reasoning_content": thought} if thought else {}),
                               **({} if thought and not delta else {"content": delta}))
        if calls and not c.sent_calls:
          choice["delta"]["tool_calls"] = [dict(call, index=i) for i, call in
                                           enumerate(self._tool_calls(c, calls))]
          c.sent_calls = True
      else:
        choice["text"] = prefix + delta
      choice.update(logprobs=logprobs, finish_reason=self._finish_reason(c, calls))
      if self.completion.return_token_ids:
        choice["token_ids"] = [e.token for e in events]
        if first:
          choice["prompt_token_ids"] = c.prompt
      c.sent_chars, c.sent_tokens, c.sent_first = len(text), len(c.events), True
      c.sent_reasoning = len(reasoning or "")
      choices.append(choice)
    if not choices:
      return None
    chunk = self._object(self.chunk_object, choices)
    if self.completion.include_usage:
      chunk["usage"] = None
    return chunk

  def usage_chunk(self) -> dict:
    return dict(self._object(self.chunk_object, []), usage=self.usage())

  def _object(self, kind: str, choices: list[dict]) -> dict:
    # The model asked for: the served one, or a LoRA adapter's name (vLLM's answer too).
    model = self.completion.requests[0].lora or self.served.name
    return {"id": self.id, "object": kind, "created": self.created, "model": model,
            "choices": choices}


class Handler(http.server.BaseHTTPRequestHandler):
  """The API's routes; `self.server` is the `OpenAIServer`."""

  protocol_version = "HTTP/1.1"
  server: "OpenAIServer"

  def log_message(self, format: str, *args) -> None:
    if self.server.verbose:
      super().log_message(format, *args)

  def send_response(self, code: int, message: str | None = None) -> None:
    self.server.metrics.responded(code)  # (every response: the HTTP layer's errors too)
    super().send_response(code, message)

  def _send_json(self, status: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def _send_error(self, error: APIError) -> None:
    self._send_json(error.status, error.body())

  def _authorized(self) -> bool:
    """Whether the request may have its route: an open route, or the server's API key
    (if it has one) in its Authorization header; else answered 401."""
    key = self.server.api_key
    if key is None or self.path in OPEN_ROUTES:
      return True
    given = self.headers.get("Authorization", "")
    if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
      return True
    self.close_connection = True  # (a body it sent is not read)
    self._send_error(APIError(401, "incorrect or missing API key: send the header "
                                   "'Authorization: Bearer <key>'", code="invalid_api_key"))
    return False

  def do_GET(self) -> None:
    if not self._authorized():
      return
    served = self.server.served
    if self.path == "/health":  # (503 once it no longer serves: a load balancer moves on)
      if self.server.draining or not self.server.loop.alive:
        self._send_json(503, {"status": "draining" if self.server.loop.alive else
                              "the engine has stopped"})
      else:
        self._send_json(200, {"status": "ok"})
    elif self.path == "/metrics":
      data = self.server.metrics.render(self.server.loop.stats).encode()
      self.send_response(200)
      self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)
    elif self.path == "/v1/models" or self.path.startswith("/v1/models/"):
      # The base model, then each LoRA adapter with the base as its parent (vLLM's); one
      # snapshot of the adapters (a runtime update may change them meanwhile).
      models = [{"id": name, "object": "model", "created": self.server.created,
                 "owned_by": "jax_paged", "max_model_len": served.spec.max_positions,
                 "root": name, "parent": None if name == served.name else served.name}
                for name in (served.name, *served.loras)]
      found = [m for m in models if m["id"] == self.path[len("/v1/models/"):]]
      if self.path == "/v1/models":
        self._send_json(200, {"object": "list", "data": models})
      elif found:
        self._send_json(200, found[0])
      else:
        self._send_error(APIError(404, f"the model {self.path[len('/v1/models/'):]!r} does "
                                       "not exist", code="model_not_found"))
    else:
      self._send_error(APIError(404, f"no route GET {self.path}", kind="not_found_error"))

  def do_POST(self) -> None:
    with self.server.in_flight():
      self._post()

  def _post(self) -> None:
    received = time.perf_counter()
    self._first_token_at = 0.0  # (set by `_take`, with the request's first tokens)
    if not self._authorized():
      return
    parse = {"/v1/completions": parse_completion, "/v1/chat/completions": parse_chat}.get(
        self.path)
    local = {"/tokenize": tokenize, "/detokenize": detokenize}.get(self.path)
    if self.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
      local = functools.partial(update_loras, self.path, loop=self.server.loop)
    if parse is None and local is None:
      self.close_connection = True  # (a body it sent is not read)
      self._send_error(APIError(404, f"no route POST {self.path}", kind="not_found_error"))
      return
    try:
      length = int(self.headers.get("Content-Length", ""))
      if length < 0:
        raise ValueError(length)
    except ValueError:
      self.close_connection = True
      self._send_error(APIError(411, "a request body needs a Content-Length >= 0"))
      return
    if length > MAX_BODY_BYTES:
      self.close_connection = True  # (its body is not read)
      self._send_error(APIError(413, f"the request body of {length} bytes exceeds the "
                                     f"server's {MAX_BODY_BYTES >> 20} MiB"))
      return
    if self.server.draining:
      self.close_connection = True
      self._send_error(APIError(503, "the server is shutting down", kind="server_error"))
      return
    raw = self.rfile.read(length)
    try:
      try:
        body = json.loads(raw)
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the body is not JSON: {e}") from e
      if local is not None:  # (answered here: no engine call)
        self._send_json(200, local(body, self.server.served))
        return
      completion = parse(body, self.server.served, self.server.rng)
      sub = self.server.loop.submit(completion.requests)
      try:
        ids = sub.accepted()
      except ValueError as e:  # the engine cannot serve it (e.g. its pool is too small)
        raise engine_refusal(e) from e
      self.server.metrics.received(sum(map(len, completion.prompts)))
    except APIError as e:
      self._send_error(e)
      return
    except EngineClosed as e:
      self._send_error(APIError(503, str(e), kind="server_error"))
      return
    except Exception as e:  # a fault of the server's: said, and logged with its trace
      traceback.print_exc()  # (on stderr, with --verbose or not)
      self._send_error(APIError(500, f"the server failed: {type(e).__name__}: {e}",
                                kind="server_error"))
      return
    answer = Answer(completion, self.server.served)
    if completion.stream:
      self._stream(sub, ids, answer, received)
      return
    try:
      for events in sub:
        self._take(answer, events, ids, received)
        if self._client_gone():  # nobody to answer: free its pages
          sub.cancel()
          self.close_connection = True
          self._finished(answer, received)
          return
    except Exception as e:  # the engine failed (its run aborted) or closed
      self._finished(answer, received)
      self._send_error(APIError(500, f"generation failed: {e}", kind="server_error"))
    else:
      # Counted before the answer is sent: a client that has it finds it in /metrics.
      self._finished(answer, received)
      self._send_json(200, answer.whole())

  def _take(self, answer: Answer, events: list[TokenEvent], ids: list[int],
            received: float) -> set[int]:
    """`answer.take`; the first events that reach a choice time the first token."""
    touched = answer.take(events, ids)
    if touched and not self._first_token_at:
      self._first_token_at = time.perf_counter()
      self.server.metrics.first_token(self._first_token_at - received)
    return touched

  def _finished(self, answer: Answer, received: float) -> None:
    now = time.perf_counter()
    steps = max(len(c.tokens) for c in answer.choices) - 1
    self.server.metrics.finished(
        now - received, sum(len(c.tokens) for c in answer.choices),
        [c.finish_reason for c in answer.choices],
        (now - self._first_token_at) / steps if steps > 0 else None)

  def _client_gone(self) -> bool:
    """Whether the client has closed the connection (its end read, nothing consumed)."""
    try:
      readable, _, _ = select.select([self.connection], [], [], 0)
      return bool(readable) and not self.connection.recv(1, socket.MSG_PEEK)
    except (OSError, ValueError):  # reset, or closed here
      return True

  def _stream(self, sub: Submission, ids: list[int], answer: Answer,
              received: float) -> None:
    """Server-sent events, one per device call that brought text, then `[DONE]`; the
    requests are aborted if the client goes. The answer is counted in the metrics before
    `[DONE]` (a client that has read it finds it there), or when the client went."""
    counted = []

    def chunks() -> Iterator[dict | None]:
      try:
        for events in sub:
          yield answer.chunk(self._take(answer, events, ids, received))
        if answer.completion.include_usage:
          yield answer.usage_chunk()
      except Exception as e:  # the engine failed: said in the stream, as vLLM does
        yield APIError(500, f"generation failed: {e}", kind="server_error").body()
      self._finished(answer, received)
      counted.append(True)

    self._send_events(chunks(), gone=sub.cancel)
    if not counted:  # the client went before the end
      self._finished(answer, received)

  def _send_events(self, chunks: Iterator[dict | None], gone: Callable[[], None]) -> None:
    """A 200 of server-sent events (chunked transfer): each chunk (None: skipped), then
    `[DONE]`; if the client goes, `gone()` and the connection closes."""
    self.send_response(200)
    self.send_header("Content-Type", "text/event-stream")
    self.send_header("Cache-Control", "no-cache")
    self.send_header("Transfer-Encoding", "chunked")
    self.end_headers()

    def send(payload: str) -> None:
      data = f"data: {payload}\n\n".encode()
      self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
      self.wfile.flush()

    try:
      for chunk in chunks:
        if chunk is not None:
          send(json.dumps(chunk))
      send("[DONE]")
      self.wfile.write(b"0\r\n\r\n")
      self.wfile.flush()
    except (ConnectionError, OSError):  # the client went
      gone()
      self.close_connection = True


class OpenAIServer(http.server.ThreadingHTTPServer):
  """Serves `served` from `loop`'s engine at `address` ((host, port); port 0: any free
  one, `server_address` tells which). `serve_forever()` serves; `shutdown()` stops it
  (from another thread), `server_close()` frees the socket. The loop is the caller's to
  close. With `api_key`, every route but `OPEN_ROUTES` needs it (`Authorization: Bearer
  <key>`). `drain(timeout)`, after `server_close()`: the requests in flight finish."""

  daemon_threads = True
  request_queue_size = 1024  # connections waiting for accept(): a burst of arrivals

  def __init__(self, address: tuple[str, int], loop: EngineLoop | EngineProcess,
               served: Served, *, api_key: str | None = None, verbose: bool = False):
    super().__init__(address, Handler)
    self.loop, self.served, self.verbose = loop, served, verbose
    self.api_key = api_key or None  # (an empty key: none)
    self.draining = False  # shutting down: new requests are refused, running ones finish
    self.requests_in_flight = 0  # POSTs being answered
    self._lock = threading.Lock()
    self.metrics = ServerMetrics(served.name)
    self.created = int(time.time())
    self.rng = random.Random()

  @contextlib.contextmanager
  def in_flight(self) -> Iterator[None]:
    """Counts a request being answered (`requests_in_flight`) while it is."""
    with self._lock:
      self.requests_in_flight += 1
    try:
      yield
    finally:
      with self._lock:
        self.requests_in_flight -= 1

  def drain(self, timeout: float) -> None:
    """Shutting down (the listening socket closed): refuses new requests and waits up to
    `timeout` seconds for those in flight to be answered. Ctrl-C (or SIGTERM) stops the
    wait."""
    self.draining = True
    deadline = time.monotonic() + timeout
    if self.requests_in_flight and timeout > 0:
      _notice(f"finishing {self.requests_in_flight} requests in flight (up to {timeout:g} "
              "s; Ctrl-C again stops now)", PROG)
    try:
      while self.requests_in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    except KeyboardInterrupt:
      pass


def add_served_arguments(p: argparse.ArgumentParser, families) -> None:
  """The model options and how its API answers (`served_of`): the served name, the chat
  template, the tool call and reasoning parsers (the server's and `jax-paged-batch`'s)."""
  add_model_arguments(p, families)
  p.add_argument("--seed", type=int, default=0,
                 help="the random weights' seed of a --model preset (default 0)")
  api = p.add_argument_group("API")
  api.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the API (default: the checkpoint directory's "
                        "name, or the preset's)")
  api.add_argument("--chat-template", metavar="FILE", default=None,
                   help="the Jinja chat template for /v1/chat/completions (default: the "
                        "checkpoint's, from its tokenizer_config.json or "
                        "chat_template.jinja; none: chat completions are refused)")
  api.add_argument("--tool-call-parser", choices=list(TOOL_PARSERS), default=None,
                   help="read tool calls in chat answers in this format, for requests with "
                        "tools (tool_choice auto): hermes (Qwen2 / Qwen2.5, Hermes), "
                        "llama3_json (Llama 3.1+); the chat template must render the tools "
                        "(default: none, tools refused)")
  api.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                   help="return chat answers' <think> reasoning apart from their content "
                        "(message.reasoning_content, delta.reasoning_content): deepseek_r1 "
                        "(the answer starts thinking: DeepSeek-R1 and its distills, QwQ), "
                        "qwen3 (thinking when the answer opens with <think>) (default: "
                        "none, the reasoning stays in the content)")


def served_of(args: argparse.Namespace, spec: ModelSpec, codec: Codec | None,
              chat_template: ChatTemplate | None, *, prioritizes: bool = False) -> Served:
  """What `add_served_arguments`' options serve, for a model of `spec` whose text
  `codec` (None: token ids only) and `chat_template` (`read_chat_template`) the caller
  has."""
  name = args.served_model_name or (
      args.checkpoint.rstrip("/").split("/")[-1] if args.checkpoint else args.model)
  parser = None if args.tool_call_parser is None else TOOL_PARSERS[args.tool_call_parser]
  loras = tuple(lora for lora, _ in args.lora_modules)
  if name in loras:
    raise CLIError(f"--lora-modules names an adapter {name!r}, the served model's name")
  reasoning = args.reasoning_parser
  return Served(name, spec, codec, spec.eos_token_ids, chat_template, parser, prioritizes,
                loras=loras, lora_updates=getattr(args, "allow_lora_updates", False),
                reasoning_parser=None if reasoning is None else REASONING_PARSERS[reasoning])


def parse_args(argv: Sequence[str] | None, families) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog=PROG, description="Serve a language model over OpenAI's completions and chat "
                             "completions APIs (continuous batching over a paged KV "
                             "cache).")
  add_served_arguments(p, families)
  srv = p.add_argument_group("server")
  srv.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default 127.0.0.1; 0.0.0.0: every "
                        "interface)")
  srv.add_argument("--port", type=int, default=8000, help="the port (default 8000; 0: any)")
  srv.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                   help="require the header 'Authorization: Bearer KEY' on every route "
                        f"but /health and /metrics (default: ${API_KEY_ENV}, which keeps "
                        "the key out of the process list; none: open)")
  srv.add_argument("--allow-lora-updates", action="store_true",
                   help="take POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        "(vLLM's runtime LoRA updates: adapters from paths on this "
                        "machine; --max-loras slots, default 1)")
  srv.add_argument("--warmup", nargs="+", choices=[*WARMUP_SAMPLING, "guided"], default=(),
                   metavar="KIND",
                   help="compile the batch shapes of these sampling kinds before serving "
                        f"({', '.join(WARMUP_SAMPLING)}: Engine.warmup), so that no request "
                        "waits ~1 s for a compilation; GPT-2 on an H200: ~75-100 s per kind, "
                        "~35 s from the compilation cache; guided: also each kind's with a "
                        "guided request (structured output; twice the time)")
  srv.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="fcfs: requests are admitted as they come; priority: by their "
                        "`priority` field (lower first, then arrival; a full pool preempts "
                        "the lowest priority first) (default fcfs)")
  srv.add_argument("--shutdown-timeout", default=30.0, metavar="SECONDS",
                   type=_float_in(0.0, float("inf"), lo_open=False,
                                  what="a number of seconds >= 0"),
                   help="on Ctrl-C or SIGTERM, stop taking requests (/health answers 503) "
                        "and let those in flight finish for up to this long (default 30; "
                        "a second Ctrl-C stops at once)")
  srv.add_argument("--verbose", action="store_true", help="log every HTTP request")
  # A request waits up to one call to join the batch: fewer steps than generation's.
  add_engine_arguments(p, steps_per_call=16)
  return parse_model_args(p, argv)


def _interrupt(signum, frame) -> None:
  raise KeyboardInterrupt


def resolve_families(refs: Sequence[str] | None) -> list[ModelFamily]:
  """Model families by "module:attribute" references; None: those installed packages
  register (`cli.model_families()`)."""
  if refs is None:
    return model_families()
  families = []
  for ref in refs:
    module, _, attribute = ref.partition(":")
    families.append(getattr(importlib.import_module(module), attribute))
  return families


def build_engine(args: argparse.Namespace, family_refs: Sequence[str] | None) -> Engine:
  """The model and engine of the options, compiled as --warmup asks: the engine process's
  work. Raises ValueError with the message of a user error."""
  try:
    engine = make_engine(args, load_model(args, resolve_families(family_refs), PROG),
                         scheduling_policy=args.scheduling_policy)
  except CLIError as e:
    raise ValueError(str(e)) from e
  if args.warmup:
    start = time.perf_counter()
    _notice(f"compiling the batch shapes of {', '.join(args.warmup)} (--warmup) ...", PROG)
    kinds = [k for k in args.warmup if k != "guided"] or ["greedy"]
    engine.warmup(sampling=kinds, guided="guided" in args.warmup)
    _notice(f"compiled in {time.perf_counter() - start:.0f} s", PROG)
  return engine


def serve(args: argparse.Namespace, family_refs: Sequence[str] | None) -> int:
  """Builds the engine in a process of its own (`EngineProcess`: its host work never
  waits for this process's connection threads), then serves until Ctrl-C."""
  chat_template = read_chat_template(args.chat_template, args.checkpoint)
  try:
    loop = EngineProcess(functools.partial(build_engine, args, family_refs))
  except RuntimeError as e:
    raise CLIError(str(e)) from e
  try:
    # (The engine's process loaded the model and its tokenizer; this one reads the
    # tokenizer alone.)
    codec = load_tokenizer(args.checkpoint) if args.checkpoint else BYTES
    served = served_of(args, loop.spec, codec, chat_template,
                       prioritizes=args.scheduling_policy == "priority")
    name = served.name
    try:
      server = OpenAIServer((args.host, args.port), loop, served, api_key=args.api_key,
                            verbose=args.verbose)
    except OSError as e:
      raise CLIError(f"cannot listen on {args.host}:{args.port} ({e})") from e
    host, port = server.server_address[:2]
    # SIGTERM (a service manager's, a container's stop) ends it as Ctrl-C does; so does
    # it where SIGINT is ignored (a background job of a script, a pytest-xdist worker's
    # child).
    signal.signal(signal.SIGTERM, _interrupt)
    print(f"{PROG}: serving {name!r} at http://{host}:{port}/v1 (Ctrl-C or SIGTERM stops, "
          f"letting requests in flight finish for up to {args.shutdown_timeout:g} s)",
          file=sys.stderr, flush=True)
    try:
      server.serve_forever()
    except KeyboardInterrupt:
      pass
    finally:
      server.server_close()
      server.drain(args.shutdown_timeout)
  finally:
    loop.close()
  return 0


def main(argv: Sequence[str] | None = None, family_refs: Sequence[str] | None = None
         ) -> int:
  """The command; `family_refs`: the model families it can build, as "module:attribute"
  references (default: those installed packages register, `cli.model_families()`)."""
  try:
    return serve(parse_args(argv, resolve_families(family_refs)), family_refs)
  except CLIError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
