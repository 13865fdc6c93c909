"""Tool calling in chat: checking `tools` / `tool_choice`, rendering, constraining, parsing.

- `tools` ([{"type": "function", "function": {"name", "description", "parameters"}}]) are
  checked (name, a parameters schema xgrammar can build): 400s name `tools`; `tool_choice`
  ("auto", "none", "required", {"type": "function", "function": {"name"}}) and
  `parallel_tool_calls` likewise. The legacy `functions` / `function_call` are refused.
- Rendering: a chat template that mentions `tools` gets them (and the messages' `tool_calls`,
  `tool` role, `tool_call_id`) as HF templates expect. Otherwise (the default SmolLM2 template)
  the DEFAULT TOOL TEMPLATE applies: the tool list and Hermes-style call instructions go into
  the system message; an assistant's earlier calls are written as `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` after its content; a `tool` message becomes a user turn
  `<tool_response>...</tool_response>` (the result of the call `tool_call_id`).
- "required" and a named choice constrain the output with a JSON schema: an array of
  {"name", "arguments"} objects (one item with parallel_tool_calls false or a named choice;
  `name` fixed to the named function), parsed into `tool_calls`; finish_reason "tool_calls".
- "auto": free text, parsed afterwards (`parse_tool_calls`): Hermes `<tool_call>{...}</tool_call>`
  blocks, or Llama-3.x JSON (the reply starts with {"name", "parameters" | "arguments"}
  objects, joined by ";", optionally after `<|python_tag|>`), calling a declared tool; the
  text around the calls is the message's content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from bucketserve.engine.sequence import GuidedDecoding
from bucketserve.server.errors import invalid_request
from bucketserve.server.structured import MAX_SPEC_CHARS, check_built

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOOLS = 128
_EMPTY_PARAMS: dict = {"type": "object", "properties": {}}


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass
class ToolPlan:
    """What a chat request does with tools: None choice = no tools at all."""

    tools: list[Tool]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")


def _tool(i: int, t: Any) -> Tool:
    p = "tools"
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise invalid_request(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', p)
    f = t["function"]
    name = f.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid_request(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' "
                              "or '-'", p)
    desc = f.get("description", "")
    if not isinstance(desc, str):
        raise invalid_request(f"tools[{i}].function.description must be a string", p)
    params = f.get("parameters", _EMPTY_PARAMS)
    if params is None:
        params = _EMPTY_PARAMS
    if not isinstance(params, dict):
        raise invalid_request(f"tools[{i}].function.parameters must be a JSON schema object", p)
    if len(json.dumps(params)) > MAX_SPEC_CHARS:
        raise invalid_request(f"tools[{i}].function.parameters is longer than "
                              f"{MAX_SPEC_CHARS} characters", p)
    check_built(GuidedDecoding("json", json.dumps(params)), p)
    return Tool(name, desc, params)


def tool_plan(req: Any) -> ToolPlan:
    """Checks tools, tool_choice, parallel_tool_calls, functions, function_call (400 naming
    the field) -> the plan."""
    if req.functions is not None:
        raise invalid_request("functions is deprecated and not supported; send tools", "functions")
    if req.function_call is not None:
        raise invalid_request("function_call is deprecated and not supported; send tool_choice",
                              "function_call")
    raw = req.tools
    if raw is not None and not isinstance(raw, list):
        raise invalid_request("tools must be a list of tool definitions", "tools")
    raw = raw or []
    if len(raw) > MAX_TOOLS:
        raise invalid_request(f"tools accepts at most {MAX_TOOLS} tools", "tools")
    tools = [_tool(i, t) for i, t in enumerate(raw)]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid_request("tools: two tools have the same name", "tools")
    pc = req.parallel_tool_calls
    if pc is not None and not isinstance(pc, bool):
        raise invalid_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    parallel = pc is not False
    tc = req.tool_choice
    p = "tool_choice"
    if tc is None:
        return ToolPlan(tools, "auto" if tools else "none", parallel=parallel)
    if isinstance(tc, str):
        if tc not in ("none", "auto", "required"):
            raise invalid_request(f"tool_choice {tc!r} is not one of none, auto, required or a "
                                  "named function", p)
        if tc != "none" and not tools:
            raise invalid_request(f"tool_choice {tc!r} needs tools", p)
        return ToolPlan(tools, tc, parallel=parallel)
    fn = tc.get("function") if isinstance(tc, dict) and tc.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise invalid_request('tool_choice must be "none", "auto", "required" or {"type": '
                              '"function", "function": {"name": ...}}', p)
    if name not in names:
        raise invalid_request(f"tool_choice names {name!r}, which is not in tools", p)
    return ToolPlan(tools, "named", named=name, parallel=parallel)


def calls_schema(plan: ToolPlan) -> GuidedDecoding:
    """The JSON schema a "required" / named reply must match: an array of calls."""
    chosen = [t for t in plan.tools if plan.choice != "named" or t.name == plan.named]
    items = [{"type": "object", "properties": {"name": {"const": t.name},
                                               "arguments": t.parameters},
              "required": ["name", "arguments"]} for t in chosen]
    schema: dict = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                    "minItems": 1}
    if not plan.parallel or plan.choice == "named":
        schema["maxItems"] = 1
    return GuidedDecoding("json", json.dumps(schema))


# ---- rendering ---------------------------------------------------------------------------

def template_takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def _default_tools_text(tools: list[Tool]) -> str:
    lines = "\n".join(json.dumps({"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.parameters}})
        for t in tools)
    return ("You can call functions. Their signatures, one JSON object per line, are between "
            "<tools> and </tools>:\n<tools>\n" + lines + "\n</tools>\n"
            "To call a function, reply with one block per call, each holding a JSON object "
            "with the function's name and its arguments:\n"
            '<tool_call>\n{"name": "function name", "arguments": {"argument": "value"}}\n'
            "</tool_call>")


def _call_text(call: dict) -> str:
    f = call.get("function") or {}
    args = f.get("arguments", "{}")
    try:
        args_obj = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        args_obj = args
    return "<tool_call>\n" + json.dumps({"name": f.get("name"), "arguments": args_obj}) + \
        "\n</tool_call>"


def render_messages(messages: list[dict], plan: ToolPlan,
                    template: str | None) -> tuple[list[dict], dict]:
    """(messages, extra template kwargs). `messages`: dicts with role, content and, where
    sent, tool_calls / tool_call_id / name."""
    if template_takes_tools(template):
        kwargs = {}
        if plan.tools and plan.choice != "none":
            kwargs["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.parameters}}
                for t in plan.tools]
        return messages, kwargs
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            parts = [m["content"]] if m["content"] else []
            parts += [_call_text(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if plan.tools and plan.choice != "none":
        text = _default_tools_text(plan.tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, {}


# ---- parsing -----------------------------------------------------------------------------

def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def parse_constrained(text: str) -> list[dict]:
    """The calls of a "required" / named reply (the grammar made it a JSON array)."""
    return [tool_call(c["name"], c["arguments"]) for c in json.loads(text)]


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _as_call(obj: Any, names: set[str]) -> dict | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, (dict, str)):
        return None
    return tool_call(obj["name"], args)


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """An "auto" reply -> (content, calls): the text around the calls stays the content
    (None when empty). No call found, or a call-shaped block that is no call of a declared
    tool: (text, [])."""
    if "<tool_call>" in text:
        calls = []
        for body in _HERMES.findall(text):
            try:
                call = _as_call(json.loads(body), names)
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return _HERMES.sub("", text).strip() or None, calls
    body = text.lstrip().removeprefix("<|python_tag|>").lstrip()
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while body.startswith("{", pos):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            break
        call = _as_call(obj, names)
        if call is None:
            break
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    if not calls:
        return text, []
    return body[pos:].strip() or None, calls


def might_be_call(text: str) -> bool:
    """Whether an "auto" stream's text so far could start a tool call (held back then)."""
    s = text.lstrip()
    return (s.startswith("{") or "<tool_call>".startswith(s[:11]) and bool(s)
            or "<|python_tag|>".startswith(s[:14]) and bool(s) or "<tool_call>" in s)


