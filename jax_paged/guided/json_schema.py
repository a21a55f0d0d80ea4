"""A JSON schema as a regular expression over its valid JSON texts (outlines' approach).

Supported (anything else is refused with a message naming the keyword and its path):
  type: string (minLength, maxLength, pattern, format date-time / date / time / uuid /
    email / ipv4), integer (minimum, maximum, exclusive or not: a pattern of the decimal
    range), number (bounds that are integers >= 0, exclusive or not: numbers bounded
    other than by a minimum of 0 are written without an exponent), boolean, null, array
    (items, prefixItems, minItems, maxItems), object (properties in the schema's order,
    required; additionalProperties false, or absent with properties; without properties
    a map: any keys, values under additionalProperties' schema (any depth-limited value
    where it is true or absent), min / maxProperties), and a list of types; enum, const
    (written compact); anyOf, oneOf (as anyOf), allOf of one schema; $ref into $defs / definitions
    (not recursive); true / {} (any JSON value). A string's pattern is matched against
    its JSON text between the quotes (the same unless the pattern admits `"` or `\\`).
Values of unconstrained JSON (an object without properties, `{}`, json_object mode) nest
at most `MAX_FREE_DEPTH` levels: a regular expression cannot count brackets.

Whitespace between a JSON text's tokens is at most one space (outlines' default): a
model that may emit any whitespace can emit it forever.
"""

from __future__ import annotations

import json
import math
from typing import Any

from jax_paged.guided.regex_dfa import regex_escape

WHITESPACE = r"[ ]?"
STRING_CHAR = r'([^"\\\x00-\x1f]|\\(["\\/bfnrt]|u[0-9a-fA-F]{4}))'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"(0|-?[1-9][0-9]*)"
NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
BOOLEAN = "(true|false)"
NULL = "null"
FORMATS = {
    "date-time": (r'"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3])'
                  r':[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"'),
    "date": r'"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"',
    "time": r'"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3])'
            r':[0-5][0-9])?"',
    "uuid": r'"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"',
    # (the common shape, not RFC 5321's every address)
    "email": r'"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"',
    "ipv4": r'"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}'
            r'(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"',
}
MAX_FREE_DEPTH = 3

# Keywords that only describe (never constrain) a value.
_ANNOTATIONS = {"title", "description", "examples", "default", "$schema", "$id", "$comment",
                "$defs", "definitions", "deprecated", "readOnly", "writeOnly", "strict",
                "name"}
_KEYWORDS = {
    "string": {"type", "minLength", "maxLength", "pattern", "format", "enum", "const"},
    "integer": {"type", "minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "enum",
                "const"},
    "number": {"type", "minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "enum",
               "const"},
    "boolean": {"type", "enum", "const"},
    "null": {"type", "enum", "const"},
    "array": {"type", "items", "prefixItems", "minItems", "maxItems", "enum", "const"},
    "object": {"type", "properties", "required", "additionalProperties", "minProperties",
               "maxProperties", "enum", "const"},
}


class SchemaError(ValueError):
  """A schema this module cannot express, with the keyword's path."""


def to_regex(schema: Any) -> str:
  """A pattern whose whole matches are the JSON texts valid under `schema` (a dict or
  bool, or its JSON text); None: any JSON object.

  Raises:
    SchemaError: the schema is not valid JSON / a schema, or uses what is not supported.
  """
  if schema is None:
    return _free_object(MAX_FREE_DEPTH)
  if isinstance(schema, str):
    try:
      schema = json.loads(schema)
    except json.JSONDecodeError as e:
      raise SchemaError(f"the schema is not valid JSON: {e}") from None
  return _Converter(schema).convert(schema, "#", ())


