"""The engine on its own thread (`EngineLoop`) and the OpenAI-compatible server over it, on
CPU with the tiny GPT-2 (random weights, text as UTF-8 bytes)."""

import asyncio
import dataclasses
import functools
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import unittest.mock
import urllib.request

import jax.numpy as jnp
import numpy as np
import pytest

from jax_paged import Engine, Request, TokenEvent
from jax_paged.cli import BYTES, load_tokenizer, model_families
from jax_paged import openai_server
from jax_paged.openai_server import ChatTemplate, OpenAIServer, Served
from jax_paged.guided import Guide, Vocabulary
from jax_paged.serving import engine_loop
from jax_paged.serving.engine_loop import EngineClosed, EngineLoop, EngineProcess
from jax_paged.serving.request import validate_requests
from models import gpt2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_engine(model) -> Engine:
  return Engine(model, max_batch=8, num_pages=160, page_size=16, steps_per_call=4,
                detokenize=BYTES.decode)


@pytest.fixture(scope="module")
def model():
  return gpt2.FAMILY.presets["tiny"](jnp.float32, 0)


# A chat template in Hugging Face's dialect (special tokens, filters, raise_exception).
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
            "{{ raise_exception('no tools here') }}{% endif %}"
            "[{{ m['role'] }}] {{ m['content'] | trim }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def served(model):
  """(base url, the server's engine loop, what it serves)."""
  loop = EngineLoop(make_engine(model))
  what = Served("tiny", model.spec, BYTES, (), ChatTemplate(TEMPLATE, {"bos_token": "<s>"}))
  server = OpenAIServer(("127.0.0.1", 0), loop, what)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{server.server_address[1]}", loop, what
  server.shutdown()
  server.server_close()
  loop.close()


def collect(sub) -> dict:
  """(request id, sample) -> its events, from a submission."""
  out = {}
  for events in sub:
    for e in events:
      out.setdefault((e.request_id, e.sample), []).append(e)
  return out


def post(url: str, body, path: str = "/v1/completions") -> tuple[int, object]:
  data = body if isinstance(body, bytes) else json.dumps(body).encode()
  request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=120) as r:
      raw = r.read().decode()
      status = r.status
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())
  if raw.startswith("data: "):
    return status, [line[6:] for line in raw.split("\n\n") if line]
  return status, json.loads(raw)


def test_engine_loop_serves_threads_as_generate_does(model):
  prompts = [list(np.random.default_rng(i).integers(0, 256, 5 + 9 * i)) for i in range(4)]
  requests = [Request(prompts[0], 9), Request(prompts[1], 7, temperature=0.9, seed=5, n=2),
              Request(prompts[2], 12, temperature=1.0, top_p=0.8, seed=1),
              Request(prompts[3], 6, logprobs=True, top_logprobs=2)]
  expected, _ = make_engine(model).generate(requests)
  loop = EngineLoop(make_engine(model))
  try:
    subs = [None] * len(requests)

    def submit(i):
      subs[i] = loop.submit([requests[i]])
    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(requests))]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    for request, sub, want in zip(requests, subs, expected):
      rid, = sub.accepted()
      got = collect(sub)
      assert sorted(got) == [(rid, j) for j in range(request.n)]
      tokens = [[e.token for e in got[rid, j]] for j in range(request.n)]
      assert tokens == (want if request.n > 1 else [want])
      assert all(events[-1].finish_reason == "length" for events in got.values())
    # Two requests submitted together: the engine's ids in order, events of both.
    sub = loop.submit([Request(prompts[0], 9), Request(prompts[3], 3)])
    ids = sub.accepted()
    got = collect(sub)
    assert [e.token for e in got[ids[0], 0]] == expected[0]
    assert len(got[ids[1], 0]) == 3
  finally:
    loop.close()


def test_engine_loop_errors_cancel_and_close(model):
  engine = make_engine(model)
  loop = EngineLoop(engine)
  # The engine's errors: named by the request's place in the submission; none runs.
  with pytest.raises(ValueError, match=r"^prompt is empty"):
    loop.submit([Request([], 4)]).accepted()
  with pytest.raises(ValueError, match=r"^requests\[1\]: max_new_tokens must be an int"):
    list(loop.submit([Request([1, 2], 4), Request([3], 0)]))
  assert loop.num_unfinished == 0
  with pytest.raises(ValueError, match="non-empty list"):
    loop.submit(Request([1], 2))
  # Cancelled after its first events: no more come, its pages go back.
  sub = loop.submit([Request([7, 8, 9], 400, n=2)])
  it = iter(sub)
  first = next(it)
  sub.cancel()
  rest = sum(len(events) for events in it)
  assert len(first) + rest < 2 * 400
  assert loop.num_unfinished == 0 and not engine.has_unfinished_requests()
  assert engine.kv.num_free_pages() + engine.num_cached_pages == engine.num_pages
  # A device call that fails fails its requests; the loop serves the next ones.
  step = engine.step

  def fail():
    engine.step = step
    raise RuntimeError("device lost")
  engine.step = fail
  with pytest.raises(RuntimeError, match="device lost"):
    list(loop.submit([Request([1, 2, 3], 5)]))
  sub = loop.submit([Request([1, 2, 3], 5)])
  assert len(collect(sub)[sub.accepted()[0], 0]) == 5
  # Closing ends what is unfinished; nothing is taken after.
  sub = loop.submit([Request([4, 5], 400)])
  next(iter(sub))
  loop.close()
  with pytest.raises(EngineClosed):
    list(sub)
  with pytest.raises(EngineClosed):
    loop.submit([Request([1], 2)])
  assert not engine.has_unfinished_requests()


def test_submissions_made_in_an_event_loop_are_awaited(model):
  """Submitted from coroutines: awaited (`wait_accepted`, `async for`), the same tokens as
  generate; errors raised, cancel ends the iteration; each kind refuses the other's
  waiting."""
  prompts = [list(np.random.default_rng(i).integers(0, 256, 4 + 7 * i)) for i in range(3)]
  requests = [Request(prompts[0], 9), Request(prompts[1], 7, temperature=1.0, seed=2),
              Request(prompts[2], 5)]
  expected, _ = make_engine(model).generate(requests)
  loop = EngineLoop(make_engine(model))

  async def tokens_of(request):
    sub = loop.submit([request])
    rid, = await sub.wait_accepted()
    tokens = []
    async for events in sub:
      tokens += [e.token for e in events if e.request_id == rid]
    return tokens

  async def main():
    got = await asyncio.gather(*(tokens_of(r) for r in requests))
    with pytest.raises(ValueError, match="prompt is empty"):
      await loop.submit([Request([], 2)]).wait_accepted()
    sub = loop.submit([Request([4, 5], 400)])
    events = sub.__aiter__()
    first = await events.__anext__()
    sub.cancel()
    later = [e async for batch in events for e in batch]
    assert len(first) + len(later) < 400
    with pytest.raises(RuntimeError, match="made in an event loop's thread"):
      sub.accepted()
    return got

  try:
    assert asyncio.run(main()) == expected
    sub = loop.submit([Request([1], 2)])
    with pytest.raises(RuntimeError, match="made outside an event loop"):
      asyncio.run(sub.wait_accepted())
    assert len(collect(sub)[sub.accepted()[0], 0]) == 2
  finally:
    loop.close()


def test_engine_process_serves_as_the_thread_loop(served):
  """The engine built in a process of its own (the server's way): the same tokens as the
  thread loop's engine on the same weights; errors cross the pipe; a process that dies
  fails what is unfinished."""
  _, loop, _ = served
  argv = ["--model", "tiny", "--dtype", "float32", "--max-batch", "8", "--num-pages", "160",
          "--page-size", "16", "--steps-per-call", "4", "--no-compilation-cache"]
  refs = ["models.gpt2:FAMILY"]
  args = openai_server.parse_args(argv, openai_server.resolve_families(refs))
  with pytest.raises(RuntimeError, match="could not be built: --checkpoint /no/dir: not a"):
    EngineProcess(functools.partial(openai_server.build_engine, openai_server.parse_args(
        argv + ["--checkpoint", "/no/dir"], openai_server.resolve_families(refs)), refs))
  process = EngineProcess(functools.partial(openai_server.build_engine, args, refs))
  try:
    assert process.spec == loop.engine.spec and process.max_batch == 8
    requests = [Request([5, 6, 7], 9), Request([8, 9], 6, temperature=1.0, seed=3, n=2,
                                                  logprobs=True, top_logprobs=2)]

    def tokens(sub) -> dict:  # (request's index, sample) -> its tokens
      ids = sub.accepted()
      return {(ids.index(rid), j): [e.token for e in events]
              for (rid, j), events in collect(sub).items()}
    got, want = (tokens(p.submit(requests)) for p in (process, loop))
    assert got == want and [len(got[k]) for k in sorted(got)] == [9, 6, 6]
    # The engine's stats cross with its events: the first run's, idle after it.
    assert process.stats == (0, 0, 0, 0, 160, 5, 0, 21, 0, 0, 0, 0, "", "")
    # Guides cross by reference: sent once, forgotten beyond the process's limit.
    guides = [Guide.from_regex(r"[a-c]{3}\d", Vocabulary.of_bytes()),
              Guide.from_choices(["yes", "no"], Vocabulary.of_bytes())]
    guided = [Request([5, 6], 8, temperature=1.0, seed=i, guide=guides[i % 2])
              for i in range(4)]
    with unittest.mock.patch.object(engine_loop, "MAX_PROCESS_GUIDES", 1):
      for batch, held in ((guided, 2), (guided[:1], 1), (guided, 2)):
        got, want = (tokens(p.submit(batch)) for p in (process, loop))
        assert got == want and len(process._guides) == held
    assert {bytes(got[i, 0]).decode() for i in (1, 3)} <= {"yes", "no"}
    with pytest.raises(ValueError, match=r"^requests\[1\]: prompt is empty"):
      process.submit([Request([1], 2), Request([], 2)]).accepted()
    sub = process.submit([Request([4, 5], 400)])
    next(iter(sub))
    process._process.kill()
    with pytest.raises(EngineClosed, match="process ended"):
      list(sub)
    with pytest.raises(EngineClosed):
      process.submit([Request([1], 2)])
  finally:
    process.close()
  # Closed with a request running: it fails with the engine's EngineClosed.
  process = EngineProcess(functools.partial(openai_server.build_engine, args, refs))
  sub = process.submit([Request([4, 5], 400)])
  next(iter(sub))
  process.close()
  with pytest.raises(EngineClosed, match="^the engine loop was closed$"):
    list(sub)


