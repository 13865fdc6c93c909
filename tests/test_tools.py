"""Tool calling pieces without a server (server/tools.py): parsing "auto" replies recorded
from the real model, constrained replies, the incremental call stream, the default tool
template, and the checks of tools / tool_choice."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bucketserve.server.errors import APIError
from bucketserve.server.tools import (
    CallStreamer,
    calls_schema,
    parse_constrained,
    parse_tool_calls,
    render_messages,
    tool_plan,
)

# Recorded by tests/data/record_tool_calls.py: SmolLM2-135M-Instruct (GGUF), greedy, CPU,
# this session; "primed" records start the assistant's reply with a call's first characters.
RECORDS = json.loads((Path(__file__).parent / "data" / "tool_call_outputs.json").read_text())
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}


def req(**kw):
    base = dict(tools=None, tool_choice=None, parallel_tool_calls=None, functions=None,
                function_call=None)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("rec", RECORDS["records"],
                         ids=[f"{r['format']}-{'primed' if r['primed'] else 'free'}-{i}"
                              for i, r in enumerate(RECORDS["records"])])
def test_auto_parses_recorded_model_output(rec):
    content, calls = parse_tool_calls(rec["output"], {"get_weather"})
    if not rec["primed"]:  # the small model answers in prose: no call may be invented
        assert calls == [] and content == rec["output"]
        return
    assert len(calls) == 1
    call = calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    city = json.loads(call["function"]["arguments"])["city"]
    assert city in rec["prompt"]
    assert "<tool_call>" not in (content or "") and "get_weather" not in (content or "")
    # the prose after the call stays the content; nothing of the call leaks into it
    assert (content or "") in rec["output"]


def test_auto_ignores_calls_of_undeclared_tools():
    text = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert parse_tool_calls(text, {"get_weather"}) == (text, [])
    text = '{"name": "other", "parameters": {}}'
    assert parse_tool_calls(text, {"get_weather"}) == (text, [])


def test_llama3_json_several_calls_and_python_tag():
    text = ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
            '{"name": "b", "arguments": {"y": "z"}}')
    content, calls = parse_tool_calls(text, {"a", "b"})
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("a", {"x": 1}), ("b", {"y": "z"})]


def test_constrained_reply_and_its_stream_agree():
    text = ('[{"name":"get_weather","arguments":{"city":"Pa\\"ris","n":[1,{"a":"}"}]}},'
            '{"name":"get_time","arguments":{}}]')
    calls = parse_constrained(text)
    streamer = CallStreamer()
    deltas = []
    for i in range(0, len(text), 3):  # pieces cut anywhere
        deltas += streamer.feed(text[i:i + 3])
    got: dict[int, dict] = {}
    for d in deltas:
        cur = got.setdefault(d["index"], {"name": "", "arguments": ""})
        cur["name"] += d["function"].get("name", "")
        cur["arguments"] += d["function"]["arguments"]
    assert [(g["name"], json.loads(g["arguments"])) for g in got.values()] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert sum(1 for d in deltas if "id" in d) == 2
    assert len(deltas) > 4  # arguments arrive in pieces


def test_calls_schema_required_named_parallel():
    two = [WEATHER, {"type": "function", "function": {"name": "get_time"}}]
    s = json.loads(calls_schema(tool_plan(req(tools=two, tool_choice="required"))).spec)
    assert s["minItems"] == 1 and "maxItems" not in s and len(s["items"]["anyOf"]) == 2
    s = json.loads(calls_schema(tool_plan(req(tools=two, tool_choice="required",
                                              parallel_tool_calls=False))).spec)
    assert s["maxItems"] == 1
    named = {"type": "function", "function": {"name": "get_time"}}
    s = json.loads(calls_schema(tool_plan(req(tools=two, tool_choice=named))).spec)
    assert s["maxItems"] == 1 and s["items"]["properties"]["name"] == {"const": "get_time"}


def test_default_template_renders_tools_calls_and_results():
    plan = tool_plan(req(tools=[WEATHER]))
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": "c1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]
    out, kwargs = render_messages(msgs, plan, template="{{ messages }}")
    assert kwargs == {}
    assert out[0]["content"].startswith("Be brief.") and '"get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content":
                      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                      "</tool_call>"}
    assert out[3] == {"role": "user", "content": "<tool_response>\n-3 C\n</tool_response>"}
    # a template that knows tools gets them and the messages as sent
    out, kwargs = render_messages(msgs, plan, template="{% if tools %}{{ tools }}{% endif %}")
    assert out == msgs and kwargs["tools"][0]["function"]["name"] == "get_weather"
    # tool_choice none: no tools rendered
    out, _ = render_messages(msgs[1:2], tool_plan(req(tools=[WEATHER], tool_choice="none")), "x")
    assert out == msgs[1:2]


@pytest.mark.parametrize(("kw", "param"), [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": 3}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"functions": []}, "functions"),
])
def test_bad_tool_fields_name_the_field(kw, param):
    with pytest.raises(APIError) as e:
        tool_plan(req(**kw))
    assert e.value.param == param and e.value.status == 400


def _stream(plan, pieces: list[str], finish: str = "stop") -> list[dict]:
    """The chat stream's choice deltas for a reply arriving in `pieces`."""
    from bucketserve.server.chat import _StreamFormatter

    ctx = SimpleNamespace(model_name="m")
    chat_req = SimpleNamespace(n=1, include_usage=False, logprobs=False)
    fmt = _StreamFormatter(ctx, chat_req, 3, "id", plan)
    out = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        o = SimpleNamespace(new_text=piece, new_logprobs=[], finished=last,
                            finish_reason=finish if last else None, num_output_tokens=1)
        out += [c["choices"][0] for c in fmt.on_output(0, o)]
    return out


def test_auto_stream_holds_a_call_back_and_sends_prose_at_once():
    plan = tool_plan(req(tools=[WEATHER]))
    rec = next(r for r in RECORDS["records"] if r["primed"] and r["format"] == "hermes")
    text = rec["output"]
    chunks = _stream(plan, [text[i:i + 5] for i in range(0, len(text), 5)])
    assert all(c["delta"] == {} or "tool_calls" in c["delta"] for c in chunks)
    last = chunks[-1]
    assert last["finish_reason"] == "tool_calls"
    assert last["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert last["delta"]["content"] == parse_tool_calls(text, {"get_weather"})[0]
    prose = _stream(plan, ["The weather", " is nice."])
    assert [c["delta"].get("content") for c in prose] == ["The weather", " is nice."]
    assert prose[-1]["finish_reason"] == "stop"


def test_required_stream_sends_calls_as_they_come():
    plan = tool_plan(req(tools=[WEATHER], tool_choice="required"))
    text = '[{"name":"get_weather","arguments":{"city":"Oslo"}}]'
    chunks = _stream(plan, [text[i:i + 4] for i in range(0, len(text), 4)])
    assert chunks[-1]["finish_reason"] == "tool_calls"
    args = "".join(d["function"]["arguments"] for c in chunks for d in c["delta"].get("tool_calls", []))
    assert json.loads(args) == {"city": "Oslo"}
