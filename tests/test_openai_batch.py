"""`jax-paged-batch`: a file of OpenAI requests answered as the server answers them, in
order, on CPU with the tiny GPT-2 (random weights, text as UTF-8 bytes)."""

import json

import jax.numpy as jnp
import pytest

from jax_paged import Engine
from jax_paged import openai_batch
from jax_paged.cli import BYTES
from jax_paged.openai_server import ChatTemplate, Served
from models import gpt2

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def model():
  return gpt2.FAMILY.presets["tiny"](jnp.float32, 0)


def make_engine(model) -> Engine:
  return Engine(model, max_batch=8, num_pages=160, page_size=16, steps_per_call=4,
                detokenize=BYTES.decode)


def request(custom_id, body, url="/v1/completions"):
  return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_a_batch_is_answered_in_order_as_each_request_alone(model):
  served = Served("tiny", model.spec, BYTES, (), ChatTemplate(TEMPLATE))
  bodies = {
      "sampled": {"prompt": "hello", "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2,
                  "ignore_eos": True},
      "two prompts": {"prompt": ["ab", [5, 6, 7]], "max_tokens": 4, "temperature": 0},
      "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
               "temperature": 0},
      "choice": {"prompt": "Is it paged?", "guided_choice": ["yes", "no", "a little"],
                 "temperature": 0},
      "json": {"prompt": "a pet:", "max_tokens": 60, "temperature": 1.0, "seed": 2,
               "response_format": {"type": "json_schema", "json_schema": {"schema": {
                   "type": "object", "properties": {"name": {"enum": ["rex", "tom"]},
                                                    "age": {"type": "integer", "minimum": 0,
                                                            "maximum": 30}},
                   "required": ["name", "age"]}}}},
  }
  lines = [request("sampled", bodies["sampled"]),
           request("bad value", {"prompt": "x", "max_tokens": -1}),
           "{not json",
           request("two prompts", bodies["two prompts"]),
           json.dumps({"custom_id": "wrong url", "method": "POST", "url": "/v1/embeddings",
                       "body": {}}),
           request("streamed", {"prompt": "x", "stream": True}),
           request("too many samples", {"prompt": "x", "n": 9, "temperature": 1.0}),
           request("chat", bodies["chat"], "/v1/chat/completions"),
           request("choice", bodies["choice"]), request("json", bodies["json"])]
  outputs = openai_batch.run_batch(make_engine(model), served, lines, seed=0)
  assert [o["custom_id"] for o in outputs] == [
      "sampled", "bad value", None, "two prompts", "wrong url", "streamed",
      "too many samples", "chat", "choice", "json"]
  assert len({o["id"] for o in outputs}) == len(outputs)
  status = [o["response"] and o["response"]["status_code"] for o in outputs]
  assert status == [200, 400, None, 200, None, 400, 400, 200, 200, 200]
  assert outputs[1]["response"]["body"]["error"]["param"] == "max_tokens"
  assert outputs[2]["error"]["code"] == "invalid_json"
  assert outputs[4]["error"]["code"] == "invalid_request"
  assert outputs[5]["response"]["body"]["error"]["param"] == "stream"
  assert "max_batch=8" in outputs[6]["response"]["body"]["error"]["message"]
  # Each answer is the server's for that body alone (its own engine, its own run).
  for line, key in [(0, "sampled"), (3, "two prompts"), (7, "chat"), (8, "choice"),
                    (9, "json")]:
    url = "/v1/chat/completions" if key == "chat" else "/v1/completions"
    alone = openai_batch.run_batch(make_engine(model), served, [request(key, bodies[key],
                                                                        url)], seed=0)
    got, want = outputs[line]["response"]["body"], alone[0]["response"]["body"]
    assert [c.get("text", c.get("message")) for c in got["choices"]] == [
        c.get("text", c.get("message")) for c in want["choices"]]
    assert got["usage"] == want["usage"]
  assert [c["index"] for c in outputs[3]["response"]["body"]["choices"]] == [0, 1]
  assert outputs[8]["response"]["body"]["choices"][0]["text"] in bodies["choice"][
      "guided_choice"]
  assert outputs[0]["response"]["body"]["usage"]["completion_tokens"] == 12
  pet = json.loads(outputs[9]["response"]["body"]["choices"][0]["text"])  # (guided)
  assert pet["name"] in ("rex", "tom") and 0 <= pet["age"] <= 30


def test_the_command_writes_a_line_per_request(model, tmp_path, capsys):
  """Requests of the base model and of a LoRA adapter of --lora-modules (its name as the
  model), and one refused."""
  from jax_paged import lora  # pylint: disable=import-outside-toplevel
  lora.LoraAdapter.random(model.lora_targets(), rank=4, seed=1).save(tmp_path / "sql")
  source, sink = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  source.write_text("\n".join([request(f"q{i}", {"prompt": "abc" * (i + 1), "max_tokens": 3,
                                                 "temperature": 0,
                                                 "model": "sql" if i % 2 else "tiny"})
                               for i in range(5)]
                              + ["", request("bad", {"prompt": ""})]) + "\n")
  code = openai_batch.main(["--model", "tiny", "--max-batch", "4", "--num-pages", "64",
                            "--no-compilation-cache", "-i", str(source), "-o", str(sink),
                            "--lora-modules", f"sql={tmp_path / 'sql'}"],
                           family_refs=["models.gpt2:FAMILY"])
  assert code == 0
  outputs = [json.loads(line) for line in sink.read_text().splitlines()]
  assert [o["custom_id"] for o in outputs] == ["q0", "q1", "q2", "q3", "q4", "bad"]
  assert [o["response"]["status_code"] for o in outputs] == [200] * 5 + [400]
  assert [o["response"]["body"]["model"] for o in outputs[:5]] == ["tiny", "sql"] * 2 + [
      "tiny"]
  assert all(o["response"]["body"]["usage"]["completion_tokens"] == 3 for o in outputs[:5])
  assert "6 requests in" in capsys.readouterr().err
  assert openai_batch.main(["--model", "tiny", "-i", str(tmp_path / "none.jsonl"), "-o",
                            str(sink)], family_refs=["models.gpt2:FAMILY"]) == 2
