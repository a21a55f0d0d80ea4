"""Tool call parsers (`jax_paged.tool_calls`): calls read, text kept, malformed calls
left as text, and the settled text of an answer still growing."""

import json

import pytest

from jax_paged.tool_calls import PARSERS, ToolCall

HERMES = PARSERS["hermes"]
LLAMA3 = PARSERS["llama3_json"]


def test_hermes_reads_every_block_after_the_text():
  text = ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Par\u00eds", '
          '"days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}\n')
  content, calls = HERMES.parse(text)
  assert content == "Let me look.\n"
  assert calls == [ToolCall("weather", '{"city": "Par\u00eds", "days": [1, 2]}'),
                   ToolCall("time", "{}")]
  assert json.loads(calls[0].arguments) == {"city": "Par\u00eds", "days": [1, 2]}


@pytest.mark.parametrize("text", [
    "no calls at all",
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": 3}</tool_call>',
])
def test_hermes_leaves_a_text_without_good_calls_as_text(text):
  assert HERMES.parse(text) == (text, [])


@pytest.mark.parametrize("text,settled", [
    ("Sure, ", 6), ("Sure <", 5), ("Sure <tool_ca", 5), ("Sure <tool_call>{", 5),
    ("a < b", 5), ("<", 0)])
def test_hermes_holds_back_what_may_begin_a_call(text, settled):
  assert HERMES.content_end(text) == settled


def test_llama3_json_reads_calls_separated_by_semicolons():
  text = (' {"name": "weather", "parameters": {"city": "Paris"}}; '
          '{"name": "time", "arguments": {"zone": "UTC"}}\n')
  assert LLAMA3.parse(text) == ("", [ToolCall("weather", '{"city": "Paris"}'),
                                     ToolCall("time", '{"zone": "UTC"}')])


@pytest.mark.parametrize("text", [
    "Paris is sunny.", '{"name": "f", "parameters": {}} and then text', '{"name": "f"',
    '{"title": "not a call"}'])
def test_llama3_json_leaves_other_answers_as_text(text):
  assert LLAMA3.parse(text) == (text, [])


@pytest.mark.parametrize("text,settled", [("Paris", 5), ("  ", 0), (' {"na', 0), ("", 0)])
def test_llama3_json_holds_back_an_answer_that_begins_a_call(text, settled):
  assert LLAMA3.content_end(text) == settled
