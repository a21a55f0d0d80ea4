"""Reasoning in a chat model's generated text, split from its answer as vLLM's reasoning
parsers split it.

Reasoning models think between `<think>` and `</think>`, then answer. A parser splits a
completion's text, whole or still growing, into the reasoning (the server's
`message.reasoning_content`, streamed as `delta.reasoning_content`) and the content (the
answer, where tool calls are then read). Two conventions:

  deepseek_r1   the answer starts inside the thinking (the chat template opens
                `<think>`): all the text before `</think>` is reasoning, a leading
                `<think>` dropped; with no `</think>` yet, all of it (DeepSeek-R1 and
                its Qwen / Llama distills, QwQ, Qwen3 thinking-2507)
  qwen3         reasoning only when the answer opens with `<think>` (Qwen3 with
                enable_thinking, its default; without it the template writes an empty
                think block into the prompt and the answer is all content)

A text whose thinking never ends (the answer cut by max_tokens) is all reasoning, its
content None. The tags are text (added tokens the tokenizer decodes), so a tag split over
several tokens is found too; while the text grows, a tail that may begin a tag is held
back.
"""

from __future__ import annotations

from typing import NamedTuple


class Split(NamedTuple):
  """A completion text's reasoning (None: the answer did not think) and content."""

  reasoning: str | None
  content: str


def _partial_tail(text: str, tag: str) -> int:
  """The length of the longest end of `text` that is a proper start of `tag`."""
  return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


class ThinkParser:
  """Splits `<think>` ... `</think>` reasoning from the answer after it."""

  start, end = "<think>", "</think>"

  def __init__(self, starts_thinking: bool):
    self.starts_thinking = starts_thinking

  def split(self, text: str, done: bool) -> Split:
    """`text` as far as it is settled (`done`: it is whole; else a tail that may begin a
    tag, and with qwen3's convention a start that may be `<think>`, is held back) as
    (reasoning, content)."""
    lead = text.lstrip()
    if not done and self.start.startswith(lead):  # (nothing yet, or a part of `<think>`)
      return Split("" if self.starts_thinking else None, "")
    if lead.startswith(self.start):
      thought = lead[len(self.start):]
    elif self.starts_thinking:
      thought = text
    else:
      return Split(None, text)
    at = thought.find(self.end)
    if at >= 0:
      return Split(thought[:at], thought[at + len(self.end):])
    if done:
      return Split(thought, "")
    return Split(thought[:len(thought) - _partial_tail(thought, self.end)], "")


REASONING_PARSERS = {"deepseek_r1": ThinkParser(starts_thinking=True),
                     "qwen3": ThinkParser(starts_thinking=False)}