def _literal(value: Any) -> str:
  """The pattern matching exactly the JSON text of `value`."""
  return regex_escape(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _free_value(depth: int) -> str:
  scalars = [STRING, NUMBER, BOOLEAN, NULL]
  if depth > 0:
    scalars += [_free_object(depth), _free_array(depth)]
  return "(" + "|".join(scalars) + ")"


def _free_object(depth: int) -> str:
  member = f"{STRING}{WHITESPACE}:{WHITESPACE}{_free_value(depth - 1)}"
  return (rf"\{{{WHITESPACE}({member}({WHITESPACE},{WHITESPACE}{member})*)?"
          rf"{WHITESPACE}\}}")


def _free_array(depth: int) -> str:
  value = _free_value(depth - 1)
  return rf"\[{WHITESPACE}({value}({WHITESPACE},{WHITESPACE}{value})*)?{WHITESPACE}\]"


def _items(item: str, lo: int, hi: int | None) -> str:
  """lo..hi (None: any number of) comma-separated `item`s."""
  sep = f"{WHITESPACE},{WHITESPACE}"
  if hi == 0:
    return ""
  more = f"({sep}{item})*" if hi is None else f"({sep}{item}){{{max(lo - 1, 0)},{hi - 1}}}"
  some = f"{item}{more}"
  return some if lo > 0 else f"({some})?"


class _Converter:
  def __init__(self, root: Any):
    self.root = root

  def _resolve(self, ref: str, path: str) -> Any:
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
      raise SchemaError(f"{path}: $ref {ref!r} is not supported (only refs within the "
                        "schema, '#/$defs/...')")
    node = self.root
    for part in ref[2:].split("/") if ref != "#" else ():
      part = part.replace("~1", "/").replace("~0", "~")
      if not isinstance(node, dict) or part not in node:
        raise SchemaError(f"{path}: $ref {ref!r} points at nothing")
      node = node[part]
    return node

  def convert(self, schema: Any, path: str, refs: tuple[str, ...]) -> str:
    if schema is True or schema == {}:
      return _free_value(MAX_FREE_DEPTH)
    if schema is False:
      raise SchemaError(f"{path}: the schema false allows no value")
    if not isinstance(schema, dict):
      raise SchemaError(f"{path}: a schema must be an object or a boolean, got "
                        f"{type(schema).__name__}")
    if "$ref" in schema:
      ref = schema["$ref"]
      if ref in refs:
        raise SchemaError(f"{path}: $ref {ref!r} is recursive, which a regular expression "
                          "cannot match")
      extra = set(schema) - {"$ref"} - _ANNOTATIONS
      if extra:
        raise SchemaError(f"{path}: keywords beside $ref are not supported: {sorted(extra)}")
      return self.convert(self._resolve(ref, path), ref, refs + (ref,))
    for key in ("anyOf", "oneOf"):
      if key in schema:
        options = schema[key]
        if not isinstance(options, list) or not options:
          raise SchemaError(f"{path}/{key}: must be a non-empty list of schemas")
        extra = set(schema) - {key} - _ANNOTATIONS
        if extra:
          raise SchemaError(f"{path}: keywords beside {key} are not supported: "
                            f"{sorted(extra)}")
        return "(" + "|".join(self.convert(s, f"{path}/{key}/{i}", refs)
                              for i, s in enumerate(options)) + ")"
    if "allOf" in schema:
      options = schema["allOf"]
      if not isinstance(options, list) or len(options) != 1 or set(schema) - {"allOf"} \
          - _ANNOTATIONS:
        raise SchemaError(f"{path}/allOf: only an allOf of one schema is supported")
      return self.convert(options[0], f"{path}/allOf/0", refs)
    if "const" in schema:
      return _literal(schema["const"])
    if "enum" in schema:
      values = schema["enum"]
      if not isinstance(values, list) or not values:
        raise SchemaError(f"{path}/enum: must be a non-empty list")
      return "(" + "|".join(_literal(v) for v in values) + ")"
    kind = schema.get("type")
    if kind is None:
      if "properties" in schema:
        kind = "object"
      elif "items" in schema:
        kind = "array"
      else:
        unknown = set(schema) - _ANNOTATIONS
        if unknown:
          raise SchemaError(f"{path}: keywords {sorted(unknown)} without a type are not "
                            "supported")
        return _free_value(MAX_FREE_DEPTH)
    if isinstance(kind, list):
      if not kind:
        raise SchemaError(f"{path}/type: an empty list of types allows no value")
      bad = [k for k in kind if k not in _KEYWORDS]
      if bad:
        raise SchemaError(f"{path}/type: {bad[0]!r} is not a JSON schema type "
                          f"({', '.join(_KEYWORDS)})")
      unknown = set(schema) - set().union(*(_KEYWORDS[k] for k in kind)) - _ANNOTATIONS
      if unknown:
        raise SchemaError(f"{path}: {sorted(unknown)} for types {kind} are not supported")
      # Each type's keywords apply to values of that type only.
      return "(" + "|".join(self.convert({key: value for key, value in schema.items()
                                          if key in _KEYWORDS[k] or key in _ANNOTATIONS}
                                         | {"type": k}, path, refs) for k in kind) + ")"
    if kind not in _KEYWORDS:
      raise SchemaError(f"{path}/type: {kind!r} is not a JSON schema type "
                        f"({', '.join(_KEYWORDS)})")
    unknown = set(schema) - _KEYWORDS[kind] - _ANNOTATIONS
    if unknown:
      raise SchemaError(f"{path}: {sorted(unknown)} for type {kind} are not supported")
    return getattr(self, "_" + kind)(schema, path, refs)

  def _string(self, schema: dict, path: str, refs) -> str:
    if "format" in schema:
      if schema["format"] not in FORMATS:
        raise SchemaError(f"{path}/format: {schema['format']!r} is not supported "
                          f"({', '.join(FORMATS)})")
      return FORMATS[schema["format"]]
    if "pattern" in schema:
      pattern = schema["pattern"]
      if not isinstance(pattern, str):
        raise SchemaError(f"{path}/pattern: must be a string")
      # JSON schema patterns search; the string is taken as wholly matching it.
      return f'"({pattern.removeprefix("^").removesuffix("$")})"'
    lo, hi = _bounds(schema, "minLength", "maxLength", path)
    if lo == 0 and hi is None:
      return STRING
    return f'"{STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'

  def _integer(self, schema: dict, path: str, refs) -> str:
    lo, hi = _numeric_bounds(schema, path)
    # The nearest integers inside the bounds.
    lo = None if lo is None else math.ceil(lo[0]) if lo[1] else math.floor(lo[0]) + 1
    hi = None if hi is None else math.floor(hi[0]) if hi[1] else math.ceil(hi[0]) - 1
    if lo is not None and hi is not None and lo > hi:
      raise SchemaError(f"{path}: no integer lies within its bounds")
    return integer_range(lo, hi)

  def _number(self, schema: dict, path: str, refs) -> str:
    """Bounds that are integers >= 0, exclusive or not; a bounded number is written
    without an exponent (but where the only bound is a minimum of 0)."""
    lo, hi = _numeric_bounds(schema, path)
    for key in _BOUND_KEYS:
      value = schema.get(key)
      if value is not None and (value < 0 or value != int(value)):
        raise SchemaError(f"{path}/{key}: {value!r} is not supported (a number's bounds "
                          "must be integers >= 0)")
    if lo is None and hi is None:
      return NUMBER
    if lo == (0, True) and hi is None:  # (every number >= 0, with an exponent too)
      return NUMBER.removeprefix("-?")
    fraction, nonzero, zeros = r"(\.[0-9]+)?", r"\.[0-9]*[1-9][0-9]*", r"(\.0+)?"
    a, a_closed = (int(lo[0]), lo[1]) if lo is not None else (0, True)
    first = a if a_closed else a + 1  # the least whole part with any fraction
    parts = [] if a_closed else [f"{a}{nonzero}"]  # a itself, with a nonzero fraction
    if lo is None:  # every negative number too (not "-0")
      parts.append(f"-(0{nonzero}|[1-9][0-9]*{fraction})")
    if hi is None:
      parts.append(f"{integer_range(first, None)}{fraction}")
    else:
      b, b_closed = int(hi[0]), hi[1]
      if not a_closed and a >= b:  # (lo given: no negatives here)
        parts = []
      if first <= b - 1:
        parts.append(f"{integer_range(first, b - 1)}{fraction}")
      if b_closed and (b > a or (b == a and a_closed)):
        parts.append(f"{b}{zeros}")
    if not parts:
      raise SchemaError(f"{path}: no number lies within its bounds")
    return "(" + "|".join(parts) + ")"

  def _boolean(self, schema: dict, path: str, refs) -> str:
    return BOOLEAN

  def _null(self, schema: dict, path: str, refs) -> str:
    return NULL

  def _array(self, schema: dict, path: str, refs) -> str:
    items = schema.get("items", True)
    if isinstance(items, list):
      raise SchemaError(f"{path}/items: a list of item schemas is not supported (draft "
                        "2020-12's prefixItems is)")
    lo, hi = _bounds(schema, "minItems", "maxItems", path)
    prefix = schema.get("prefixItems", [])
    if not isinstance(prefix, list):
      raise SchemaError(f"{path}/prefixItems: must be a list of schemas")
    if prefix:  # (a tuple: its positions in order, then `items` for any more)
      if hi is not None:
        prefix = prefix[:hi]
      sep = f"{WHITESPACE},{WHITESPACE}"
      parts = [self.convert(sub, f"{path}/prefixItems/{i}", refs)
               for i, sub in enumerate(prefix)]
      tail = ""  # what may follow the last position
      if items is not False and (hi is None or hi > len(prefix)):
        more = self.convert(items, f"{path}/items", refs)
        extra_lo = max(lo - len(prefix), 0)
        tail = (f"({sep}{more}){{{extra_lo},}}" if hi is None
                else f"({sep}{more}){{{extra_lo},{hi - len(prefix)}}}")
      elif lo > len(prefix):
        raise SchemaError(f"{path}: minItems {lo} exceeds the {len(prefix)} items allowed")
      # From the last position back: those at or past minItems may be left out.
      for k in range(len(parts) - 1, -1, -1):
        tail = (sep if k else "") + parts[k] + tail
        if k >= lo:
          tail = f"({tail})?"
      return rf"\[{WHITESPACE}{tail}{WHITESPACE}\]"
    if items is False:
      return rf"\[{WHITESPACE}\]"
    item = self.convert(items, f"{path}/items", refs)
    return rf"\[{WHITESPACE}{_items(item, lo, hi)}{WHITESPACE}\]"

  def _object(self, schema: dict, path: str, refs) -> str:
    properties = schema.get("properties")
    extra = schema.get("additionalProperties", properties is None)
    lo, hi = _bounds(schema, "minProperties", "maxProperties", path)
    if properties is None and extra is not False:
      # A map: any keys, each value as `extra` says (any value where true / {}).
      value = (_free_value(MAX_FREE_DEPTH - 1) if extra in (True, {})
               else self.convert(extra, f"{path}/additionalProperties", refs))
      member = f"{STRING}{WHITESPACE}:{WHITESPACE}{value}"
      return rf"\{{{WHITESPACE}{_items(member, lo, hi)}{WHITESPACE}\}}"
    if lo or hi is not None:
      raise SchemaError(f"{path}: minProperties / maxProperties are supported for maps "
                        "(additionalProperties without properties) only")
    if extra is not False:
      raise SchemaError(f"{path}/additionalProperties: {extra!r} is not supported with "
                        "properties: the object holds the properties named (false, the "
                        "default with properties)")
    properties = {} if properties is None else properties
    if not isinstance(properties, dict):
      raise SchemaError(f"{path}/properties: must be an object")
    required = schema.get("required", [])
    if not isinstance(required, list) or not set(required) <= set(properties):
      raise SchemaError(f"{path}/required: must list names of properties, got {required!r}")
    members = [(f"{_literal(name)}{WHITESPACE}:{WHITESPACE}"
                f"{self.convert(sub, f'{path}/properties/{name}', refs)}", name in required)
               for name, sub in properties.items()]
    sep = f"{WHITESPACE},{WHITESPACE}"
    # Which member comes first decides where commas go: each option starts at one that
    # may be first (optional ones up to the first required one) and keeps the rest.
    options = []
    for first, (member, is_required) in enumerate(members):
      rest = "".join(f"{sep}{m}" if r else f"({sep}{m})?" for m, r in members[first + 1:])
      options.append(member + rest)
      if is_required:
        break
    body = "(" + "|".join(options) + ")" if options else ""
    if not any(r for _, r in members):
      body = f"({body})?" if body else ""
    return rf"\{{{WHITESPACE}{body}{WHITESPACE}\}}"


_BOUND_KEYS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")


def integer_range(lo: int | None, hi: int | None) -> str:
  """The decimal integers in [lo, hi] (None: unbounded that side), as JSON writes them (no
  leading zeros, no "-0")."""
  if lo is None and hi is None:
    return INTEGER
  parts = []
  if hi is None or hi >= 0:
    parts.append(_natural_range(0 if lo is None else max(lo, 0), hi))
  if lo is None or lo < 0:  # -m for m in [max(1, -hi), -lo]
    magnitudes = _natural_range(1 if hi is None or hi >= 0 else -hi,
                                None if lo is None else -lo)
    parts.append(f"-({magnitudes})")
  return "(" + "|".join(parts) + ")" if len(parts) > 1 else parts[0]


def _natural_range(lo: int, hi: int | None) -> str:
  """The numbers in [lo, hi] (0 <= lo <= hi; None: unbounded) without leading zeros: one
  same-length digit range per number of digits."""
  parts = []
  digits = len(str(lo))
  for n in range(digits, (digits if hi is None else len(str(hi))) + 1):
    a = max(lo, 10 ** (n - 1) if n > 1 else 0)
    b = 10 ** n - 1 if hi is None else min(hi, 10 ** n - 1)
    if a <= b:
      parts.append(_digits_range(str(a), str(b)))
  if hi is None:
    parts.append(f"[1-9][0-9]{{{digits},}}")
  return "(" + "|".join(parts) + ")" if len(parts) > 1 else parts[0]


def _digits_range(lo: str, hi: str) -> str:
  """The digit strings from lo to hi, both of one length (lo <= hi)."""
  if lo == hi:
    return lo
  if len(lo) == 1:
    return f"[{lo}-{hi}]"
  if lo[0] == hi[0]:
    return lo[0] + f"({_digits_range(lo[1:], hi[1:])})"
  n = len(lo) - 1
  parts = []
  first = lo[0]
  if lo[1:] != "0" * n:  # lo's leading digit with the rest from lo[1:] up
    parts.append(lo[0] + f"({_digits_range(lo[1:], '9' * n)})")
    first = str(int(lo[0]) + 1)
  last = hi[0] if hi[1:] == "9" * n else str(int(hi[0]) - 1)
  if first <= last:  # whole blocks of leading digits
    parts.append((first if first == last else f"[{first}-{last}]") + f"[0-9]{{{n}}}")
  if hi[1:] != "9" * n:  # hi's leading digit with the rest up to hi[1:]
    parts.append(hi[0] + f"({_digits_range('0' * n, hi[1:])})")
  return "(" + "|".join(parts) + ")" if len(parts) > 1 else parts[0]


def _bounds(schema: dict, lo_key: str, hi_key: str, path: str) -> tuple[int, int | None]:
  lo, hi = schema.get(lo_key, 0), schema.get(hi_key)
  for key, value in ((lo_key, lo), (hi_key, hi)):
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < 0):
      raise SchemaError(f"{path}/{key}: must be an integer >= 0, got {value!r}")
  if hi is not None and hi < lo:
    raise SchemaError(f"{path}: {hi_key} {hi} is below {lo_key} {lo}")
  return lo, hi


def _numeric_bounds(schema: dict, path: str
                    ) -> tuple[tuple[float, bool] | None, tuple[float, bool] | None]:
  """(lower, upper) bounds of a number as (value, inclusive): the tighter of minimum and
  exclusiveMinimum, of maximum and exclusiveMaximum; None where there is none."""
  lo = hi = None
  for key in _BOUND_KEYS:
    value = schema.get(key)
    if value is None:
      continue
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or value != value
        or abs(value) == float("inf")):
      raise SchemaError(f"{path}/{key}: must be a finite number, got {value!r}")
    bound = (value, not key.startswith("exclusive"))
    if key in ("minimum", "exclusiveMinimum"):  # the larger, the exclusive one at a tie
      lo = bound if lo is None or (value, not bound[1]) > (lo[0], not lo[1]) else lo
    else:  # the smaller, the exclusive one at a tie
      hi = bound if hi is None or bound < hi else hi
  return lo, hi
