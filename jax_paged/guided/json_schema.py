"""A JSON schema as a regular expression over its valid JSON texts (outlines' approach).

Supported (anything else is refused with a message naming the keyword and its path):
  type: string (minLength, maxLength, pattern, format date-time / date / time / uuid),
    integer and number (a minimum / exclusiveMinimum of 0 or more drops the sign; other
    bounds are refused), boolean, null, array (items, minItems, maxItems), object
    (properties in the schema's order, required; additionalProperties false, or absent
    with properties; without properties, any object of depth-limited values), and a list
    of types; enum, const; anyOf, oneOf (as anyOf), allOf of one schema; $ref into
    $defs / definitions (not recursive); true / {} (any JSON value).
Values of unconstrained JSON (an object without properties, `{}`, json_object mode) nest
at most `MAX_FREE_DEPTH` levels: a regular expression cannot count brackets.

Whitespace between a JSON text's tokens is at most one space (outlines' default): a
model that may emit any whitespace can emit it forever.
"""

from __future__ import annotations

import json
from typing import Any

from jax_paged.guided.regex_dfa import regex_escape

WHITESPACE = r"[ ]?"
STRING_CHAR = r'([^"\\\x00-\x1f]|\\(["\\/bfnrt]|u[0-9a-fA-F]{4}))'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(\.[0-9]+)?([eE][+-]?[0-9]+)?"
BOOLEAN = "(true|false)"
NULL = "null"
FORMATS = {
    "date-time": (r'"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3])'
                  r':[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"'),
    "date": r'"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"',
    "time": r'"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3])'
            r':[0-5][0-9])?"',
    "uuid": r'"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"',
}
MAX_FREE_DEPTH = 3

# Keywords that only describe (never constrain) a value.
_ANNOTATIONS = {"title", "description", "examples", "default", "$schema", "$id", "$comment",
                "$defs", "definitions", "deprecated", "readOnly", "writeOnly", "strict",
                "name"}
_KEYWORDS = {
    "string": {"type", "minLength", "maxLength", "pattern", "format", "enum", "const"},
    "integer": {"type", "minimum", "exclusiveMinimum", "enum", "const"},
    "number": {"type", "minimum", "exclusiveMinimum", "enum", "const"},
    "boolean": {"type", "enum", "const"},
    "null": {"type", "enum", "const"},
    "array": {"type", "items", "minItems", "maxItems", "enum", "const"},
    "object": {"type", "properties", "required", "additionalProperties", "enum", "const"},
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
    return INTEGER.removeprefix("-?") if _non_negative(schema, path) else INTEGER

  def _number(self, schema: dict, path: str, refs) -> str:
    return NUMBER.removeprefix("-?") if _non_negative(schema, path) else NUMBER

  def _boolean(self, schema: dict, path: str, refs) -> str:
    return BOOLEAN

  def _null(self, schema: dict, path: str, refs) -> str:
    return NULL

  def _array(self, schema: dict, path: str, refs) -> str:
    items = schema.get("items", True)
    if isinstance(items, list):
      raise SchemaError(f"{path}/items: a list of item schemas is not supported")
    item = self.convert(items, f"{path}/items", refs)
    lo, hi = _bounds(schema, "minItems", "maxItems", path)
    return rf"\[{WHITESPACE}{_items(item, lo, hi)}{WHITESPACE}\]"

  def _object(self, schema: dict, path: str, refs) -> str:
    properties = schema.get("properties")
    extra = schema.get("additionalProperties", properties is None)
    if properties is None and extra in (True, {}):
      return _free_object(MAX_FREE_DEPTH)
    if extra is not False:
      raise SchemaError(f"{path}/additionalProperties: {extra!r} is not supported: only "
                        "false (the object holds the properties named; the default with "
                        "properties) or true without properties")
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


def _bounds(schema: dict, lo_key: str, hi_key: str, path: str) -> tuple[int, int | None]:
  lo, hi = schema.get(lo_key, 0), schema.get(hi_key)
  for key, value in ((lo_key, lo), (hi_key, hi)):
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < 0):
      raise SchemaError(f"{path}/{key}: must be an integer >= 0, got {value!r}")
  if hi is not None and hi < lo:
    raise SchemaError(f"{path}: {hi_key} {hi} is below {lo_key} {lo}")
  return lo, hi


def _non_negative(schema: dict, path: str) -> bool:
  """Whether a number's bounds say it is >= 0 (a minimum of 0, which drops the sign);
  other bounds are refused."""
  if "exclusiveMinimum" in schema:
    raise SchemaError(f"{path}/exclusiveMinimum: not supported (only minimum 0)")
  bound = schema.get("minimum")
  if bound is None:
    return False
  if isinstance(bound, bool) or bound != 0:
    raise SchemaError(f"{path}/minimum: {bound!r} is not supported (only 0, which drops "
                      "the sign)")
  return True
