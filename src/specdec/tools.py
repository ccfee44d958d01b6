"""OpenAI's `tools` and `tool_choice` as a grammar, and the answer read back as `tool_calls`.

The format (documented in docs/structured.md): a call is written
`<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`, the arguments valid against
the function's JSON schema. Where the model's chat template takes tools (it mentions
`tools`), they go to the template; otherwise a system message lists them and this format.

- `tool_choice` "required": one call of any of the tools (the grammar allows nothing else);
  a named function {"type": "function", "function": {"name": ...}}: one call of it;
- "auto" (the default with tools): either free text that does not start with "<", or one
  call; the first token decides, and the grammar holds a call to its schema;
- "none": no grammar (the tools are still described, as OpenAI does).
`<tool_call>` and the call's keys are forced tokens: no pass is spent on them.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from specdec.grammar import JSON_LAYOUT, Grammar, GrammarError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def check_tools(tools: Any, tool_choice: Any) -> tuple[list[dict[str, Any]], str | None]:
    """The tools' function definitions and the choice ("auto", "required", "none" or a
    function's name), checked; GrammarError (a 400) where they are malformed."""
    if not isinstance(tools, list) or not tools:
        raise GrammarError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    functions = []
    for i, tool in enumerate(tools):
        f = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise GrammarError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                               "\"parameters\": {...}}}")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise GrammarError(f"tools[{i}].function.parameters must be a JSON schema object")
        functions.append({"name": f["name"], "description": f.get("description", ""), "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise GrammarError("each tool needs a name of its own")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        f = choice.get("function") if choice.get("type") == "function" else None
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str) or name not in names:
            raise GrammarError(f"tool_choice names a function that is not among the tools: {name!r}")
        return functions, name
    if choice not in ("auto", "required", "none"):
        raise GrammarError('tool_choice must be "auto", "required", "none" or {"type": "function", '
                           '"function": {"name": ...}}')
    return functions, choice


def call_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call of any of these functions, on one line (JSON_LAYOUT)."""
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "x-guidance": JSON_LAYOUT}


def tool_grammar(functions: list[dict[str, Any]], choice: str | None) -> Grammar | None:
    """The answer's grammar for a choice (None for "none")."""
    if choice == "none":
        return None
    chosen = functions if choice in ("auto", "required") else [f for f in functions if f["name"] == choice]
    call = f'"{OPEN}" call "{CLOSE}"\ncall: %json {json.dumps(call_schema(chosen))}'
    if choice == "auto":
        return Grammar("lark", f"start: TEXT | {call}\nTEXT: /[^<](.|\\n)*/")
    return Grammar("lark", f"start: {call}")


def tools_message(functions: list[dict[str, Any]]) -> str:
    """The system message that describes the tools and the call format, for a chat template
    that does not take tools."""
    listed = "\n".join(json.dumps(f) for f in functions)
    return ("You can call these functions (each with a JSON schema of its arguments):\n" + listed +
            f'\nTo call one, answer with {OPEN}{{"name": <function name>, "arguments": <arguments object>}}'
            f"{CLOSE} and nothing else.")


def with_tools(messages: list[dict[str, Any]], functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with the tools' system message first (joined to a system message already there)."""
    note = tools_message(functions)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + note}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def call_text(tool_calls: list[dict[str, Any]]) -> str:
    """An assistant message's earlier tool calls as the text the model wrote for them."""
    if not isinstance(tool_calls, list):
        raise GrammarError('a message\'s tool_calls must be a list of {"type": "function", "function": {...}}')
    out = []
    for call in tool_calls:
        f = call.get("function") if isinstance(call, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise GrammarError('a message\'s tool_calls must be [{"type": "function", "function": {"name": ..., '
                               '"arguments": "..."}}]')
        try:
            arguments = json.loads(f.get("arguments") or "{}")
        except (json.JSONDecodeError, TypeError):
            raise GrammarError(f"the arguments of the earlier call of {f['name']!r} are not JSON") from None
        out.append(OPEN + json.dumps({"name": f["name"], "arguments": arguments}) + CLOSE)
    return "".join(out)


def read_calls(text: str) -> list[dict[str, Any]] | None:
    """The tool calls of an answer in OpenAI's shape, or None where it is text. An answer cut
    short (length) inside its call is text too."""
    if not text.startswith(OPEN) or not text.endswith(CLOSE):
        return None
    try:
        call = json.loads(text[len(OPEN): -len(CLOSE)])
    except json.JSONDecodeError:
        return None
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]


def may_be_call(text: str) -> bool:
    """Whether streamed text so far may be (the start of) a tool call: it is held back until
    the answer ends, then sent as one tool_calls delta."""
    return text.startswith(OPEN[: len(text)]) if len(text) < len(OPEN) else text.startswith(OPEN)
