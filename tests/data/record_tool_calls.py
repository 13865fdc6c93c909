"""Records SmolLM2-135M-Instruct's replies to tool prompts (greedy, CPU) into
tests/data/tool_call_outputs.json, for test_tools.py's parsing of "auto" output.

Run: PYTHONPATH=$PWD python tests/data/record_tool_calls.py
Hermes format: the default tool template (server/tools.py) renders the tools; Llama-3.x JSON
format: a system prompt in Llama 3.1's JSON tool-calling style. This 135M model never starts
a call by itself (the "free" records), so each prompt is also run with the reply's first
characters written for it ("primed" records: the assistant turn starts with PRIMES[format]
and the model writes the rest); `output` is the primer plus the model's continuation.
"""

from __future__ import annotations

import json
from pathlib import Path

from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.sequence import SamplingParams
from bucketserve.server.tools import ToolPlan, _tool, render_messages

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
QUESTIONS = ["What is the weather in Paris?", "Is it raining in London right now?",
             "Tell me the weather in Tokyo."]
LLAMA3_SYSTEM = ("You have access to the function get_weather(city: string), which returns the "
                 "current weather of a city. To call it, respond only with JSON of the form "
                 '{"name": "get_weather", "parameters": {"city": "<city>"}} and nothing else.')


PRIMES = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"',
          "llama3_json": '{"name": "get_weather", "parameters": {"'}


def main() -> None:
    engine = LLMEngine.from_names()
    tok = engine.tokenizer
    plan = ToolPlan([_tool(0, t) for t in TOOLS], "auto")
    prompts, kinds = [], []
    for q in QUESTIONS:
        msgs, kw = render_messages([{"role": "user", "content": q}], plan, tok.chat_template)
        prompts.append(tok.apply_chat_template(msgs, **kw))
        kinds.append("hermes")
        prompts.append(tok.apply_chat_template([{"role": "system", "content": LLAMA3_SYSTEM},
                                                {"role": "user", "content": q}]))
        kinds.append("llama3_json")
    primes = [""] * len(prompts) + [PRIMES[k] for k in kinds]
    prompts, kinds = prompts * 2, kinds * 2
    outs = engine.generate([tok.encode(p + pr, add_special_tokens=False)
                            for p, pr in zip(prompts, primes, strict=True)],
                           SamplingParams(max_tokens=80, temperature=0))
    records = [{"format": k, "primed": bool(pr), "prompt": p + pr, "output": pr + o.text,
                "finish_reason": o.finish_reason}
               for k, p, pr, o in zip(kinds, prompts, primes, outs, strict=True)]
    path = Path(__file__).with_name("tool_call_outputs.json")
    path.write_text(json.dumps({"model": engine.model_name, "sampling": "greedy, max_tokens 80",
                                "records": records}, indent=1) + "\n")
    for r in records:
        print(r["format"], repr(r["output"]))


if __name__ == "__main__":
    main()
