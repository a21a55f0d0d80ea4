"""Structured output: regular expressions as byte automata against Python's `re`, JSON
schemas against `jsonschema`, token tables against walking each token's bytes, and the
engine's guided generation (every output a match, unguided rows undisturbed, preemption,
parallel samples)."""

import json
import math
import random
import re

import numpy as np
import pytest
from flax import nnx

from jax_paged import Engine, Request
from jax_paged.guided import Guide, RegexError, SchemaError, Vocabulary, json_schema
from jax_paged.guided.regex_dfa import compile_regex, regex_escape
from jax_paged.serving import runner as runner_lib
from models import gpt2

PATTERNS = [
    r"[^\"\\]{2,5}|a*?\d\w(?:x|y)$", r"(ab|cd)*e?", r"-?\d+(\.\d+)?", r".", r"[α-ω]+x",
    r"\"([^\"\\]|\\.)*\"", r"(?s).{0,3}", r"^\s\S\W[^a-c\d]$", r"(a|b|)+c{2}", r"x{0}y",
    r"[\u0100-\U0001F600]z?", r"(?:ab){1,3}?", r"a++b", r"(?>ab|a)c",
]
ALPHABET = "ab cdexyz019\"\\.-αβω\n中\t😀Ā"


def _random_texts(rng: random.Random, n: int) -> list[str]:
  return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 7))) for _ in range(n)]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_regex_automaton_matches_as_python_re(pattern):
  dfa = compile_regex(pattern)
  rng = random.Random(pattern)
  texts = _random_texts(rng, 3000)
  # And strings of the pattern's own characters, which match more often.
  own = [c for c in pattern if c not in "\\[]()|*+?{}^$"]
  texts += ["".join(rng.choice(own) for _ in range(rng.randint(0, 6))) for _ in range(2000)]
  wrong = [t for t in texts
           if bool(re.fullmatch(pattern, t, re.ASCII)) != dfa.matches(t.encode())]
  assert not wrong[:5]
  assert dfa.table.shape == (dfa.num_states, 256) and dfa.table.max() < dfa.num_states


def test_regex_automaton_is_minimal_and_utf8_exact():
  assert compile_regex(r"(a|b)*").num_states == 1
  assert compile_regex(r"(ab|cd)*e?").num_states == 4
  dfa = compile_regex(r"[^a]")  # every character but "a", in all UTF-8 lengths
  for ch in ["b", "é", "中", "😀", "\x00", "\U0010FFFF"]:
    assert dfa.matches(ch.encode())
  for data in [b"a", "é".encode()[:1], b"\xed\xa0\x80", b"\xc0\x80", b"\xff", b""]:
    assert not dfa.matches(data)  # (a surrogate, an overlong encoding, no byte)


@pytest.mark.parametrize("pattern,message", [
    (r"(a)\1", "backreferences"), (r"a(?=b)", "lookaround"), (r"\bab", "anchors"),
    (r"(?i)ab", "flags"), ("a{2000}", "above 1000"), ("[a", "not a valid regular"),
    (r"a$b", "anchors"), (r"[^\s\S]", "matches no text"),
    (r"(?(1)a|b)", "not a valid regular"),
])
def test_regex_refusals_say_why(pattern, message):
  with pytest.raises(RegexError, match=re.escape(message)):
    compile_regex(pattern)


def test_regex_escape_matches_itself_only():
  text = "a.b*c+(d)[e]{f}|g^$\\h?"
  dfa = compile_regex(regex_escape(text))
  assert dfa.matches(text.encode()) and not dfa.matches(text[:-1].encode())


SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 4}, "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2},
        "ok": {"type": "boolean"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {
        "a": {"enum": ["x", "y", 3, None]}, "b": {"anyOf": [{"type": "null"},
                                                          {"type": "number"}]},
        "d": {"type": "string", "format": "date"}, "e": {"$ref": "#/$defs/E"}},
     "$defs": {"E": {"type": "array", "items": {"const": [1, "z"]}, "maxItems": 1}}},
    {"type": ["string", "integer"], "pattern": "^[a-c]+$"},
    {"type": "object", "properties": {"x": {}}, "required": ["x"]},
    {"type": "array", "items": {"type": "object", "properties": {
        "k": {"type": "string", "minLength": 2}}, "required": ["k"]}},
    {"oneOf": [{"type": "string", "format": "uuid"}, {"type": "number", "minimum": 0}]},
    {"type": "object", "properties": {"mail": {"type": "string", "format": "email"}, "ip": {
        "type": "string", "format": "ipv4"}, "n": {"type": "integer", "minimum": -3,
                                                   "maximum": 41}}},
    {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0,
                                                "maximum": 50}, "maxProperties": 3},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"enum": ["x", "ab"]}],
     "items": {"type": "boolean"}},
]