class CallStreamer:
    """Incremental `delta.tool_calls` of a constrained reply (a JSON array of {"name", "arguments"}
    objects, keys in that order, compact): a call's header when its name is complete, then
    its arguments' text as it arrives."""

    _HEAD = re.compile(r'\{"name":"((?:[^"\\]|\\.)*)","arguments":')

    def __init__(self) -> None:
        self.buf = ""
        self.pos = 0  # parsed up to here
        self.index = -1  # current call
        self.in_args = False
        self.depth = 0
        self.in_str = False
        self.esc = False

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        deltas: list[dict] = []
        while True:
            if not self.in_args:
                m = self._HEAD.search(self.buf, self.pos)
                if m is None:
                    return deltas
                self.index += 1
                self.pos = m.end()
                self.in_args, self.depth, self.in_str, self.esc = True, 0, False, False
                deltas.append({"index": self.index, "id": new_call_id(), "type": "function",
                               "function": {"name": json.loads(f'"{m.group(1)}"'),
                                            "arguments": ""}})
            start, i = self.pos, self.pos
            end = None
            while i < len(self.buf):
                c = self.buf[i]
                if self.in_str:
                    if self.esc:
                        self.esc = False
                    elif c == "\\":
                        self.esc = True
                    elif c == '"':
                        self.in_str = False
                elif c == '"':
                    self.in_str = True
                elif c in "{[":
                    self.depth += 1
                elif c in "}]":
                    if self.depth == 0:  # the call object closes
                        end = i
                        break
                    self.depth -= 1
                i += 1
            stop = end if end is not None else i
            if stop > start:
                deltas.append({"index": self.index, "function": {"arguments": self.buf[start:stop]}})
            self.pos = stop
            if end is None:
                return deltas
            self.in_args = False
