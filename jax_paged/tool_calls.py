"""Tool calls in a chat model's generated text, as vLLM's tool parsers find them.

A model trained for function calling writes its calls in a format of its own after the
tools were rendered into its prompt (by its chat template). A parser knows one format:
`content_end(text)`, how much of a text still growing is settled answer text (a streamed
answer holds back what may be calls), and `parse(text)`, the whole text's answer text and
calls. A text whose calls do not parse stays text, as in vLLM. Two formats of models':

  hermes        `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per
                call, after optional text (Qwen2 / Qwen2.5, Hermes 2 / 3)
  llama3_json   the answer is the calls: `{"name": ..., "parameters": {...}}` objects,
                separated by ";" (Llama 3.1 / 3.2 / 3.3 with JSON tool calling)

and two of answers a guide forced (`tool_choice` required / a named function, vLLM's):
`NamedCallParser(name)`, the answer is that function's arguments object, and
`RequiredCallsParser`, the answer is a list of `{"name": ..., "parameters": {...}}`
(`required_calls_schema`).
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple


class ToolCall(NamedTuple):
  """A function call: its name and its arguments as JSON text (an object)."""

  name: str
  arguments: str


def _call(obj, arguments_key: str) -> ToolCall:
  """A decoded call object as a ToolCall; raises ValueError if it is not one."""
  if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
    raise ValueError(f"not a call: {obj!r:.100}")
  arguments = obj.get(arguments_key, {})
  if not isinstance(arguments, dict):
    raise ValueError(f"arguments are not an object: {arguments!r:.100}")
  return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser:
  """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after the text (the
  last block may be unclosed: the model stopped after its JSON)."""

  start = "<tool_call>"
  _block = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

  def content_end(self, text: str) -> int:
    """Up to the first call, less a tail that could begin one."""
    at = text.find(self.start)
    if at >= 0:
      return at
    return len(text) - max((k for k in range(1, len(self.start))
                            if text.endswith(self.start[:k])), default=0)

  def parse(self, text: str) -> tuple[str, list[ToolCall]]:
    """(the text before the calls, the calls), or (text, []) if it holds none that
    parse."""
    at = text.find(self.start)
    if at < 0:
      return text, []
    try:
      calls = [_call(json.loads((closed or open_).strip()), "arguments")
               for closed, open_ in self._block.findall(text[at:])]
    except ValueError:  # (json's errors too)
      return text, []
    return text[:at], calls


class Llama3JsonParser:
  """An answer that is one or more `{"name": ..., "parameters": {...}}` objects separated
  by ";" (Llama 3's `<|python_tag|>` is a special token: not in the text)."""

  start = "{"

  def content_end(self, text: str) -> int:
    """All of it, unless it is blank or begins a call (held back until it is whole)."""
    return 0 if not text.strip() or text.lstrip().startswith(self.start) else len(text)

  def parse(self, text: str) -> tuple[str, list[ToolCall]]:
    if not text.lstrip().startswith(self.start):
      return text, []
    decoder, calls, i = json.JSONDecoder(), [], 0
    rest = text.strip()
    try:
      while i < len(rest):
        obj, i = decoder.raw_decode(rest, i)
        calls.append(_call(obj, "parameters" if "parameters" in obj else "arguments"))
        i = len(rest) - len(rest[i:].lstrip().removeprefix(";").lstrip())
    except ValueError:
      return text, []
    return "", calls


class NamedCallParser(NamedTuple):
  """An answer that is the arguments object of the function `name` (tool_choice naming
  it: a guide held it to the function's parameters schema)."""

  name: str

  def content_end(self, text: str) -> int:
    return 0

  def parse(self, text: str) -> tuple[str, list[ToolCall]]:
    try:
      return "", [_call({"name": self.name, "arguments": json.loads(text)}, "arguments")]
    except ValueError:  # (cut short by max_tokens)
      return text, []


class RequiredCallsParser:
  """An answer that is a list of calls `{"name": ..., "parameters": {...}}`
  (tool_choice required: a guide held it to `required_calls_schema`)."""

  def content_end(self, text: str) -> int:
    return 0

  def parse(self, text: str) -> tuple[str, list[ToolCall]]:
    try:
      calls = json.loads(text)
      if not isinstance(calls, list):
        raise ValueError(text)
      return "", [_call(call, "parameters") for call in calls]
    except ValueError:  # (cut short by max_tokens)
      return text, []


def required_calls_schema(tools: list[dict], parallel: bool) -> dict:
  """The JSON schema of one or more calls of `tools` (OpenAI's tool objects), at most one
  unless `parallel` (vLLM's for tool_choice required)."""
  calls = [{"type": "object", "properties": {
      "name": {"const": t["function"]["name"]},
      "parameters": t["function"].get("parameters") or {"type": "object"}},
            "required": ["name", "parameters"]} for t in tools]
  return {"type": "array", "minItems": 1, "items": {"anyOf": calls},
          **({} if parallel else {"maxItems": 1})}


ToolParser = HermesParser | Llama3JsonParser | NamedCallParser | RequiredCallsParser

PARSERS: dict[str, ToolParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}