def test_completions_are_the_engines_requests(served):
  """Each field reaches the engine's request: the choices are what the same requests
  give submitted to the loop directly (prompt-major, n per prompt)."""
  url, loop, _ = served
  body = {"model": "tiny", "prompt": ["The pages", [84, 104, 101, 32]], "max_tokens": 7,
          "n": 2, "temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 2 ** 40 + 11,
          "presence_penalty": 0.5, "logit_bias": {"101": 2.0}, "logprobs": 2,
          "min_tokens": 2, "repetition_penalty": 1.2, "min_p": 0.01}
  status, answer = post(url, body)
  assert status == 200, answer
  prompts = [list(b"The pages"), [84, 104, 101, 32]]
  requests = [Request(p, 7, temperature=0.8, top_p=0.9, top_k=40, seed=11, n=2,
                      presence_penalty=0.5, logit_bias={101: 2.0}, logprobs=True,
                      top_logprobs=2, min_tokens=2, repetition_penalty=1.2, min_p=0.01)
              for p in prompts]
  sub = loop.submit(requests)
  ids = sub.accepted()
  events = collect(sub)
  assert answer["object"] == "text_completion" and answer["model"] == "tiny"
  assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
  for c in answer["choices"]:
    want = events[ids[c["index"] // 2], c["index"] % 2]
    assert c["text"] == BYTES.decode([e.token for e in want])
    assert c["finish_reason"] == "length"
    lp = c["logprobs"]
    assert lp["tokens"] == [BYTES.decode([e.token]) for e in want]
    np.testing.assert_allclose(lp["token_logprobs"], [e.logprob for e in want], rtol=1e-6)
    for top, e in zip(lp["top_logprobs"], want):  # (texts as keys: last one wins)
      assert top == pytest.approx({BYTES.decode([t]): v for t, v in e.top_logprobs}, rel=1e-6)
    assert lp["text_offset"] == list(range(7))
  assert answer["usage"] == {"prompt_tokens": 13, "completion_tokens": 28,
                             "total_tokens": 41}
  # Without a seed each request draws its own.
  again = [post(url, dict(body, seed=None))[1]["choices"][0]["text"] for _ in range(2)]
  assert again[0] != again[1]


def test_streams_stop_texts_and_stop_tokens(served):
  url, loop, _ = served
  prompt = "Paged attention"

  def engine_tokens(**fields) -> list[int]:
    sub = loop.submit([Request(list(prompt.encode()), 24, **fields)])
    return [e.token for events in sub for e in events]

  greedy = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
  tokens = engine_tokens()
  text = BYTES.decode(tokens)
  status, whole = post(url, greedy)
  assert status == 200 and whole["choices"][0]["text"] == text
  # Streamed: the chunks add up to the same text; usage last, then [DONE].
  status, chunks = post(url, dict(greedy, stream=True, stream_options={"include_usage": True}))
  assert status == 200 and chunks[-1] == "[DONE]"
  objects = [json.loads(c) for c in chunks[:-1]]
  assert len(objects) > 2  # (4 steps per call)
  assert "".join(c["choices"][0]["text"] for c in objects[:-1]) == text
  assert [c["choices"][0]["finish_reason"] for c in objects[:-1]][-1] == "length"
  assert objects[-1]["choices"] == [] and objects[-1]["usage"]["completion_tokens"] == 24
  assert all(o["usage"] is None for o in objects[:-1])
  # Token ids (vLLM's return_token_ids): each chunk's, the prompt's on the first.
  status, chunks = post(url, dict(greedy, stream=True, return_token_ids=True))
  objects = [json.loads(c)["choices"][0] for c in chunks[:-1]]
  assert sum((o["token_ids"] for o in objects), []) == tokens
  assert objects[0]["prompt_token_ids"] == list(prompt.encode())
  assert all("prompt_token_ids" not in o for o in objects[1:])
  status, whole = post(url, dict(greedy, return_token_ids=True))
  assert whole["choices"][0]["token_ids"] == tokens
  # A stop text: the text before it, streamed or not; finish_reason "stop".
  at = next(k for k in range(9, 20) if "\ufffd" not in text[k:k + 3])
  stop = text[at:at + 3]
  cut = text[:text.find(stop)]
  stopped = engine_tokens(stop=[stop, "never there"])
  assert len(stopped) < 24
  status, answer = post(url, dict(greedy, stop=[stop, "never there"]))
  assert answer["choices"][0] == {"index": 0, "text": cut, "logprobs": None,
                                  "finish_reason": "stop"}
  assert answer["usage"]["completion_tokens"] == len(stopped)
  status, chunks = post(url, dict(greedy, stop=stop, stream=True))
  objects = [json.loads(c) for c in chunks[:-1]]
  assert "".join(o["choices"][0]["text"] for o in objects) == cut
  assert objects[-1]["choices"][0]["finish_reason"] == "stop"
  # A stop token: its text left out, the token counted.
  end = tokens.index(tokens[5])
  status, answer = post(url, dict(greedy, stop_token_ids=[tokens[5]]))
  assert answer["choices"][0]["text"] == BYTES.decode(tokens[:end])
  assert answer["choices"][0]["finish_reason"] == "stop"
  assert answer["usage"]["completion_tokens"] == end + 1


def test_echo_and_scoring_the_prompt(served):
  """max_tokens 0 with echo and logprobs: the prompt's log-probabilities (as
  lm-evaluation-harness asks), equal to the engine's prompt_logprobs."""
  url, loop, _ = served
  prompt = "Scored text"
  status, answer = post(url, {"prompt": prompt, "max_tokens": 0, "echo": True,
                              "logprobs": 1})
  assert status == 200, answer
  choice, = answer["choices"]
  assert choice["text"] == prompt and choice["finish_reason"] == "length"
  sub = loop.submit([Request(list(prompt.encode()), 1, prompt_logprobs=True,
                             top_logprobs=1)])
  first = next(iter(sub))[0]
  lp = choice["logprobs"]
  assert lp["tokens"] == list(prompt) and lp["text_offset"] == list(range(len(prompt)))
  assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
  np.testing.assert_allclose(lp["token_logprobs"][1:], first.prompt_logprobs[1:], rtol=1e-6)
  assert answer["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 0,
                             "total_tokens": len(prompt)}
  # echo with tokens: the prompt's text, then the completion.
  status, answer = post(url, {"prompt": prompt, "max_tokens": 3, "echo": True,
                              "temperature": 0})
  status, plain = post(url, {"prompt": prompt, "max_tokens": 3, "temperature": 0})
  assert answer["choices"][0]["text"] == prompt + plain["choices"][0]["text"]


def test_chat_completions_render_the_template(served):
  """A chat completion is the completion of the rendered conversation: the same tokens
  and log-probabilities, as an assistant message (streamed: deltas)."""
  url, _, _ = served
  messages = [{"role": "system", "content": "Be brief. "},
              {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                           {"type": "text", "text": "there"}]}]
  rendered = "<s>[system] Be brief.\n[user] Hi there\n[assistant] "
  body = {"messages": messages, "temperature": 0, "max_completion_tokens": 6,
          "logprobs": True, "top_logprobs": 2}
  status, chat = post(url, body, "/v1/chat/completions")
  assert status == 200, chat
  status, plain = post(url, {"prompt": rendered, "temperature": 0, "max_tokens": 6,
                             "logprobs": 2})
  assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
  choice, want = chat["choices"][0], plain["choices"][0]
  assert choice["message"] == {"role": "assistant", "content": want["text"]}
  assert choice["finish_reason"] == "length"
  content = choice["logprobs"]["content"]
  assert [c["token"] for c in content] == want["logprobs"]["tokens"]
  np.testing.assert_allclose([c["logprob"] for c in content],
                             want["logprobs"]["token_logprobs"], rtol=1e-6)
  assert all(len(c["top_logprobs"]) == 2 and c["bytes"] == list(c["token"].encode())
             for c in content)
  assert chat["usage"] == dict(plain["usage"], prompt_tokens=len(rendered.encode()),
                               total_tokens=len(rendered.encode()) + 6)
  # Streamed: the role with the first delta, the content in pieces.
  status, chunks = post(url, dict(body, stream=True, logprobs=False, top_logprobs=None),
                        "/v1/chat/completions")
  objects = [json.loads(c) for c in chunks[:-1]]
  assert all(o["object"] == "chat.completion.chunk" for o in objects)
  deltas = [o["choices"][0]["delta"] for o in objects]
  assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
  assert "".join(d["content"] for d in deltas) == want["text"]
  assert objects[-1]["choices"][0]["finish_reason"] == "length"
  # No generation prompt: the conversation as it is.
  status, chat = post(url, dict(body, add_generation_prompt=False, logprobs=False,
                                top_logprobs=None), "/v1/chat/completions")
  assert chat["usage"]["prompt_tokens"] == len(rendered.encode()) - len("[assistant] ")


@pytest.mark.parametrize("body,param,message", [
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "a role in"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages",
     "only text parts"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "no tools here"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "needs logprobs true"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "prompt",
     "unknown fields"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 600},
     "max_tokens", "context holds 512"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": ["x"]},
     "chat_template_kwargs", "must be an object"),
    ({"messages": [{"role": "user", "content": "x"}],
      "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs",
     "(not messages, tools, add_generation_prompt, which are fields of their own)"),
])
def test_bad_chat_requests_are_named(served, body, param, message):
  url, _, _ = served
  status, answer = post(url, body, "/v1/chat/completions")
  assert status == 400 and answer["error"]["param"] == param
  assert message in answer["error"]["message"], answer


