"""Tool calls: how a model writes them, parsing them out of its text, and the schema that forces one.

Three formats cover the common chat templates:

- hermes   (Qwen 2.5/3, Hermes, many fine-tunes): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
  one block per call, optionally after some text.
- llama3   (Llama 3.1/3.2/3.3): the whole reply is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`, several separated by `;`).
- mistral  (Mistral, Mixtral): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` or `[TOOL_CALLS]name[ARGS]{...}`.

`ToolStreamParser` separates a streamed reply into content (sent at once) and tool calls (held until
they are complete). With `tool_choice` "required" or a named function the server instead prefills the
format's opening (`prefix`) and constrains the rest to `call_schema(...)`, so the reply is a valid call.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

FORMATS = ("hermes", "llama3", "mistral")


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`
    id: str = ""

    def __post_init__(self):
        if not self.id:
            self.id = "call_" + secrets.token_hex(12)

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def detect_format(template: str | None) -> str:
    """Guess the tool-call format from a chat template's text; "none" when it renders no tools."""
    if not template:
        return "none"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("ipython" in template and "tools" in template):
        return "llama3"
    return "none"


def _call_from_obj(obj: Any, args_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            json.loads(args)
        except json.JSONDecodeError:
            args = json.dumps({"input": args})
        return ParsedCall(obj["name"], args if args.strip() else "{}")
    return ParsedCall(obj["name"], json.dumps(args if args is not None else {}, ensure_ascii=False))


def _json_values(text: str) -> list[Any] | None:
    """All JSON values in `text`, separated by whitespace, `;` or `,`; None if anything else is there."""
    decoder = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in ";,"):
            i += 1
        if i >= len(text):
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(value)


def _parse_hermes(text: str) -> tuple[str, list[ParsedCall]]:
    content, calls, rest = [], [], text
    while "<tool_call>" in rest:
        before, _, after = rest.partition("<tool_call>")
        content.append(before)
        body, closed, rest = after.partition("</tool_call>")
        values = _json_values(body)
        parsed = [_call_from_obj(v, "arguments") for v in values] if values else []
        if values is None or not parsed or any(c is None for c in parsed):
            content.append("<tool_call>" + body + ("</tool_call>" if closed else ""))  # not a call: keep as text
        else:
            calls.extend(parsed)
    content.append(rest)
    return "".join(content).strip(), calls


def _parse_llama3(text: str) -> tuple[str, list[ParsedCall]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):]
    values = _json_values(body)
    if not values:
        return text, []
    calls = [_call_from_obj(v, "parameters") for v in values]
    if any(c is None for c in calls):
        return text, []
    return "", calls


def _parse_mistral(text: str) -> tuple[str, list[ParsedCall]]:
    before, marker, after = text.partition("[TOOL_CALLS]")
    if not marker:
        return text, []
    after = after.strip()
    calls: list[ParsedCall | None] = []
    if "[ARGS]" in after:  # v11 tokenizer: name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        for part in after.split("[TOOL_CALLS]"):
            name, _, args = part.partition("[ARGS]")
            values = _json_values(args)
            calls.append(_call_from_obj({"name": name.strip(), "arguments": values[0]}, "arguments")
                         if values and len(values) == 1 else None)
    else:
        values = _json_values(after)
        items = values[0] if values and len(values) == 1 and isinstance(values[0], list) else values
        calls = [_call_from_obj(v, "arguments") for v in (items or [])]
    if not calls or any(c is None for c in calls):
        return text, []
    return before.strip(), calls  # type: ignore[return-value]


_PARSERS = {"hermes": _parse_hermes, "llama3": _parse_llama3, "mistral": _parse_mistral}


def parse_tool_calls(text: str, fmt: str) -> tuple[str, list[ParsedCall]]:
    """(content, calls) of a complete reply. Text that is not a well-formed call stays content."""
    parser = _PARSERS.get(fmt)
    return parser(text) if parser else (text, [])


# ---------------------------------------------------------------------------------------------------------------------
# streaming


_START = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}


class ToolStreamParser:
    """Feeds a streamed reply; returns the content that can be sent now, holding back anything that might be
    (the start of) a tool call. `finish()` returns the remaining content and the parsed calls."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.text = ""  # everything so far
        self.sent = 0  # chars of self.text already returned as content
        self.in_call = False

    def feed(self, chunk: str) -> str:
        self.text += chunk
        if self.in_call or self.fmt not in FORMATS:
            return "" if self.in_call else self._release(len(self.text))
        if self.fmt == "llama3":
            head = self.text.lstrip()
            if not head:
                return ""
            if head.startswith("{") or head.startswith("<|python_tag|>") or "<|python_tag|>".startswith(head):
                if head.startswith("{") or head.startswith("<|python_tag|>"):
                    self.in_call = True  # a whole-reply call: hold everything until the end
                return ""
            self.fmt = "none"  # plain text reply
            return self._release(len(self.text))
        marker = _START[self.fmt]
        at = self.text.find(marker, self.sent)
        if at >= 0:
            self.in_call = True
            return self._release(at)
        # hold back a tail that could be the beginning of the marker
        keep = 0
        for k in range(min(len(marker) - 1, len(self.text) - self.sent), 0, -1):
            if self.text.endswith(marker[:k]):
                keep = k
                break
        return self._release(len(self.text) - keep)

    def _release(self, upto: int) -> str:
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """(content not yet returned, calls)."""
        if not self.in_call:
            return self._release(len(self.text)), []
        content, calls = parse_tool_calls(self.text[self.sent:], self.fmt)
        if not calls:
            return self._release(len(self.text)), []
        self.sent = len(self.text)
        return content, calls


# ---------------------------------------------------------------------------------------------------------------------
# forcing a call


def _params(tool: dict) -> dict:
    p = tool["function"].get("parameters")
    return p if isinstance(p, dict) and p else {"type": "object"}


def prefix(fmt: str) -> str:
    """Text prefilled after the generation prompt when a call is required."""
    return {"hermes": "<tool_call>\n", "mistral": "[TOOL_CALLS]"}.get(fmt, "")


def suffix(fmt: str) -> str:
    """Text that closes a forced call (appended to the reply before parsing)."""
    return {"hermes": "\n</tool_call>"}.get(fmt, "")


def call_schema(tools: list[dict], fmt: str, name: str | None = None) -> dict:
    """JSON schema of one call to `name` (or to any of `tools`) in format `fmt`."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    key = "parameters" if fmt == "llama3" else "arguments"
    options = [{"type": "object",
                "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]}, key: _params(t)},
                "required": ["name", key], "additionalProperties": False} for t in chosen]
    one = options[0] if len(options) == 1 else {"anyOf": options}
    if fmt == "mistral":
        return {"type": "array", "items": one, "minItems": 1, "maxItems": 1}
    return one