def _random_value(rng: random.Random, depth: int = 0):
  kind = rng.choice(["str", "int", "num", "bool", "null", "obj", "arr"][:7 if depth < 3 else 5])
  if kind == "str":
    return rng.choice(["", "x", "ab", "abcd", "abcde", "2024-02-30", "2024-12-01", "k",
                       "12345678-1234-1234-1234-123456789abc", "é\n\"", "c", "a.b@cd.org",
                       "10.0.255.1", "256.1.1.1"])
  if kind == "int":
    return rng.choice([0, 1, -3, 42, 41, -4])
  if kind == "num":
    return rng.choice([0.5, -1.25, 1.5e-7])  # (not integers: "2.0" is one)
  if kind == "bool":
    return rng.choice([True, False])
  if kind == "null":
    return None
  if kind == "arr":
    return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
  keys = ["name", "age", "tags", "ok", "a", "b", "d", "e", "x", "k", "z", "mail", "ip", "n"]
  return {k: _random_value(rng, depth + 1) for k in rng.sample(keys, rng.randint(0, 4))}


def _json_texts(value) -> list[tuple[str, bool]]:
  """`value` as JSON texts, each with whether the guide must take it: compact (it must),
  and spaced as json.dumps does (between tokens it must; inside an enum or const value,
  which the guide writes compact, it may not)."""
  return [(json.dumps(value, ensure_ascii=False, separators=(",", ":")), True),
          (json.dumps(value, ensure_ascii=False), False)]


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_regex_accepts_exactly_the_valid_texts(index):
  jsonschema = pytest.importorskip("jsonschema")
  schema = SCHEMAS[index]
  dfa = compile_regex(json_schema.to_regex(schema))
  validator = jsonschema.Draft202012Validator(schema,
                                              format_checker=jsonschema.FormatChecker())
  rng = random.Random(index)
  values = [_random_value(rng) for _ in range(3000)]
  for props in [{"name": "ab", "age": 3}, {"name": "ab", "age": 3, "tags": ["x"]},
                {"name": "", "age": 0, "ok": True}, {"x": [1, {"a": None}]},
                {"a": "x", "b": 2.5, "d": "2024-12-01"}, {"e": [[1, "z"]]}]:
    values.append(props)
  accepted = 0
  for value in values:
    # Properties out of the schema's order are valid JSON but not what the guide emits.
    order = list(schema.get("properties", {}))
    in_order = not isinstance(value, dict) or [k for k in order if k in value] == list(value)
    for text, must in _json_texts(value):
      ok = dfa.matches(text.encode())
      if ok:
        accepted += 1
        assert validator.is_valid(value), text
      elif must and in_order and validator.is_valid(value) and _nesting(value) <= 3:
        raise AssertionError(f"valid but refused: {text}")
  assert accepted  # (some of each schema's texts are valid)


def _nesting(value) -> int:
  if isinstance(value, dict):
    return 1 + max(map(_nesting, value.values()), default=0)
  if isinstance(value, list):
    return 1 + max(map(_nesting, value), default=0)
  return 0


@pytest.mark.parametrize("bounds", [
    {}, {"minimum": 0}, {"minimum": 0, "maximum": 150}, {"minimum": 1, "maximum": 10},
    {"minimum": -5, "maximum": 5}, {"minimum": -120, "maximum": -3}, {"maximum": 5},
    {"minimum": -7}, {"minimum": 12}, {"maximum": -12}, {"minimum": 17, "maximum": 4321},
    {"exclusiveMinimum": 2.5, "exclusiveMaximum": 99}, {"minimum": 99, "maximum": 1000},
    {"minimum": 100, "maximum": 100}, {"minimum": -3000, "maximum": 2999.9}])
