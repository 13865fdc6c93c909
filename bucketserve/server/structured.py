"""From the request's structured-output fields to one GuidedDecoding, checked up front.

Fields (any one of them per request; two at once is a 400 naming the second):
- `response_format`: {"type": "text"} (nothing), {"type": "json_object"}, {"type":
  "json_schema", "json_schema": {"name", "schema", "strict"}} (OpenAI);
- vLLM's `guided_json` (a schema, object or JSON text), `guided_regex`, `guided_choice` (a
  list of strings), `guided_grammar` (EBNF), and their newer form `structured_outputs`:
  {"json" | "regex" | "choice" | "grammar": ...};
- `guided_decoding_backend` may only name the server's backend ("xgrammar", or "llguidance"
  / vLLM's "guidance") or "auto"; `guided_whitespace_pattern` is refused (the grammar's
  whitespace is fixed: compact JSON).
Every grammar is built here, in the request path, by the library the engine will run it on
(engine/structured.check_guided: no tokenizer needed, milliseconds; the backend is the
core's, `set_backend` at the front end's start), so a spec it rejects is a 400 naming the
field before any token is generated; the engine compiles it again against the vocabulary
(cached).
"""

from __future__ import annotations

import json
from typing import Any

from bucketserve.engine.sequence import GuidedDecoding
from bucketserve.engine.structured import GrammarError, check_guided
from bucketserve.server.errors import invalid_request

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar longer than this is refused
_STRUCTURED_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_BACKEND = ["xgrammar"]  # the core's [structured] backend (set_backend)
_BACKEND_NAMES = {"xgrammar": ("xgrammar",), "llguidance": ("llguidance", "guidance")}


def set_backend(backend: str) -> None:
    """The grammar library the engine core runs ("xgrammar" or "llguidance"): the front
    end checks specs with it (ServerContext, from the core's info)."""
    _BACKEND[0] = backend if backend in _BACKEND_NAMES else "xgrammar"


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise invalid_request(f"{param} is not valid JSON: {exc}", param) from exc
    if not isinstance(value, dict):
        raise invalid_request(f"{param} must be a JSON schema object", param)
    return json.dumps(value)


def _spec(kind: str, value: Any, param: str) -> GuidedDecoding:
    if kind == "json":
        spec = _schema_text(value, param)
    elif kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise invalid_request(f"{param} must be a non-empty list of non-empty strings", param)
        spec = json.dumps(value)
    else:
        if not isinstance(value, str) or not value:
            raise invalid_request(f"{param} must be a non-empty string", param)
        spec = value
    if len(spec) > MAX_SPEC_CHARS:
        raise invalid_request(f"{param} is longer than {MAX_SPEC_CHARS} characters", param)
    return GuidedDecoding(kind, spec)


def _response_format(rf: Any) -> GuidedDecoding | None:
    p = "response_format"
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise invalid_request('response_format must be an object with a "type": "text", '
                              '"json_object" or "json_schema"', p)
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise invalid_request('response_format.json_schema must be an object with a '
                                  '"schema"', p)
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid_request("response_format.json_schema.strict must be a boolean", p)
        return _spec("json", js["schema"], p)
    raise invalid_request(f"response_format type {kind!r} is not supported; one of text, "
                          "json_object, json_schema", p)


def guided_decoding(req: Any) -> GuidedDecoding | None:
    """The request's one output constraint (None: free text); APIError 400 naming the field
    when a field is malformed, two are given, or xgrammar cannot build the grammar."""
    found: list[tuple[str, GuidedDecoding]] = []
    if req.response_format is not None:
        g = _response_format(req.response_format)
        if g is not None:
            found.append(("response_format", g))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", _spec(kind, value, f"guided_{kind}")))
    so = req.structured_outputs
    if so is not None:
        p = "structured_outputs"
        if not isinstance(so, dict):
            raise invalid_request("structured_outputs must be an object", p)
        unknown = sorted(set(so) - set(_STRUCTURED_KEYS))
        if unknown:
            raise invalid_request(f"structured_outputs.{unknown[0]} is not supported; use one "
                                  f"of {', '.join(_STRUCTURED_KEYS)}", p)
        found += [(p, _spec(k, v, p)) for k, v in so.items() if v is not None]
    if req.guided_decoding_backend not in (None, "auto", *_BACKEND_NAMES[_BACKEND[0]]):
        raise invalid_request(f"guided_decoding_backend: this server decodes with "
                              f"{_BACKEND[0]} only", "guided_decoding_backend")
    if req.guided_whitespace_pattern is not None:
        raise invalid_request("guided_whitespace_pattern is not supported: JSON output is "
                              "compact (no whitespace between tokens)", "guided_whitespace_pattern")
    if len(found) > 1:
        raise invalid_request(f"{found[1][0]} cannot be combined with {found[0][0]}: send one "
                              "output constraint", found[1][0])
    if not found:
        return None
    param, g = found[0]
    check_built(g, param)
    return g


def check_built(g: GuidedDecoding, param: str) -> None:
    try:
        check_guided(g, _BACKEND[0])
    except GrammarError as exc:
        raise invalid_request(f"{param}: the grammar cannot be built: {exc}", param) from exc
    except RecursionError as exc:
        raise invalid_request(f"{param}: the schema nests too deeply", param) from exc


def logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} -> {id: bias}; 400 naming logit_bias when a key is no
    token id of the vocabulary or a value is outside [-100, 100]."""
    if not raw:
        return None
    out: dict[int, float] = {}
    for key, value in raw.items():
        try:
            tid = int(key)
        except ValueError:
            tid = -1
        if not 0 <= tid < vocab_size or str(tid) != key.strip():
            raise invalid_request(f"logit_bias key {key!r} is not a token id in [0, {vocab_size})",
                                  "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise invalid_request(f"logit_bias value {value} for token {key} is outside "
                                  "[-100, 100]", "logit_bias")
        out[tid] = float(value)
    return out
