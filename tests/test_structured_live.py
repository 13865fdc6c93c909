"""Structured output, tool calling, logit_bias and /tokenize against the real server
(subprocess, SmolLM2-135M-Instruct, CPU) with the official `openai` client: issue 18's
must-show 1 (parse, json_object, streamed schema, guided choice / regex), 2 (an agent loop
with tool_choice required and named, streaming and not) and 5 (fuzzed bad schemas, tool
definitions and tool_choice values get 400s naming the field; the server keeps serving)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from bucketserve.bench.launch import LiveServer, start_server

BUCKETS = "[kv_cache]\ncpu_memory_gib = 0.2\n"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current temperature of a city in Celsius.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    srv = start_server(tmp_path_factory.mktemp("structured"), "structured", BUCKETS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai_client("none")


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


class City(BaseModel):
    name: str = Field(max_length=16)
    country: str = Field(max_length=16)
    population: int = Field(ge=0, le=100_000_000)


def test_parse_with_a_pydantic_model(client, model):
    done = client.beta.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe Paris."}],
        response_format=City, max_tokens=100, temperature=0)
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(done.choices[0].message.parsed, City)


def test_json_object_is_valid_json(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give a JSON object with a person's name and age."}],
        response_format={"type": "json_object"}, max_tokens=100, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_streamed_json_schema_validates(client, model):
    schema = City.model_json_schema()
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A city in Japan, as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": schema, "strict": True}},
        max_tokens=100, temperature=0.7, seed=5, stream=True)
    text, finish = "", None
    for c in chunks:
        text += c.choices[0].delta.content or ""
        finish = c.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_guided_choice_regex_and_grammar_on_both_endpoints(client, model):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=10, temperature=0.8, seed=2, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=model, prompt="A phone number: ", max_tokens=20,
                                  temperature=0.8, seed=1,
                                  extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text)
    assert r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=model, prompt="The answer is", max_tokens=10,
                                  temperature=0,
                                  extra_body={"structured_outputs": {
                                      "grammar": 'root ::= "A" | "B" | "C"'}})
    assert r.choices[0].text in ("A", "B", "C")
    r = client.completions.create(model=model, prompt="Some JSON: ", max_tokens=60,
                                  temperature=0, extra_body={"response_format": {
                                      "type": "json_schema", "json_schema": {
                                          "name": "x", "schema": {"type": "object", "properties": {
                                              "n": {"type": "integer", "maximum": 999}},
                                              "required": ["n"]}}}})
    assert set(json.loads(r.choices[0].text)) == {"n"}


def test_logit_bias(server, client, model):
    eq = httpx.post(server.base_url + "/tokenize", json={"prompt": "="}).json()["tokens"]
    assert len(eq) == 1
    r = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0,
                                  logit_bias={str(eq[0]): 100})
    assert r.choices[0].text == "=" * 4


def test_tokenize_and_detokenize(server):
    http = httpx.Client(base_url=server.base_url, timeout=60)
    r = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}],
                                        "add_generation_prompt": True}).json()
    text = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n") and "Hi" in text
    assert http.post("/detokenize", json={"tokens": [10**8]}).status_code == 400


def _agent(client, model, tool_choice, stream: bool) -> str:
    """Model calls a tool, the client answers with role "tool", the model replies."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    args = dict(model=model, tools=[WEATHER, TIME], max_tokens=60, temperature=0)
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for c in client.chat.completions.create(messages=messages, tool_choice=tool_choice,
                                                stream=True, **args):
            ch = c.choices[0]
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                cur = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                cur["name"] += d.function.name or ""
                cur["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls" and calls
        tool_calls = [{"id": c["id"], "type": "function",
                       "function": {"name": c["name"], "arguments": c["arguments"]}}
                      for c in calls.values()]
    else:
        r = client.chat.completions.create(messages=messages, tool_choice=tool_choice, **args)
        assert r.choices[0].finish_reason == "tool_calls"
        tool_calls = [tc.model_dump() for tc in r.choices[0].message.tool_calls]
    for tc in tool_calls:
        assert tc["function"]["name"] in ("get_weather", "get_time")
        assert isinstance(json.loads(tc["function"]["arguments"])["city"], str)
    messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls})
    messages += [{"role": "tool", "tool_call_id": tc["id"], "content": "21 C"} for tc in tool_calls]
    final = client.chat.completions.create(messages=messages, **args)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert not final.choices[0].message.tool_calls or final.choices[0].finish_reason == "tool_calls"
    return tool_calls[0]["function"]["name"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_agent_loop_required_and_named(client, model, stream):
    _agent(client, model, "required", stream)
    named = {"type": "function", "function": {"name": "get_time"}}
    assert _agent(client, model, named, stream) == "get_time"


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"yaml": "x"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools"),
    ({"tools": "f"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
]


def _chat(http: httpx.Client, extra: dict) -> httpx.Response:
    return http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra})


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_fields_are_400s_naming_the_field(server, extra, param):
    http = httpx.Client(base_url=server.base_url, timeout=60)
    r = _chat(http, extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                           max_size=3),
                     max_leaves=8)
_FIELDS = ["response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
           "structured_outputs", "tools", "tool_choice", "parallel_tool_calls", "logit_bias"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(_FIELDS), value=_json)
def test_fuzzed_fields_are_refused_or_served(server, field, value):
    """Any JSON value in a structured-output / tool field: a 400 naming that field, or (a
    value that happens to be valid) a served reply; never a 5xx, and the server goes on."""
    http = httpx.Client(base_url=server.base_url, timeout=120)
    r = _chat(http, {field: value})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"] == field
    assert http.get("/health").status_code == 200