def test_chat_template_of_a_checkpoint_renders_and_tokenizes_as_transformers(tmp_path):
  """A checkpoint's template (tokenizer_config.json) and special tokens: the same text and
  token ids as transformers' apply_chat_template; a model without one refuses chat."""
  tokenizers = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  bpe = tokenizers.ByteLevelBPETokenizer()
  bpe.train_from_iterator(["the paged cache holds the pages of every sequence"] * 20,
                          vocab_size=300, min_frequency=1)
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
  hf.add_special_tokens({"bos_token": "<|begin|>", "eos_token": "<|eot|>",
                         "additional_special_tokens": ["<|head|>", "<|end_head|>"]})
  hf.chat_template = """{{ bos_token }}
{% for m in messages %}
  {% if loop.first and m['role'] != 'system' %}
<|head|>system<|end_head|>{{ {'turns': messages | length} | tojson }}<|eot|>
  {% endif %}
<|head|>{{ m['role'] }}<|end_head|>

{{ m['content'] | trim }}<|eot|>
{% endfor %}
{% if add_generation_prompt %}
<|head|>assistant<|end_head|>

{% endif %}"""
  hf.save_pretrained(tmp_path)
  messages = [{"role": "user", "content": "the pages "}, {"role": "assistant",
              "content": "every sequence"}, {"role": "user", "content": "the cache"}]
  template = openai_server.read_chat_template(None, str(tmp_path))
  text = template.render(messages)
  assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  codec = load_tokenizer(str(tmp_path))
  assert codec.encode(text, add_special_tokens=False) == hf.apply_chat_template(
      messages, tokenize=True, add_generation_prompt=True, return_dict=False)
  spec = gpt2.FAMILY.presets["tiny"](jnp.float32, 0).spec
  with pytest.raises(openai_server.APIError, match="no chat template"):
    openai_server.parse_chat({"messages": messages}, Served("m", spec, codec, ()), None)
  # /tokenize and /detokenize with this tokenizer: transformers' ids and texts.
  served = Served("m", spec, codec, (), template)
  ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=False,
                               return_dict=False)
  got = openai_server.tokenize({"messages": messages, "add_generation_prompt": False,
                                "return_token_strs": True}, served)
  assert got == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                 "token_strs": [hf.decode([t]) for t in ids]}
  assert openai_server.tokenize({"prompt": "the paged cache"}, served)["tokens"] == hf(
      "the paged cache").input_ids
  assert openai_server.detokenize({"tokens": ids}, served) == {"prompt": hf.decode(ids)}