def test_integer_bounds_match_exactly_the_integers_within(bounds):
  dfa = compile_regex(json_schema.to_regex(dict(type="integer", **bounds)))
  lo = max(bounds.get("minimum", -10 ** 9), np.floor(bounds.get("exclusiveMinimum",
                                                                -10 ** 9)) + 1)
  hi = min(bounds.get("maximum", 10 ** 9), np.ceil(bounds.get("exclusiveMaximum",
                                                              10 ** 9)) - 1)
  values = [*range(-5000, 5000, 7), *range(-130, 130), 10 ** 6, -10 ** 6, 4321, 4322, 1000]
  wrong = [v for v in values if dfa.matches(str(v).encode()) != (lo <= v <= hi)]
  assert not wrong[:5]
  assert not any(dfa.matches(t) for t in [b"00", b"01", b"-0", b"-01", b"+1", b"", b"1.0"])


@pytest.mark.parametrize("bounds", [
    {"minimum": 0}, {"minimum": 0, "maximum": 1}, {"exclusiveMinimum": 0, "maximum": 1},
    {"minimum": 2, "exclusiveMaximum": 10}, {"maximum": 5}, {"exclusiveMaximum": 1},
    {"minimum": 3, "maximum": 3}, {"exclusiveMinimum": 7}, {"minimum": 1},
    {"minimum": 0, "exclusiveMinimum": 0, "maximum": 100, "exclusiveMaximum": 100}])
def test_number_bounds_match_exactly_the_numbers_within(bounds):
  dfa = compile_regex(json_schema.to_regex(dict(type="number", **bounds)))
  rng = random.Random(str(bounds))
  texts = [f"{rng.choice(['', '-'])}{rng.randint(0, 120)}" + rng.choice(
      ["", ".0", ".00", "." + "".join(rng.choice("0123456789")
                                      for _ in range(rng.randint(1, 3)))])
           for _ in range(4000)] + ["1", "0", "1.0", "0.0", "3", "3.000", "100", "7", "7.01"]
  for text in texts:
    x = float(text)
    within = (x >= bounds.get("minimum", -math.inf) and x > bounds.get("exclusiveMinimum",
                                                                       -math.inf)
              and x <= bounds.get("maximum", math.inf)
              and x < bounds.get("exclusiveMaximum", math.inf))
    if text.startswith("-0") and not text.strip("-0."):
      continue  # ("-0": JSON's, the guide writes 0)
    assert dfa.matches(text.encode()) == within, text
  assert not any(dfa.matches(t) for t in [b"01", b"1.", b".5", b"+1", b""])
  assert dfa.matches(b"1e3") == (bounds == {"minimum": 0})  # (bounded: no exponent)


def test_json_object_mode_takes_objects_only():
  dfa = compile_regex(json_schema.to_regex(None))
  assert dfa.matches(b'{"a": [1, {"b": null}], "c": "d"}') and dfa.matches(b"{}")
  assert not dfa.matches(b"[1]") and not dfa.matches(b'"x"') and not dfa.matches(b"{")


@pytest.mark.parametrize("schema,message", [
    ({"type": "integer", "multipleOf": 3}, "['multipleOf'] for type integer"),
    ({"type": "number", "maximum": 2.5}, "maximum: 2.5 is not supported"),
    ({"type": "number", "minimum": -1}, "minimum: -1 is not supported"),
    ({"type": "number", "exclusiveMinimum": 3, "maximum": 3}, "no number lies"),
    ({"type": "integer", "minimum": 3, "exclusiveMaximum": 3}, "no integer lies"),
    ({"type": "integer", "minimum": "3"}, "minimum: must be a finite number"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, "recursive"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}},
     "additionalProperties"),
    ({"type": "object", "properties": {"a": {}}, "maxProperties": 1}, "maxProperties"),
    ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2}, "exceeds"),
    ({"type": "strin"}, "'strin' is not a JSON schema type"),
    ({"type": "string", "format": "hostname"}, "'hostname' is not supported"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "maxItems 2 is below minItems 3"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
    ("{not json", "not valid JSON"),
    (False, "allows no value"),
])
def test_json_schema_refusals_name_the_keyword(schema, message):
  with pytest.raises(SchemaError, match=re.escape(message)):
    json_schema.to_regex(schema)


