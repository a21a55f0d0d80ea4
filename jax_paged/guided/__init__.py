"""Structured output: guides that keep a generated text a prefix of a regular
expression's matches, a JSON schema's valid texts or one of some texts.

  regex_dfa     a regular expression as a minimal DFA over UTF-8 bytes
  json_schema   a JSON schema as a regular expression
  guide         a DFA lifted to a vocabulary's tokens: Guide, Vocabulary
  cache         guides built once per pattern: GuideCache
"""

from jax_paged.guided.cache import GuideCache
from jax_paged.guided.guide import Guide, Vocabulary
from jax_paged.guided.json_schema import SchemaError
from jax_paged.guided.regex_dfa import RegexError

__all__ = ["Guide", "GuideCache", "RegexError", "SchemaError", "Vocabulary"]