@pytest.mark.parametrize("body,status,param,message", [
    ({"prompt": "x", "bogus": 1}, 400, "bogus", "unknown fields ['bogus']"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    ({"prompt": "x", "priority": 1}, 400, "priority", "--scheduling-policy priority"),
    ({"prompt": "x", "priority": 0.5}, 400, "priority", "an integer"),
    ({"prompt": ""}, 400, "prompt", "prompt[0] is empty"),
    ({"prompt": [1, "a"]}, 400, "prompt", "prompt must be"),
    ({"prompt": [[300]]}, 400, "prompt", "outside [0, vocab_size=256)"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens", ">= 0"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "with echo"),
    ({"prompt": "x" * 500, "max_tokens": 20}, 400, "max_tokens", "context holds 512"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature", ">= 0"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature", ">= 0"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p", "in (0, 1]"),
    ({"prompt": "x", "n": 0}, 400, "n", ">= 1"),
    ({"prompt": "x", "n": 2, "best_of": 3}, 400, "best_of", "equal n"),
    ({"prompt": "x", "logprobs": 99}, 400, "logprobs", "in [0, 20]"),
    ({"prompt": "x", "stop": [""]}, 400, "stop", "non-empty"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias", "token ids"),
    ({"prompt": "x", "logit_bias": {"5": 200}}, 400, "logit_bias", "[-100, 100]"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "with stream true"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix", "not supported"),
    ({"prompt": "x", "seed": 1.5}, 400, "seed", "integer"),
    ({"prompt": "x", "min_tokens": 20}, 400, "min_tokens", "exceeds max_tokens 16"),
    ({"prompt": "x", "n": 9}, 400, None, "max_batch=8"),  # the engine's own check
    ([1, 2], 400, None, "JSON object"),
])
def test_bad_requests_are_named(served, body, status, param, message):
  url, loop, _ = served
  got, answer = post(url, body)
  assert got == status and answer["error"]["param"] == param
  assert message in answer["error"]["message"], answer
  assert loop.num_unfinished == 0


# Values of every JSON type, in and out of each field's range, for random bodies.
FUZZ_VALUES = [None, True, False, 0, 1, -1, 2, 3.5, -0.5, 1e30, float("nan"), "", "x", "auto",
               "none", "required", [], [1], [1, 2], ["a"], [[1]], [[]], [None], [300], {},
               {"a": 1}, {"1": 5}, {"1": 1000}, {"type": "function"}, {"include_usage": True},
               [{"role": "user", "content": "hi"}], 2 ** 40, -2 ** 40]


def test_random_bodies_are_parsed_or_refused_by_name(model):
  """The bad-input sweep of the parsers: random bodies (fields from each endpoint's list,
  values of every type, nested at random) either parse or raise the server's APIError
  (answered 4xx); nothing else escapes (a 500)."""
  served = Served("tiny", model.spec, BYTES, (0,), ChatTemplate(TEMPLATE),
                  openai_server.TOOL_PARSERS["hermes"], prioritizes=True)
  rng = random.Random(0)

  def value(depth=0):
    if depth < 2 and rng.random() < 0.2:
      return [value(depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 2 and rng.random() < 0.1:
      return {rng.choice(["role", "content", "type", "function", "name", "arguments",
                          "tool_calls"]): value(depth + 1)}
    return rng.choice(FUZZ_VALUES)

  endpoints = [
      (openai_server.parse_completion, openai_server.COMPLETION_FIELDS, "prompt", "hello"),
      (openai_server.parse_chat, openai_server.CHAT_FIELDS, "messages",
       [{"role": "user", "content": "hi"}]),
      (lambda b, s, r: openai_server.tokenize(b, s), openai_server.TOKENIZE_FIELDS, "prompt",
       "hello"),
      (lambda b, s, r: openai_server.detokenize(b, s), openai_server.DETOKENIZE_FIELDS,
       "tokens", [1, 2])]
  parsed = 0
  for parse, fields, key, good in endpoints:
    for _ in range(600):
      body = {f: value() for f in rng.sample(fields, rng.randint(0, min(6, len(fields))))}
      if rng.random() < 0.7:
        body[key] = good
      try:
        out = parse(body, served, random.Random(0))
      except openai_server.APIError as e:
        assert 400 <= e.status < 500 and e.message
        continue
      parsed += 1
      if isinstance(out, openai_server.Completion):  # the engine's checks: pass or name it
        try:
          validate_requests(out.requests, served.spec, page_size=16, max_pages=32,
                            max_batch=8, detokenizes=True, prioritizes=True)
        except ValueError as e:
          assert re.match(r"request \d+: ", str(e))
  assert parsed > 100  # (the sweep also reaches bodies that parse)


def test_routes_and_malformed_bodies(served):
  url, _, _ = served
  with urllib.request.urlopen(url + "/v1/models") as r:
    models = json.load(r)
  assert [m["id"] for m in models["data"]] == ["tiny"]
  assert models["data"][0]["max_model_len"] == 512
  with urllib.request.urlopen(url + "/health") as r:
    assert r.status == 200
  assert post(url, b"{not json")[0] == 400
  assert post(url, {"prompt": "x"}, path="/v1/embeddings")[0] == 404


# Tools in the system turn, an assistant's calls and the tools' answers (Qwen2.5's way;
# its content tested, as Qwen2.5's is: transformers 5.17 renders a None content "None",
# 5.24 "", and the server passes "").
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}]


def test_tools_render_as_transformers_renders_them(model):
  """The tools and the conversation's calls (their arguments as objects, as vLLM passes
  them) reach the template as transformers' apply_chat_template gives them."""
  transformers = pytest.importorskip("transformers")
  tokenizers = pytest.importorskip("tokenizers")
  bpe = tokenizers.ByteLevelBPETokenizer()
  bpe.train_from_iterator(["the weather in paris"] * 5, vocab_size=270, min_frequency=1)
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
  hf.chat_template = TOOLS_TEMPLATE
  as_objects = [dict(m, tool_calls=[dict(c, function=dict(
      c["function"], arguments=json.loads(c["function"]["arguments"])))
      for c in m["tool_calls"]]) if "tool_calls" in m else m for m in CONVERSATION]
  want = hf.apply_chat_template(as_objects, tools=[WEATHER], tokenize=False,
                                add_generation_prompt=True)
  served = Served("tiny", model.spec, BYTES, (), ChatTemplate(TOOLS_TEMPLATE),
                  openai_server.TOOL_PARSERS["hermes"])
  completion = openai_server.parse_chat({"messages": CONVERSATION, "tools": [WEATHER]},
                                        served, random.Random(0))
  assert bytes(completion.prompts[0]).decode() == want
  assert '"arguments": {"city": "Paris"}' in want
  # tool_choice "none": the tools stay out of the prompt, and no calls are read.
  completion = openai_server.parse_chat({"messages": CONVERSATION[:1], "tools": [WEATHER],
                                         "tool_choice": "none"}, served, random.Random(0))
  assert completion.tool_parser is None
  assert bytes(completion.prompts[0]).decode() == hf.apply_chat_template(
      CONVERSATION[:1], tokenize=False, add_generation_prompt=True)


def _events(text: str, reason: str = "stop") -> list[TokenEvent]:
  """A choice's events for the UTF-8 bytes of `text`, then an eos token (0)."""
  tokens = list(text.encode()) + [0]
  return [TokenEvent(7, t, reason if i == len(tokens) - 1 else None)
          for i, t in enumerate(tokens)]


@pytest.mark.parametrize("parser,answer,content,calls", [
    ("hermes", 'I will look.<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}'
               '\n</tool_call>', "I will look.", [("weather", '{"city": "Paris"}')]),
    ("hermes", "No calls: <tool_ is not one", "No calls: <tool_ is not one", []),
    ("hermes", "<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
    ("llama3_json", '{"name": "weather", "parameters": {"city": "Paris"}}', None,
     [("weather", '{"city": "Paris"}')]),
    ("llama3_json", "Sunny.", "Sunny.", [])])
@pytest.mark.parametrize("parallel", [True, False])
def test_tool_calls_in_answers_whole_and_streamed(model, parser, answer, content, calls,
                                                  parallel):
  """An answer's calls become OpenAI's tool_calls (finish_reason "tool_calls"), its text
  the content; streamed, no delta holds a call's text, and the calls come whole, once.
  Without parallel calls only the first is kept."""
  if calls and not parallel:
    answer += '\n<tool_call>{"name": "time", "arguments": {}}</tool_call>' if (
        parser == "hermes") else '; {"name": "time", "parameters": {}}'
  served = Served("tiny", model.spec, BYTES, (0,), ChatTemplate(TOOLS_TEMPLATE),
                  openai_server.TOOL_PARSERS[parser])
  body = {"messages": CONVERSATION[:1], "tools": [WEATHER], "parallel_tool_calls": parallel}
  events = _events(answer)
  answer_of = lambda: openai_server.Answer(openai_server.parse_chat(
      dict(body), served, random.Random(0)), served)
  whole = answer_of()
  whole.take(events, [7])
  message = whole.whole()["choices"][0]["message"]
  got = [(c["function"]["name"], c["function"]["arguments"])
         for c in message.get("tool_calls", [])]
  assert got == calls and message["content"] == content
  assert whole.whole()["choices"][0]["finish_reason"] == ("tool_calls" if calls else "stop")
  streamed = answer_of()
  deltas = []
  for i in range(0, len(events), 5):
    chunk = streamed.chunk(streamed.take(events[i:i + 5], [7]))
    deltas += [c["delta"] for c in chunk["choices"]] if chunk else []
  text = "".join(d.get("content") or "" for d in deltas)
  assert text == (content or "")
  streamed_calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
  assert len(streamed_calls) == (1 if calls else 0)
  if calls:
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"])
            for c in streamed_calls[0]] == [(i, *c) for i, c in enumerate(calls)]
    ids = [c["id"] for c in streamed_calls[0] + message["tool_calls"]]
    assert len(set(ids)) == len(ids) and all(i.startswith("call-chatcmpl-") for i in ids)
  assert chunk["choices"][0]["finish_reason"] == ("tool_calls" if calls else "stop")


# Qwen3's switch in the template's dialect: an empty think block when thinking is off.
THINKING_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                     "{% endfor %}[assistant] {% if enable_thinking is defined and "
                     "not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")


def test_chat_template_kwargs_reach_the_template(model):
  """A request's chat_template_kwargs are the template's variables (vLLM's field), in a
  chat completion and in /tokenize."""
  served = Served("tiny", model.spec, BYTES, (), ChatTemplate(THINKING_TEMPLATE))
  body = {"messages": [{"role": "user", "content": "Hi"}]}
  prompt = lambda extra: bytes(openai_server.parse_chat(
      dict(body, **extra), served, random.Random(0)).prompts[0]).decode()
  assert prompt({}) == "[user] Hi\n[assistant] "
  assert prompt({"chat_template_kwargs": {"enable_thinking": False}}) == (
      "[user] Hi\n[assistant] <think>\n\n</think>\n\n")
  ids = openai_server.tokenize(dict(body, chat_template_kwargs={"enable_thinking": False}),
                               served)["tokens"]
  assert bytes(ids).decode().endswith("</think>\n\n")


@pytest.mark.parametrize("parser,answer,reasoning,content", [
    ("deepseek_r1", "Paris is in France.</think>\n\nParis.", "Paris is in France.",
     "\n\nParis."),
    ("deepseek_r1", "<think>\nHmm.</think>Paris.", "\nHmm.", "Paris."),
    ("deepseek_r1", "Still thinking when cut", "Still thinking when cut", None),
    ("qwen3", "<think>\nHmm.</think>\n\nParis.", "\nHmm.", "\n\nParis."),
    ("qwen3", "Paris, without thinking.", None, "Paris, without thinking."),
    ("qwen3", "<thin is not the tag", None, "<thin is not the tag"),
    ("qwen3", "<think>cut mid-thought", "cut mid-thought", None)])
def test_reasoning_apart_from_content_whole_and_streamed(model, parser, answer, reasoning,
                                                         content):
  """With a reasoning parser a chat answer's thinking is message.reasoning_content (its
  tags in neither part) and the rest its content; streamed, the deltas' reasoning_content
  and content add up to them, no delta holding a tag, whole or in part."""
  served = Served("tiny", model.spec, BYTES, (0,), ChatTemplate(THINKING_TEMPLATE),
                  reasoning_parser=openai_server.REASONING_PARSERS[parser])
  body = {"messages": [{"role": "user", "content": "Where is Paris?"}]}
  answer_of = lambda what: openai_server.Answer(openai_server.parse_chat(
      dict(body), what, random.Random(0)), what)
  whole = answer_of(served)
  whole.take(_events(answer), [7])
  message = whole.whole()["choices"][0]["message"]
  assert message == {"role": "assistant", "content": content, "reasoning_content": reasoning}
  streamed = answer_of(served)
  events = _events(answer)
  deltas = []
  for i in range(0, len(events), 3):
    chunk = streamed.chunk(streamed.take(events[i:i + 3], [7]))
    deltas += [c["delta"] for c in chunk["choices"]] if chunk else []
  assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
  assert "".join(d.get("content", "") for d in deltas) == (content or "")
  if reasoning is not None:
    assert not any("<" in d.get("reasoning_content", "") + d.get("content", "")
                   for d in deltas)
  # Without a parser the thinking stays in the content, as before.
  plain = answer_of(dataclasses.replace(served, reasoning_parser=None))
  plain.take(_events(answer), [7])
  assert plain.whole()["choices"][0]["message"] == {"role": "assistant", "content": answer}


def test_tool_calls_are_read_after_the_reasoning(model):
  """A chat answer that thinks, then calls: the call from the content (a call written in
  the thinking is not one); --reasoning-parser reaches what is served."""
  call = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
  served = Served("tiny", model.spec, BYTES, (0,), ChatTemplate(TOOLS_TEMPLATE),
                  openai_server.TOOL_PARSERS["hermes"],
                  reasoning_parser=openai_server.REASONING_PARSERS["qwen3"])
  answer = openai_server.Answer(openai_server.parse_chat(
      {"messages": CONVERSATION[:1], "tools": [WEATHER]}, served, random.Random(0)), served)
  answer.take(_events(f"<think>Maybe {call}?</think>\n{call}"), [7])
  choice = answer.whole()["choices"][0]
  assert choice["message"]["reasoning_content"] == f"Maybe {call}?"
  assert choice["message"]["content"] == "\n" and choice["finish_reason"] == "tool_calls"
  assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["weather"]
  args = openai_server.parse_args(["--model", "tiny", "--reasoning-parser", "deepseek_r1"],
                                  openai_server.resolve_families(["models.gpt2:FAMILY"]))
  assert openai_server.served_of(args, model.spec, BYTES, None).reasoning_parser is (
      openai_server.REASONING_PARSERS["deepseek_r1"])


@pytest.mark.parametrize("fields,param,message", [
    ({"tools": [WEATHER]}, "tool_choice", "--tool-call-parser"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "anything"}, "tool_choice", "named function"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "naming one of the tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "letters"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools", "non-empty list"),
    ({"tools": []}, "tools", "non-empty list"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {
        "name": "f", "arguments": "{bad"}}]}]}, "messages", "JSON text of an object"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages",
     "an assistant's")])