def _bpe_vocabulary(rng: random.Random, size: int = 600) -> Vocabulary:
  """Every byte, then random multi-byte tokens (some of several characters, some cut
  mid-character), a special token, and an eos."""
  tokens = [bytes([i]) for i in range(256)]
  words = ['{"', '":', ' "', "true", "null", "abc", "12", "é", "中文", '"}', ", ", "0.5"]
  while len(tokens) < size - 2:
    word = "".join(rng.choice(words) for _ in range(rng.randint(1, 3))).encode()
    tokens.append(word[:rng.randint(1, len(word))])
  return Vocabulary(tuple(tokens) + (None, None), (size - 1,))


def test_token_table_is_every_token_walked_byte_by_byte():
  rng = random.Random(5)
  vocab = _bpe_vocabulary(rng)
  dfa = compile_regex(json_schema.to_regex(SCHEMAS[0]))
  guide = Guide.from_json_schema(SCHEMAS[0], vocab)
  assert guide.table.shape == (dfa.num_states, vocab.size)
  for state in range(dfa.num_states):
    for token, data in enumerate(vocab.token_bytes):
      if data is None:
        continue
      at = state
      for byte in data:
        at = dfa.table[at, byte]
        if at < 0:
          break
      assert guide.table[state, token] == at, (state, data)
  eos = vocab.eos_token_ids[0]
  np.testing.assert_array_equal(guide.table[:, eos] >= 0, dfa.accepting)
  assert (guide.table[:, vocab.size - 2] == -1).all()  # the special token: never
  # Done: after the closing brace, where nothing may follow (one state, minimal).
  assert guide.done.sum() == 1 and guide.done[guide.walk(0, list(b'{"name":"","age":0}'))]


def test_guide_done_where_nothing_may_follow():
  guide = Guide.from_choices(["yes", "no", "yes!"], Vocabulary.of_bytes())
  state = guide.walk(0, list(b"yes"))
  assert guide.accepting[state] and not guide.done[state]
  assert guide.done[guide.walk(state, [ord("!")])] and guide.done[guide.walk(0, list(b"no"))]
  assert guide.walk(0, list(b"nx")) == -1
  with pytest.raises(ValueError, match="non-empty list of non-empty texts"):
    Guide.from_choices(["a", ""], Vocabulary.of_bytes())


def test_a_vocabulary_that_cannot_spell_a_match_is_refused():
  vocab = Vocabulary((b"ab", b"c", None), (2,))
  with pytest.raises(RegexError, match="cannot spell any match"):
    Guide.from_regex("a", vocab)
  guide = Guide.from_regex("(ab|a)c", vocab)  # "a" then "c" is no token path: only "ab"
  assert guide.walk(0, [0, 1, 2]) >= 0 and guide.table[0, 1] == -1


# ----------------------------------------------------------------------------- the engine

CONFIG = gpt2.GPT2Config(vocab_size=258, n_positions=160, n_embd=32, n_layer=2, n_head=4,
                         bos_token_id=None, eos_token_id=257)
EOS = 257
VOCAB = Vocabulary(tuple(bytes([i]) for i in range(256)) + (None, None), (EOS,))
PATTERN = r"(\d{3})-[a-z]{2,6}( [A-Z]+)?"


@pytest.fixture(scope="module")
def model():
  return gpt2.GPT2LMHeadModel(CONFIG, rngs=nnx.Rngs(3))


def _text(tokens) -> str:
  return bytes(t for t in tokens if t < 256).decode("utf-8")


def _requests(guide, n_guided=6, seed=0):
  rng = np.random.default_rng(seed)
  reqs = [Request(rng.integers(0, 256, rng.integers(2, 20)).tolist(), 40,
                  temperature=1.0 if i % 2 else 0.0, seed=i, guide=guide)
          for i in range(n_guided)]
  return reqs + [Request(rng.integers(0, 256, 9).tolist(), 12, temperature=0.8, seed=99)]