def test_bad_tool_requests_are_named(served, fields, param, message):
  url, _, _ = served
  status, answer = post(url, dict({"messages": [{"role": "user", "content": "x"}],
                                   "max_tokens": 2}, **fields), "/v1/chat/completions")
  assert status == 400 and answer["error"]["param"] == param
  assert message in answer["error"]["message"], answer


def test_priority_reaches_the_engine_under_the_priority_policy(model):
  served = Served("tiny", model.spec, BYTES, (), prioritizes=True)
  completion = openai_server.parse_completion({"prompt": ["x", "y"], "priority": -3}, served,
                                              random.Random(0))
  assert [r.priority for r in completion.requests] == [-3, -3]
  args = openai_server.parse_args(["--model", "tiny", "--num-pages", "64",
                                   "--no-compilation-cache", "--scheduling-policy", "priority"],
                                  openai_server.resolve_families(["models.gpt2:FAMILY"]))
  assert openai_server.build_engine(args, ["models.gpt2:FAMILY"]).scheduling_policy == (
      "priority")


def test_lora_adapters_are_models_of_their_own_names(model, tmp_path):
  """`model` names an adapter (vLLM's way): its completion is the engine's under that
  adapter; /v1/models lists it with the base as its parent."""
  from jax_paged import lora  # pylint: disable=import-outside-toplevel
  lora.LoraAdapter.random(model.lora_targets(), rank=4, seed=1, scale=0.5).save(
      tmp_path / "sql")
  engine = Engine(model, max_batch=8, num_pages=160, page_size=16, steps_per_call=4,
                  detokenize=BYTES.decode, max_loras=1, max_lora_rank=4)
  engine.add_lora("sql", str(tmp_path / "sql"))
  want = {name: engine.generate([Request(list(b"select"), 6, lora=name)])[0][0]
          for name in ("sql", None)}
  assert want["sql"] != want[None]
  loop = EngineLoop(engine)
  server = OpenAIServer(("127.0.0.1", 0), loop, Served("tiny", model.spec, BYTES, (),
                                                       loras=("sql",)))
  threading.Thread(target=server.serve_forever, daemon=True).start()
  url = f"http://127.0.0.1:{server.server_address[1]}"
  try:
    for name in ("sql", "tiny"):
      status, answer = post(url, {"model": name, "prompt": "select", "max_tokens": 6,
                                  "temperature": 0, "return_token_ids": True})
      assert status == 200 and answer["model"] == name
      assert answer["choices"][0]["token_ids"] == want["sql" if name == "sql" else None]
    status, answer = post(url, {"model": "nope", "prompt": "x"})
    assert status == 404 and "this server serves 'tiny', 'sql'" in answer["error"]["message"]
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
      models = json.loads(r.read())["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), ("sql", "tiny")]
    with urllib.request.urlopen(url + "/v1/models/sql", timeout=30) as r:
      assert json.loads(r.read())["id"] == "sql"
    with pytest.raises(urllib.error.HTTPError, match="404"):
      urllib.request.urlopen(url + "/v1/models/nope", timeout=30)
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
      assert re.search(r'lora_requests_info\{model_name="tiny",running_lora_adapters="",'
                       r'waiting_lora_adapters="",max_lora="1"\} \d', r.read().decode())
    status, answer = post(url, {"lora_name": "x", "lora_path": str(tmp_path / "sql")},
                          "/v1/load_lora_adapter")
    assert status == 403 and "--allow-lora-updates" in answer["error"]["message"]
  finally:
    server.shutdown()
    server.server_close()
    loop.close()


@pytest.mark.parametrize("in_process", [False, True])
def test_lora_adapters_load_and_unload_at_runtime(model, tmp_path, in_process):
  """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: the engine (on a thread,
  or in its own process) registers and drops adapters between device calls, the names
  become models and stop being ones; bad updates are refused by name."""
  from jax_paged import lora  # pylint: disable=import-outside-toplevel
  for i, name in enumerate(("sql", "big")):
    lora.LoraAdapter.random(model.lora_targets(), rank=4 * (i + 1), seed=i).save(
        tmp_path / name)
  if in_process:
    loop = EngineProcess(functools.partial(
        Engine, gpt2.FAMILY.presets["tiny"](jnp.float32, 0), max_batch=4, num_pages=64,
        max_loras=1, max_lora_rank=4))
  else:
    loop = EngineLoop(Engine(model, max_batch=4, num_pages=64, max_loras=1, max_lora_rank=4))
  server = OpenAIServer(("127.0.0.1", 0), loop, Served("tiny", model.spec, BYTES, (),
                                                       lora_updates=True))
  threading.Thread(target=server.serve_forever, daemon=True).start()
  url = f"http://127.0.0.1:{server.server_address[1]}"
  completion = {"model": "sql", "prompt": "select", "max_tokens": 4}
  try:
    assert post(url, completion)[0] == 404
    status, answer = post(url, {"lora_name": "sql", "lora_path": str(tmp_path / "sql")},
                          "/v1/load_lora_adapter")
    assert status == 200 and [m["id"] for m in answer["data"]] == ["sql"]
    status, answer = post(url, completion)
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
    for body, path, code, message in (
        ({"lora_name": "big", "lora_path": str(tmp_path / "big")}, "/v1/load_lora_adapter",
         400, "has rank 8, above the engine's max_lora_rank=4"),
        ({"lora_name": "x", "lora_path": str(tmp_path)}, "/v1/load_lora_adapter", 400,
         "no adapter_config.json in"),
        ({"lora_name": "tiny", "lora_path": "p"}, "/v1/load_lora_adapter", 400,
         "the served model's name"),
        ({"lora_name": "sql", "path": "p"}, "/v1/load_lora_adapter", 400,
         "unknown fields ['path']"),
        ({"lora_name": "nope"}, "/v1/unload_lora_adapter", 404,
         "no LoRA adapter named 'nope'")):
      status, answer = post(url, body, path)
      assert status == code and message in answer["error"]["message"], answer
    status, answer = post(url, {"lora_name": "sql"}, "/v1/unload_lora_adapter")
    assert status == 200 and answer["data"] == []
    assert post(url, completion)[0] == 404
  finally:
    server.shutdown()
    server.server_close()
    loop.close()


def test_allow_lora_updates_gives_the_engine_slots():
  """--allow-lora-updates without --lora-modules: one slot (--max-loras more), updates on."""
  families = ["models.gpt2:FAMILY"]
  for extra, slots in (((), 1), (("--max-loras", "3"), 3)):
    args = openai_server.parse_args(["--model", "tiny", "--num-pages", "64",
                                     "--no-compilation-cache", "--allow-lora-updates",
                                     *extra], openai_server.resolve_families(families))
    assert openai_server.build_engine(args, families).adapters.max_loras == slots
    served = openai_server.served_of(args, gpt2.FAMILY.presets["tiny"](jnp.float32, 0).spec,
                                     BYTES, None)
    assert served.lora_updates and served.loras == []


def test_warmup_kinds_reach_the_engine(monkeypatch):
  """--warmup: the sampling kinds, and guided (alone: with greedy batches)."""
  calls = []
  monkeypatch.setattr(Engine, "warmup", lambda self, **kw: calls.append(kw))
  refs = ["models.gpt2:FAMILY"]
  for kinds in (["guided", "top_p"], ["guided"], ["greedy"]):
    args = openai_server.parse_args(["--model", "tiny", "--num-pages", "64",
                                     "--no-compilation-cache", "--warmup", *kinds],
                                    openai_server.resolve_families(refs))
    openai_server.build_engine(args, refs)
  assert calls == [dict(sampling=["top_p"], guided=True), dict(sampling=["greedy"], guided=True),
                   dict(sampling=["greedy"], guided=False)]


@pytest.mark.parametrize("kind", ["byte_level_bpe", "sentencepiece_bpe", "bytes"])
def test_streamed_text_is_the_whole_decode_whatever_the_chunks(model, tmp_path, kind):
  """Streamed text, decoded a few tokens at a time, is the whole answer's decode: with a
  byte-level BPE (characters split over tokens), a SentencePiece-style one (a token's
  leading space depends on what precedes it) and bytes; no chunk holds half a character."""
  tokenizers = pytest.importorskip("tokenizers")
  text = ("The paged cache h\u00e9berge les pages: \u6f22\u5b57 \U0001f600 ok. " * 3 +
          "Caf\u00e9 \u00fcber na\u00efve r\u00e9sum\u00e9 \U0001f680\U0001f680.")
  if kind == "bytes":
    codec = BYTES
  else:
    bpe = (tokenizers.ByteLevelBPETokenizer() if kind == "byte_level_bpe"
           else tokenizers.SentencePieceBPETokenizer())
    bpe.train_from_iterator([text] * 10, vocab_size=200, min_frequency=1)
    bpe.save(str(tmp_path / "tokenizer.json"))
    codec = load_tokenizer(str(tmp_path))
  ids = codec.encode(text, add_special_tokens=False)
  spec = dataclasses.replace(model.spec, vocab_size=max(256, codec.vocab_size),
                             max_positions=4096)
  served = Served("tiny", spec, codec, ())
  rng = np.random.default_rng(len(ids))
  for _ in range(3):
    answer = openai_server.Answer(openai_server.parse_completion(
        {"prompt": [1], "max_tokens": len(ids), "stream": True}, served, random.Random(0)),
        served)
    events = [TokenEvent(0, t, "length" if i == len(ids) - 1 else None)
              for i, t in enumerate(ids)]
    streamed, i = [], 0
    while i < len(events):
      k = int(rng.integers(1, 8))
      chunk = answer.chunk(answer.take(events[i:i + k], [0]))
      streamed += [chunk["choices"][0]["text"]] if chunk else []
      i += k
    assert "".join(streamed) == codec.decode(ids) == answer.whole()["choices"][0]["text"]
    assert not any("\ufffd" in t for t in streamed)
  assert codec.decode(ids) == text  # (the tokenizers round-trip it)


def test_guided_choice_answers_the_most_likely_text(served):
  """guided_choice: greedy, the text the model scores highest (checked against the same
  texts scored through echo); sampled, texts drawn by the seed; chat and streamed too;
  bad combinations refused."""
  url, _, _ = served
  texts = ["yes", "no", "maybe so", "n"]
  prompt = "Is the cache paged? Answer:"
  totals = []
  for text in texts:
    _, scored = post(url, {"prompt": prompt + text, "max_tokens": 0, "echo": True,
                           "logprobs": 0})
    totals.append(sum(scored["choices"][0]["logprobs"]["token_logprobs"][-len(text):]))
  best = texts[int(np.argmax(totals))]
  status, answer = post(url, {"prompt": [prompt, prompt], "guided_choice": texts,
                              "temperature": 0, "n": 2})
  assert status == 200 and [c["text"] for c in answer["choices"]] == [best] * 4
  assert [c["finish_reason"] for c in answer["choices"]] == ["stop"] * 4
  assert answer["usage"]["completion_tokens"] == 4 * len(best)
  sampled = [post(url, {"prompt": prompt, "guided_choice": texts, "temperature": 5.0,
                        "n": 16, "seed": seed})[1] for seed in (1, 1, 2)]
  drawn = [[c["text"] for c in s["choices"]] for s in sampled]
  assert drawn[0] == drawn[1] != drawn[2] and set(drawn[0]) <= set(texts)
  assert len(set(drawn[0] + drawn[2])) > 1  # (flattened by the temperature)
  status, chat = post(url, {"messages": [{"role": "user", "content": "paged?"}],
                            "guided_choice": ["yes", "no"], "temperature": 0},
                      "/v1/chat/completions")
  assert status == 200 and chat["choices"][0]["message"]["content"] in ("yes", "no")
  status, chunks = post(url, {"prompt": prompt, "guided_choice": texts, "temperature": 0,
                              "stream": True, "stream_options": {"include_usage": True}})
  assert status == 200 and chunks[-1] == "[DONE]"
  assert json.loads(chunks[0])["choices"][0]["text"] == best
  assert json.loads(chunks[1])["usage"]["completion_tokens"] == len(best)
  # (a stream in chunked transfer, like the others: the connection serves the next one)
  host, port = url[len("http://"):].split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=60)
  for _ in range(2):
    conn.request("POST", "/v1/completions", json.dumps(
        {"prompt": prompt, "guided_choice": texts, "temperature": 0, "stream": True}),
        {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.getheader("Transfer-Encoding") == "chunked"
    assert response.read().endswith(b"data: [DONE]\n\n")
  conn.close()
  for body, param in [({"guided_choice": []}, "guided_choice"),
                      ({"guided_choice": ["a", ""]}, "guided_choice"),
                      ({"guided_choice": ["a"], "logprobs": 2}, "logprobs"),
                      ({"guided_choice": ["a"], "echo": True}, "echo"),
                      ({"guided_choice": ["a"], "stop": ["x"]}, "stop")]:
    status, answer = post(url, dict({"prompt": prompt}, **body))
    assert status == 400 and answer["error"]["param"] == param, body


def test_tokenize_and_detokenize(served):
  """vLLM's /tokenize (a text, or chat messages as a chat completion renders them) and
  /detokenize; bad bodies named."""
  url, _, _ = served
  status, got = post(url, {"prompt": "h\u00e9llo", "return_token_strs": True}, "/tokenize")
  assert status == 200 and got == {"count": 6, "max_model_len": 512,
                                   "tokens": list("h\u00e9llo".encode()),
                                   "token_strs": ["h", "\ufffd", "\ufffd", "l", "l", "o"]}
  assert post(url, {"tokens": got["tokens"]}, "/detokenize") == (200, {"prompt": "h\u00e9llo"})
  messages = [{"role": "user", "content": "hi"}]
  status, got = post(url, {"messages": messages}, "/tokenize")
  assert got["tokens"] == list(b"<s>[user] hi\n[assistant] ") and got["token_strs"] is None
  status, chat = post(url, {"messages": messages, "max_tokens": 1},
                      "/v1/chat/completions")
  assert chat["usage"]["prompt_tokens"] == got["count"]
  status, got = post(url, {"messages": messages, "add_generation_prompt": False}, "/tokenize")
  assert got["tokens"] == list(b"<s>[user] hi\n")
  for path, body, param in [
      ("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
      ("/tokenize", {}, "prompt"),
      ("/tokenize", {"prompt": [1, 2]}, "prompt"),
      ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
      ("/tokenize", {"prompt": "x", "add_special_tokens": 1}, "add_special_tokens"),
      ("/tokenize", {"prompt": "x", "tokens": [1]}, "tokens"),
      ("/detokenize", {"tokens": [1, 256]}, "tokens"),
      ("/detokenize", {"tokens": "abc"}, "tokens"),
      ("/detokenize", {"tokens": [1], "model": "other"}, "model")]:
    status, answer = post(url, body, path)
    assert status in (400, 404) and answer["error"]["param"] == param, (path, body, answer)


def test_shutting_down_drains_the_requests_in_flight(model):
  """Shutting down (`server_close()` then `drain`): /health answers 503, new requests are
  refused, the one in flight is answered whole; a dead engine fails /health too. A body
  over the limit is refused unread."""
  loop = EngineLoop(make_engine(model))
  server = OpenAIServer(("127.0.0.1", 0), loop, Served("tiny", model.spec, BYTES, ()))
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  url = f"http://127.0.0.1:{server.server_address[1]}"
  host, port = server.server_address[:2]
  conn = http.client.HTTPConnection(host, port, timeout=60)
  conn.request("POST", "/v1/completions", "{}", {"Content-Length": str(65 << 20)})
  response = conn.getresponse()
  assert response.status == 413 and b"exceeds the server's 64 MiB" in response.read()
  conn.close()
  # A keep-alive connection kept open, to try a request while draining.
  idle = http.client.HTTPConnection(host, port, timeout=60)
  idle.request("GET", "/health")
  assert idle.getresponse().read() == b'{"status": "ok"}'
  answers = []
  running = threading.Thread(target=lambda: answers.append(post(url, {
      "prompt": "x", "max_tokens": 300, "ignore_eos": True})))
  running.start()
  while not server.requests_in_flight:
    time.sleep(0.01)
  server.shutdown()
  thread.join()
  server.server_close()
  drained = threading.Thread(target=server.drain, args=(60,))
  drained.start()
  idle.request("GET", "/health")
  health = idle.getresponse()
  assert health.status == 503 and json.loads(health.read()) == {"status": "draining"}
  idle.request("POST", "/v1/completions", json.dumps({"prompt": "x"}),
               {"Content-Type": "application/json"})
  refused = idle.getresponse()
  assert refused.status == 503 and b"shutting down" in refused.read()
  drained.join()
  running.join()
  status, answer = answers[0]
  assert status == 200 and answer["usage"]["completion_tokens"] == 300
  assert server.requests_in_flight == 0
  loop.close()
  assert not loop.alive
  # A server whose engine has stopped fails its health check.
  server = OpenAIServer(("127.0.0.1", 0), loop, Served("tiny", model.spec, BYTES, ()))
  threading.Thread(target=server.serve_forever, daemon=True).start()
  with pytest.raises(urllib.error.HTTPError) as e:
    urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/health")
  assert e.value.code == 503 and json.loads(e.value.read()) == {
      "status": "the engine has stopped"}
  server.shutdown()
  server.server_close()


def test_an_api_key_guards_every_route_but_health_and_metrics(model, monkeypatch):
  loop = EngineLoop(make_engine(model))
  server = OpenAIServer(("127.0.0.1", 0), loop, Served("tiny", model.spec, BYTES, ()),
                        api_key="s3cret")
  threading.Thread(target=server.serve_forever, daemon=True).start()
  url = f"http://127.0.0.1:{server.server_address[1]}"

  def get(path: str, key: str | None) -> int:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    try:
      with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers)) as r:
        return r.status
    except urllib.error.HTTPError as e:
      assert json.loads(e.read())["error"]["code"] == "invalid_api_key"
      return e.code
  try:
    assert get("/health", None) == 200 and get("/metrics", None) == 200
    assert get("/v1/models", None) == 401 and get("/v1/models", "wrong") == 401
    assert get("/v1/models", "s3cret") == 200
    host, port = url[len("http://"):].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    for key, status in [(None, 401), ("s3cret", 200)]:
      for path, body in [("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                         ("/tokenize", {"prompt": "x"})]:
        headers = {"Content-Type": "application/json"}
        if key:
          headers["Authorization"] = f"Bearer {key}"
        conn.request("POST", path, json.dumps(body), headers)
        response = conn.getresponse()
        assert response.status == status, (path, key)
        response.read()
        if status == 401:  # the unread body: the server closed the connection
          conn.close()
    conn.close()
  finally:
    server.shutdown()
    server.server_close()
    loop.close()
  # The command takes the key from the environment unless given.
  monkeypatch.setenv(openai_server.API_KEY_ENV, "from-env")
  families = openai_server.resolve_families(["models.gpt2:FAMILY"])
  assert openai_server.parse_args(["--model", "tiny"], families).api_key == "from-env"
  assert openai_server.parse_args(["--model", "tiny", "--api-key", "k"],
                                  families).api_key == "k"


def test_a_fault_of_the_server_is_a_500(served, monkeypatch, capsys):
  url, loop, _ = served

  def broken(*_):
    raise KeyError("a bug")
  monkeypatch.setattr(openai_server, "parse_completion", broken)
  status, answer = post(url, {"prompt": "x"})
  assert status == 500 and answer["error"]["message"] == "the server failed: KeyError: 'a bug'"
  assert "Traceback" in capsys.readouterr().err and loop.num_unfinished == 0


def test_a_client_that_goes_aborts_its_stream(served):
  url, loop, _ = served
  host, port = url[len("http://"):].split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=60)
  conn.request("POST", "/v1/completions", json.dumps(
      {"prompt": "a long one", "max_tokens": 480, "stream": True, "ignore_eos": True}),
      {"Content-Type": "application/json"})
  response = conn.getresponse()
  assert response.status == 200
  assert response.fp.readline()  # (the first chunk's size line)
  conn.sock.shutdown(2)
  conn.close()
  deadline = time.time() + 60
  while loop.num_unfinished and time.time() < deadline:
    time.sleep(0.05)
  assert loop.num_unfinished == 0
  assert loop.engine.report.generated_tokens < 480


def test_a_client_that_goes_aborts_its_completion(served):
  """Not streamed: noticed at the request's next device call."""
  url, loop, _ = served
  host, port = url[len("http://"):].split(":")
  before = loop.engine.stats().generated_tokens  # (the loop is idle: between tests)
  conn = http.client.HTTPConnection(host, int(port), timeout=60)
  conn.request("POST", "/v1/completions", json.dumps(
      {"prompt": "a long one", "max_tokens": 480, "ignore_eos": True}),
      {"Content-Type": "application/json"})
  deadline = time.time() + 60
  while loop.stats.generated_tokens == before and time.time() < deadline:
    time.sleep(0.01)  # (until its first tokens)
  conn.sock.shutdown(2)
  conn.close()
  while loop.num_unfinished and time.time() < deadline:
    time.sleep(0.05)
  assert loop.num_unfinished == 0
  assert 0 < loop.stats.generated_tokens - before < 480


def scrape(url: str) -> dict[str, float]:
  """GET /metrics as {sample name with labels but model_name: value}; checks the format:
  HELP and TYPE before each metric's samples, cumulative histogram buckets."""
  with urllib.request.urlopen(url + "/metrics") as r:
    assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = r.read().decode()
  samples, typed = {}, {}
  for line in text.splitlines():
    if line.startswith("# TYPE "):
      _, _, name, kind = line.split()
      typed[name] = kind
      continue
    if line.startswith("# HELP "):
      continue
    found = re.fullmatch(r'(jax_paged:\w+)\{model_name="tiny"(,[^}]*)?\} (\S+)', line)
    assert found, line
    name, labels, value = found.groups()
    assert re.sub(r"_(bucket|sum|count)$", "", name) in typed or name in typed, line
    samples[name + "{" + (labels or ",")[1:] + "}"] = float(value)
  for name in ("time_to_first_token_seconds", "time_per_output_token_seconds",
               "e2e_request_latency_seconds"):
    buckets = [v for k, v in samples.items() if k.startswith(f"jax_paged:{name}_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == samples[f"jax_paged:{name}_count{{}}"]
  return samples


def test_metrics_count_requests_tokens_and_the_engine(model):
  """GET /metrics: what clients got (requests, tokens, reasons, times, statuses) and the
  engine's load and prefix cache, on a server of its own."""
  loop = EngineLoop(make_engine(model))
  server = OpenAIServer(("127.0.0.1", 0), loop, Served("tiny", model.spec, BYTES, ()))
  threading.Thread(target=server.serve_forever, daemon=True).start()
  url = f"http://127.0.0.1:{server.server_address[1]}"
  try:
    zero = scrape(url)
    assert zero["jax_paged:num_requests_running{}"] == 0
    assert zero["jax_paged:generation_tokens_total{}"] == 0
    assert not any(k.startswith("jax_paged:http_responses_total") for k in zero)
    prompt = "the same prompt, long enough for three pages of 16 tokens"
    assert post(url, {"prompt": prompt, "max_tokens": 5, "n": 2, "temperature": 1.0,
                      "ignore_eos": True})[0] == 200
    status, chunks = post(url, {"prompt": prompt, "max_tokens": 3, "stream": True,
                                "ignore_eos": True})
    assert status == 200 and chunks[-1] == "[DONE]"
    assert post(url, {"prompt": "x", "max_tokens": -1})[0] == 400
    got = scrape(url)
    assert got["jax_paged:prompt_tokens_total{}"] == 2 * len(prompt.encode())
    assert got["jax_paged:generation_tokens_total{}"] == 2 * 5 + 3
    assert got['jax_paged:request_success_total{finished_reason="length"}'] == 3
    assert got['jax_paged:request_success_total{finished_reason="abort"}'] == 0
    assert got["jax_paged:time_to_first_token_seconds_count{}"] == 2
    assert got["jax_paged:e2e_request_latency_seconds_count{}"] == 2
    assert got["jax_paged:time_per_output_token_seconds_count{}"] == 2
    assert 0 < got["jax_paged:time_per_output_token_seconds_sum{}"] < got[
        "jax_paged:e2e_request_latency_seconds_sum{}"]
    assert 0 < got["jax_paged:time_to_first_token_seconds_sum{}"] < got[
        "jax_paged:e2e_request_latency_seconds_sum{}"]
    assert got['jax_paged:http_responses_total{status="200"}'] == 3  # (with the first GET)
    assert got['jax_paged:http_responses_total{status="400"}'] == 1
    # The engine's: idle again, its pages back; the second request's prompt hit the pages
    # the first cached.
    assert got["jax_paged:num_requests_running{}"] == 0
    assert got["jax_paged:num_requests_waiting{}"] == 0
    assert got["jax_paged:kv_cache_usage_perc{}"] == 0
    # (no speculation: no drafts; the counters exist for dashboards)
    assert got["jax_paged:spec_decode_num_draft_tokens_total{}"] == 0
    assert got["jax_paged:spec_decode_num_accepted_tokens_total{}"] == 0
    assert got["jax_paged:prefix_cache_queries_total{}"] == 2 * len(prompt.encode())
    assert got["jax_paged:prefix_cache_hits_total{}"] == (len(prompt.encode()) - 1) // 16 * 16
  finally:
    server.shutdown()
    server.server_close()
    loop.close()


@pytest.mark.skipif(not model_families(), reason="no model family is installed (the "
                    "jax_paged.models entry points come with `pip install -e .`)")
def test_serve_command(model, tmp_path):
  """`python -m jax_paged.openai_server` serves until SIGTERM, with a LoRA adapter of
  --lora-modules as a model of its own."""
  from jax_paged import lora  # pylint: disable=import-outside-toplevel
  lora.LoraAdapter.random(model.lora_targets(), rank=4, seed=1, scale=0.5).save(
      tmp_path / "sql")
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(
      [sys.executable, "-m", "jax_paged.openai_server", "--model", "tiny", "--port", "0",
       "--max-batch", "4", "--num-pages", "64", "--served-model-name", "tiny-test",
       "--lora-modules", f"sql={tmp_path / 'sql'}"],
      env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
  try:
    for line in proc.stderr:
      found = re.search(r"serving 'tiny-test' at (http://\S+)/v1", line)
      if found:
        break
    assert found, "the server did not start"
    for name in ("tiny-test", "sql"):
      status, answer = post(found.group(1), {"model": name, "prompt": "Hi", "max_tokens": 3})
      assert status == 200 and answer["usage"]["completion_tokens"] == 3
  finally:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "admin": {"type": "boolean"},
    "role": {"enum": ["dev", "ops", None]}}, "required": ["name", "admin"]}


def _stream_text(chunks: list[str], chat: bool = False) -> str:
  parts = [json.loads(c) for c in chunks if c != "[DONE]"]
  if chat:
    return "".join(p["choices"][0]["delta"].get("content") or "" for p in parts
                   if p["choices"])
  return "".join(p["choices"][0]["text"] for p in parts if p["choices"])


def test_structured_outputs_hold_every_answer(served):
  """response_format, guided_json / guided_regex and structured_outputs: each answer
  (greedy and sampled, streamed or not, completions and chat) is a match."""
  url, _, what = served
  jsonschema = pytest.importorskip("jsonschema")
  base = {"prompt": ["a person:", "who?"], "max_tokens": 80, "n": 2, "temperature": 1.0,
          "seed": 3}
  status, answer = post(url, dict(base, response_format={
      "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}))
  assert status == 200 and len(answer["choices"]) == 4
  for choice in answer["choices"]:
    assert choice["finish_reason"] == "stop"  # (done at the closing brace: no eos here)
    jsonschema.validate(json.loads(choice["text"]), PERSON)
  status, answer = post(url, dict(base, guided_regex=r"\d{3}-[a-z]{2,4}", temperature=0))
  for choice in answer["choices"]:
    assert re.fullmatch(r"\d{3}-[a-z]{2,4}", choice["text"]), choice
  status, answer = post(url, dict(base, structured_outputs={"choice": ["red", "green"]}))
  assert {c["text"] for c in answer["choices"]} <= {"red", "green"}
  # json_object: any object; a sample cut short by max_tokens is a prefix of one.
  guide = what.guides.json_schema(None)
  status, answer = post(url, dict(base, max_tokens=40, response_format={
      "type": "json_object"}))
  for choice in answer["choices"]:
    if choice["finish_reason"] == "stop":
      assert isinstance(json.loads(choice["text"]), dict)
    else:
      assert guide.walk(0, list(choice["text"].encode())) >= 0
  status, chunks = post(url, dict(base, guided_json=PERSON, stream=True, n=1, prompt="x"))
  jsonschema.validate(json.loads(_stream_text(chunks)), PERSON)
  status, answer = post(url, {"messages": [{"role": "user", "content": "json"}],
                              "max_tokens": 80, "response_format": {
                                  "type": "json_schema", "json_schema": {"schema": PERSON}}},
                        "/v1/chat/completions")
  jsonschema.validate(json.loads(answer["choices"][0]["message"]["content"]), PERSON)


@pytest.mark.parametrize("fields,param,message", [
    ({"response_format": {"type": "xml"}}, "response_format", "json_object"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"guided_regex": "(a)\\1"}, "guided_regex", "backreferences"),
    ({"guided_regex": 3}, "guided_regex", "a text"),
    ({"guided_json": {"type": "number", "maximum": 2.5}}, "guided_json", "maximum"),
    ({"guided_json": PERSON, "guided_regex": "a"}, "guided_regex", "give one"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "give one"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", "one of"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs", "wrong type"),
])
def test_bad_structured_outputs_are_named(served, fields, param, message):
  url, _, _ = served
  status, answer = post(url, dict({"prompt": "x", "max_tokens": 2}, **fields))
  assert status == 400 and answer["error"]["param"] == param
  assert message in answer["error"]["message"], answer


def test_a_guide_ends_on_the_eos_unless_it_is_ignored(model):
  """The eos ends a guided answer where its text is a whole match; with ignore_eos the
  guide never lets it be written (it would not end the answer)."""
  served = Served("tiny", model.spec, BYTES, (255,))
  for ignore, allowed in ((False, True), (True, False)):
    completion = openai_server.parse_completion(
        {"prompt": "x", "guided_regex": "[a-c]+", "ignore_eos": ignore}, served,
        random.Random(0))
    guide = completion.requests[0].guide
    state = guide.walk(0, list(b"ab"))
    assert guide.accepting[state] and (guide.table[state, 255] >= 0) == allowed
    assert guide.table[0, 255] < 0  # (no match yet)


def test_a_guide_needs_a_tokenizer(model):
  served = Served("tiny", model.spec, None, ())
  with pytest.raises(openai_server.APIError, match="guided_regex needs a tokenizer"):
    openai_server.parse_completion({"prompt": [1, 2], "guided_regex": "a"}, served,
                                   random.Random(0))


FORECAST = {"type": "function", "function": {
    "name": "forecast", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 4}, "metric": {"type": "boolean"}},
        "required": ["city", "metric"]}}}
TIME = {"type": "function", "function": {"name": "t", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "forecast"}}])
def test_tool_choice_required_and_named_are_guided_calls(model, choice):
  """tool_choice required / a named function: the answer is guided to calls of the
  tools (no --tool-call-parser needed), their arguments valid under the schemas. (A
  template that shows no tools: the tiny model's context is short.)"""
  jsonschema = pytest.importorskip("jsonschema")
  loop = EngineLoop(make_engine(model))
  server = OpenAIServer(("127.0.0.1", 0), loop,
                        Served("tiny", model.spec, BYTES, (), ChatTemplate(TEMPLATE)))
  threading.Thread(target=server.serve_forever, daemon=True).start()
  url = f"http://127.0.0.1:{server.server_address[1]}"
  body = {"messages": [{"role": "user", "content": "rain?"}], "tools": [TIME, FORECAST],
          "tool_choice": choice, "max_tokens": 100, "temperature": 1.0, "seed": 1, "n": 3,
          "parallel_tool_calls": False}
  try:
    status, answer = post(url, body, "/v1/chat/completions")
    assert status == 200, answer
    for c in answer["choices"]:
      calls = c["message"]["tool_calls"]
      assert c["finish_reason"] == "tool_calls" and len(calls) == 1, c
      assert not c["message"]["content"]
      name = calls[0]["function"]["name"]
      assert name in ("t", "forecast") if choice == "required" else name == "forecast"
      schema = (FORECAST if name == "forecast" else TIME)["function"]["parameters"]
      jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schema)
    status, chunks = post(url, dict(body, stream=True, n=1), "/v1/chat/completions")
    deltas = [json.loads(c)["choices"][0]["delta"] for c in chunks
              if c != "[DONE]" and json.loads(c)["choices"]]
    calls = [call for d in deltas for call in d.get("tool_calls") or ()]
    assert len(calls) == 1 and not "".join(d.get("content") or "" for d in deltas)
  finally:
    server.shutdown()
    server.server_close()
    loop.close()