def test_guided_generation_matches_and_leaves_other_rows_alone(model):
  guide = Guide.from_regex(PATTERN, VOCAB)
  reqs = _requests(guide)
  eng = Engine(model, max_batch=8, num_pages=96, page_size=8, eos_token_id=EOS,
               steps_per_call=5)
  out, _ = eng.generate(reqs)
  ended = [tokens for tokens in out[:-1] if tokens[-1] == EOS]
  assert len(ended) >= 3
  for tokens in ended:
    assert re.fullmatch(PATTERN, _text(tokens[:-1])), tokens
  for tokens in out[:-1]:  # the others ran out of tokens on a prefix of a match
    assert tokens[-1] == EOS or (len(tokens) == 40 and guide.walk(0, tokens) >= 0)
  alone, _ = Engine(model, max_batch=8, num_pages=96, page_size=8, eos_token_id=EOS
                    ).generate([reqs[-1]])
  assert out[-1] == alone[0]  # the unguided row draws as it does with no guide beside it


def test_guided_greedy_tokens_are_the_allowed_argmax(model):
  """Each greedy guided token is the most likely of those its state allows, by the
  model's logits after each prefix of the output (one prefill of every prefix)."""
  guide = Guide.from_json_schema({"type": "object", "properties": {
      "id": {"enum": [1, 22, 333]}, "ok": {"type": "boolean"}}, "required": ["id", "ok"]},
      VOCAB)
  prompt = [5, 80, 200, 7]
  eng = Engine(model, max_batch=4, num_pages=96, page_size=8, eos_token_id=EOS)
  (tokens,), _ = eng.generate([Request(prompt, 60, guide=guide)])
  assert json.loads(_text(tokens)).keys() == {"id", "ok"} and tokens[-1] == ord("}")
  contexts = [prompt + tokens[:i] for i in range(len(tokens))]
  runner = runner_lib.ModelRunner(model)
  width = max(map(len, contexts))
  kv = runner.create_pool(num_pages=len(contexts) * (width // 8 + 1), page_size=8,
                          max_seqs=len(contexts), max_pages_per_seq=width // 8 + 1)
  padded = np.zeros((len(contexts), width), np.int32)
  for row, context in enumerate(contexts):
    padded[row, :len(context)] = context
  logits, _ = runner.prefill(kv, padded, np.asarray(list(map(len, contexts)), np.int32),
                             np.arange(len(contexts), dtype=np.int32))
  state = 0
  for token, row in zip(tokens, np.asarray(logits)):
    allowed = guide.table[state] >= 0
    assert allowed.sum() < VOCAB.size - 2  # (the guide decided something)
    assert token == np.argmax(np.where(allowed, row, -np.inf))
    state = guide.walk(state, [token])


def test_guided_samples_preemption_and_done(model):
  guide = Guide.from_choices(["alpha", "beta", "gamma delta"], VOCAB)
  reqs = [Request([10 + i, 20, 30], 30, temperature=1.0, seed=i, n=3, guide=guide)
          for i in range(4)]
  roomy = Engine(model, max_batch=12, num_pages=96, page_size=4, eos_token_id=EOS)
  out, _ = roomy.generate(reqs)
  for samples in out:
    for tokens in samples:  # done after the text: no eos needed
      assert _text(tokens) in ("alpha", "beta", "gamma delta"), tokens
  long = Guide.from_regex(r"[a-z]{30,40}", VOCAB)
  reqs = [Request([3 + i], 45, temperature=1.0, seed=i, guide=long) for i in range(6)]
  free, _ = Engine(model, max_batch=6, num_pages=96, page_size=4, eos_token_id=EOS
                   ).generate(reqs)
  tight = Engine(model, max_batch=6, num_pages=40, page_size=4, eos_token_id=EOS,
                 steps_per_call=6)
  pressed, report = tight.generate(reqs)
  assert report.preemptions > 0 and pressed == free
  for tokens in free:
    assert re.fullmatch(r"[a-z]{30,40}", _text(tokens))


def test_a_guide_for_a_larger_vocabulary_is_refused(model):
  big = Guide.from_regex("a", Vocabulary(tuple(bytes([i % 256]) for i in range(300))))
  eng = Engine(model, max_batch=2, num_pages=16, page_size=8)
  with pytest.raises(ValueError, match="request 0: guide's vocabulary has 300 tokens"):
    eng.generate([Request([1], 3, guide=big)])
  with pytest.raises(ValueError, match="guide must be a jax_paged.guided.Guide"):
    eng.generate([Request([1], 3, guide="a")])
