"""Tokenizer: text <-> token ids, streaming detokenization and chat templates.

Built on the `tokenizers` library and Jinja2 only. `encode`, `decode` and `apply_chat_template`
give the same results as `transformers` (`encode(text)`, `decode(ids)` and
`apply_chat_template(messages, tokenize=False)`) for the same model folder.

    tok = Tokenizer.from_dir("models/SmolLM2-135M-Instruct")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi!"}])
    ids = tok.encode(prompt)
    stream = StreamDecoder(tok)
    for t in generated_ids:
        print(stream.feed(t), end="")
    print(stream.flush())
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
import tokenizers

from exl.errors import ExlError, ModelLoadError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) valid UTF-8
_GIL_FREE_CHARS = 8192  # texts longer than this are encoded with the GIL released


class ChatTemplateError(ExlError):
    """A chat template is missing, does not compile, or failed while rendering."""


# ---------------------------------------------------------------------------------------------------------------------
# loading


def _read_json(path: Path) -> Any:
    """The parsed JSON file, or None if it does not exist."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}); re-download or re-export the model folder") from e


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer configs: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read {path} ({e}); it should be a UTF-8 text file") from e


def _load_chat_templates(folder: Path, tokenizer_config: dict) -> tuple[str | dict[str, str] | None, str]:
    """The chat template(s) of a model folder and a description of where they came from.

    Priority: chat_template.jinja (+ additional_chat_templates/*.jinja), then tokenizer_config.json
    `chat_template` (a string, or a list of {"name", "template"} → dict), then chat_template.json.
    """
    jinja_file = folder / "chat_template.jinja"
    extra_dir = folder / "additional_chat_templates"
    extra = {p.stem: _read_text(p) for p in sorted(extra_dir.glob("*.jinja"))} if extra_dir.is_dir() else {}
    if jinja_file.is_file():
        main = _read_text(jinja_file)
        return ({"default": main, **extra} if extra else main), str(jinja_file)
    if extra:
        return extra, str(extra_dir)
    config_file = folder / "tokenizer_config.json"
    value = tokenizer_config.get("chat_template")
    if value is None:
        config_file = folder / "chat_template.json"
        processor_config = _read_json(config_file)
        value = processor_config.get("chat_template") if isinstance(processor_config, dict) else None
    if value is None:
        return None, ""
    if isinstance(value, str):
        return value, f"{config_file} 'chat_template'"
    if isinstance(value, list) and all(isinstance(t, Mapping) and {"name", "template"} <= t.keys() for t in value):
        return {t["name"]: t["template"] for t in value}, f"{config_file} 'chat_template'"
    raise ModelLoadError(
        f"{config_file}: 'chat_template' must be a string or a list of {{'name': ..., 'template': ...}} objects, "
        f"got {type(value).__name__}; fix the file or pass template=... to apply_chat_template"
    )


# ---------------------------------------------------------------------------------------------------------------------
# tokenizer


class Tokenizer:
    """A model's tokenizer: a `tokenizers.Tokenizer` plus special tokens, BOS/EOS policy and chat template.

    Build one with `Tokenizer.from_dir(folder)`, or directly from a `tokenizers.Tokenizer` (e.g. an importer):
    `special_tokens` maps names like "bos_token" to token text (these are also the chat template's variables);
    ids not given are looked up from that text.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        pad_token_id: int | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        chat_template_source: str = "the chat_template argument",
        name: str = "tokenizer",
    ):
        self.backend = backend
        self.name = name
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._lock = threading.Lock()
        self._text_backend: tokenizers.Tokenizer | None = None  # copy that reads special-token text as text

        def lookup(key: str, default: int | None = None) -> int | None:
            text = self.special_tokens.get(key)
            found = backend.token_to_id(text) if text is not None else None
            return default if found is None else found

        self.bos_token_id = lookup("bos_token", bos_token_id)
        eos = [lookup("eos_token")] + list(eos_token_ids)
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos if i is not None))
        self.pad_token_id = lookup("pad_token", pad_token_id)
        self.unk_token_id = lookup("unk_token")

        probe = self._default_specials()
        self.add_bos = probe[0] if add_bos is None else bool(add_bos)
        self.add_eos = probe[1] if add_eos is None else bool(add_eos)
        if self.add_bos and self.bos_token_id is None:
            self.add_bos = False
        if self.add_eos and not self.eos_token_ids:
            self.add_eos = False

        self.chat_template = dict(chat_template) if isinstance(chat_template, Mapping) else chat_template
        self.chat_template_source = chat_template_source
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.byte_fallback_ids = self._find_byte_fallback_ids()
        self._pieces: list[str] | None = None
        self._max_piece_chars: int | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load a Hugging Face tokenizer folder (tokenizer.json + optional configs and chat template).

        Special tokens come from tokenizer_config.json / special_tokens_map.json; extra EOS ids (a list is fine)
        from generation_config.json and config.json. Whether BOS/EOS are added follows tokenizer.json's
        post-processor like transformers 5; `add_bos_token`/`add_eos_token` are used only if it has none.
        """
        folder = Path(path)
        if not folder.is_dir():
            raise ModelLoadError(f"tokenizer folder {folder} does not exist or is not a directory")
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(
                f"{file} not found: exl needs a fast-tokenizer file. Export it with "
                f"`AutoTokenizer.from_pretrained(...).save_pretrained('{folder}')` or copy it from the original model"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for parse errors
            raise ModelLoadError(f"{file} could not be parsed as a tokenizers file ({e}); re-download or re-export it") from e

        tc = _read_json(folder / "tokenizer_config.json") or {}
        stm = _read_json(folder / "special_tokens_map.json") or {}
        gen = _read_json(folder / "generation_config.json") or {}
        cfg = _read_json(folder / "config.json") or {}
        for obj, fname in ((tc, "tokenizer_config.json"), (stm, "special_tokens_map.json"),
                           (gen, "generation_config.json"), (cfg, "config.json")):
            if not isinstance(obj, dict):
                raise ModelLoadError(f"{folder / fname} must hold a JSON object, got {type(obj).__name__}")

        # Same precedence as transformers: a modern tokenizer_config (with added_tokens_decoder) is authoritative,
        # otherwise the legacy special_tokens_map.json overrides it.
        special = {k: _token_text(tc.get(k)) for k in SPECIAL_TOKEN_NAMES}
        if "added_tokens_decoder" not in tc:
            special.update({k: _token_text(stm[k]) for k in SPECIAL_TOKEN_NAMES if _token_text(stm.get(k)) is not None})

        text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}

        def first_id(key: str) -> int | None:
            for src in (gen, cfg, text_cfg):
                ids = _id_list(src.get(key))
                if ids:
                    return ids[0]
            return None

        def flag(key: str) -> bool | None:
            # As in transformers 5, tokenizer.json's post-processor decides whether BOS/EOS are added; the
            # tokenizer_config.json flags only count when tokenizer.json has no post-processor.
            if backend.post_processor is not None or not isinstance(tc.get(key), bool):
                return None
            return tc[key]

        eos_ids = _id_list(gen.get("eos_token_id")) + _id_list(cfg.get("eos_token_id")) + _id_list(text_cfg.get("eos_token_id"))
        template, source = _load_chat_templates(folder, tc)
        return cls(
            backend,
            special_tokens=special,
            bos_token_id=first_id("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=first_id("pad_token_id"),
            add_bos=flag("add_bos_token"),
            add_eos=flag("add_eos_token"),
            chat_template=template,
            chat_template_source=source,
            name=str(folder),
        )

    def _default_specials(self) -> tuple[bool, bool]:
        """Whether the backend's post-processor adds BOS / EOS (used when the config does not say)."""
        plain = self.backend.encode("a", add_special_tokens=False).ids
        full = self.backend.encode("a", add_special_tokens=True).ids
        if len(full) <= len(plain):
            return False, False
        bos = self.bos_token_id is not None and full[0] == self.bos_token_id and plain[:1] != full[:1]
        eos = bool(self.eos_token_ids) and full[-1] in self.eos_token_ids and plain[-1:] != full[-1:]
        return bos, eos

    def _find_byte_fallback_ids(self) -> frozenset[int]:
        """Ids of SentencePiece byte pieces <0x00>..<0xFF> when the decoder turns them into bytes (ByteFallback)."""
        decoder = self.backend.decoder
        if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
            return frozenset()
        ids = (self.backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(i for i in ids if i is not None)

    # -- special tokens -------------------------------------------------------------------------------------------

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id (the first of `eos_token_ids`)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be padded larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def is_special(self, token_id: int) -> bool:
        """True for added tokens flagged special (the ones `decode(skip_special=True)` drops)."""
        return token_id in self._special_ids

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry (raw token text, e.g. "<|im_end|>" or "Ġthe"), or None."""
        return self.backend.token_to_id(token)

    # -- encode / decode ------------------------------------------------------------------------------------------

    def _wrap(self, ids: list[int], add_bos: bool | None, add_eos: bool | None) -> list[int]:
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if (self.add_eos if add_eos is None else add_eos) and self.eos_token_ids:
            ids = ids + [self.eos_token_ids[0]]
        return ids

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True, add_eos: bool | None = None) -> list[int]:
        """Token ids of `text`.

        add_bos / add_eos: None uses the model's default (what tokenizer.json's post-processor adds; see
        `from_dir`). special: parse special-token text such as "<|im_start|>" as the
        special token; with False it is tokenized as ordinary text (safe for untrusted input).
        """
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode expects a str, got {type(text).__name__}")
        backend = self.backend if special else self._plain_text_backend()
        if len(text) > _GIL_FREE_CHARS:  # encode_batch runs without the GIL: other threads go on meanwhile
            return self._wrap(backend.encode_batch([text], add_special_tokens=False)[0].ids, add_bos, add_eos)
        return self._wrap(backend.encode(text, add_special_tokens=False).ids, add_bos, add_eos)

    def min_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens of `text`, without tokenizing it (to refuse huge inputs early).

        No token covers more characters than its piece is long; the factor 2 leaves room for normalizers that
        compose characters (NFKC)."""
        if self._max_piece_chars is None:
            self._max_piece_chars = max(1, max(len(p) for p in self.pieces()))
        return len(text) // (2 * self._max_piece_chars)

    def encode_batch(self, texts: list[str], add_bos: bool | None = None, special: bool = True,
                     add_eos: bool | None = None) -> list[list[int]]:
        """`encode` for many texts at once (parallel in the Rust backend)."""
        backend = self.backend if special else self._plain_text_backend()
        return [self._wrap(e.ids, add_bos, add_eos) for e in backend.encode_batch(list(texts), add_special_tokens=False)]

    def _plain_text_backend(self) -> tokenizers.Tokenizer:
        """A second backend that tokenizes special-token text as ordinary text (made on first use)."""
        with self._lock:
            if self._text_backend is None:
                copy = tokenizers.Tokenizer.from_str(self.backend.to_str())
                copy.encode_special_tokens = True
                self._text_backend = copy
            return self._text_backend

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; incomplete UTF-8 byte sequences come out as U+FFFD. No space clean-up is applied."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # also numpy arrays / torch tensors
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    # -- pieces ---------------------------------------------------------------------------------------------------

    def pieces(self) -> list[str]:
        """Every token's text as it appears mid-sequence (SentencePiece "▁the" → " the"; special tokens as written).

        A token that holds only part of a UTF-8 character decodes to U+FFFD. Computed once and cached.
        """
        if self._pieces is None:
            n = self.vocab_size
            anchor = self.backend.encode("a", add_special_tokens=False).ids[-1:]
            head = self.backend.decode(anchor, skip_special_tokens=False)
            with_anchor = self.backend.decode_batch([anchor + [i] for i in range(n)], skip_special_tokens=False)
            alone = None
            pieces = []
            for i, text in enumerate(with_anchor):
                if anchor and text.startswith(head):
                    pieces.append(text[len(head):])
                else:  # exotic decoder: fall back to decoding the token on its own
                    alone = alone or self.backend.decode_batch([[j] for j in range(n)], skip_special_tokens=False)
                    pieces.append(alone[i])
            self._pieces = pieces
        return self._pieces

    def id_to_piece(self, token_id: int) -> str:
        """The text of one token as it appears mid-sequence (see `pieces`)."""
        return self.pieces()[token_id]

    # -- chat -----------------------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[Mapping[str, Any]] | None = None,
        documents: list[Mapping[str, Any]] | None = None,
        template: str | None = None,
        **extra: Any,
    ) -> str:
        """Render a conversation to prompt text with the model's Jinja chat template (as transformers does).

        template: None for the model's template (with several named ones: "tool_use" when tools are given, else
        "default"), a template name, or a full Jinja template string. Extra keyword arguments become template
        variables (e.g. `enable_thinking=False`, `date_string=...`) and override the special-token variables.
        """
        source, name = self._select_template(template, tools)
        return render_chat_template(
            source, messages, add_generation_prompt=add_generation_prompt, tools=tools, documents=documents,
            variables={**self.special_tokens, **extra}, origin=name,
        )

    def _select_template(self, template: str | None, tools: Any) -> tuple[str, str]:
        own = self.chat_template
        where = self.chat_template_source or self.name
        if isinstance(own, dict):
            if template is not None and template in own:
                return own[template], f"{where} [{template}]"
            if template is None:
                key = "tool_use" if tools is not None and "tool_use" in own else "default" if "default" in own else None
                if key is None:
                    raise ChatTemplateError(
                        f"{where} holds several chat templates ({sorted(own)}) and none is named 'default'; "
                        f"pass template=<name> to choose one"
                    )
                return own[key], f"{where} [{key}]"
        if template is not None:
            return template, "the template argument"
        if own is None:
            raise ChatTemplateError(
                f"{self.name} has no chat template (no chat_template.jinja and no 'chat_template' in "
                f"tokenizer_config.json); pass template=<jinja text> or add one to the folder"
            )
        return own, where

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={self.eos_token_ids}, add_bos={self.add_bos})")


# ---------------------------------------------------------------------------------------------------------------------
# streaming detokenization


class StreamDecoder:
    """Turns generated token ids into text incrementally.

    `feed(id)` returns the text that became final with this token: incomplete UTF-8 (a character split over
    byte tokens) is held back until it completes, so no chunk ends in a spurious U+FFFD. Joining every chunk
    and `flush()` gives exactly `tokenizer.decode(ids, skip_special)`. Each step decodes only a short window:
    the tokens of the previous chunk (context for SentencePiece's leading-space rule) plus those not yet emitted.

    SentencePiece byte-fallback pieces (<0xE2>...) are held until a non-byte token ends their run, because the
    `tokenizers` ByteFallback decoder turns a whole run into U+FFFDs if any byte in it is invalid.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.reset()

    def reset(self) -> None:
        """Forget all state and start a new sequence."""
        self._ids: list[int] = []  # window: ids[:self._read] were already emitted (context), the rest is pending
        self._read = 0
        self._ctx_text = ""  # decode(ids[:self._read])

    def feed(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly "")."""
        if self.skip_special and self.tokenizer.is_special(token_id):
            return ""  # decode(skip_special=True) equals decode of the ids without the special ones
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def feed_many(self, token_ids: Iterable[int]) -> str:
        """Add several tokens (e.g. accepted draft tokens); return the newly completed text."""
        for t in token_ids:
            if not (self.skip_special and self.tokenizer.is_special(t)):
                self._ids.append(int(t))
        return self._advance(final=False)

    def flush(self) -> str:
        """End of sequence: return everything still held back (invalid bytes as U+FFFD) and reset."""
        text = self._advance(final=True)
        self.reset()
        return text

    def _advance(self, final: bool) -> str:
        if len(self._ids) == self._read:
            return ""
        if not final and self._ids[-1] in self.tokenizer.byte_fallback_ids:
            return ""  # a byte run is only final once it ends
        text = self.tokenizer.decode(self._ids)
        if not final and (text.endswith(_REPLACEMENT) or len(text) <= len(self._ctx_text)):
            return ""  # incomplete character (or nothing new): wait for more tokens
        chunk = text[len(self._ctx_text):]
        # The ids just emitted become the context window of the next step.
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._ctx_text = self.tokenizer.decode(self._ids)
        return chunk


# ---------------------------------------------------------------------------------------------------------------------
# chat templates


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text in HF training templates): renders the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes and only takes `indent`; chat templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


def _plain(value: Any) -> Any:
    """A copy of `value` built from JSON-like types only (what a sandboxed template may see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():  # numpy scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"  # opaque objects (images, arrays) stay out of the sandbox


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _prepare_messages(messages: Any) -> list[dict]:
    """Plain dict copies; None-valued keys dropped; reasoning available as both `reasoning_content` and `thinking`."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
        raise ChatTemplateError(f"messages must be a list of dicts with 'role' and 'content', got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if callable(getattr(m, "model_dump", None)) or (dataclasses.is_dataclass(m) and not isinstance(m, type)):
            m = _plain(m)
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        m = {k: v for k, v in _plain(m).items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_KEYS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat_template(
    template: str,
    messages: list[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[Mapping[str, Any]] | None = None,
    documents: list[Mapping[str, Any]] | None = None,
    variables: Mapping[str, Any] | None = None,
    origin: str = "chat template",
) -> str:
    """Render a Jinja chat template the way transformers does (sandboxed, trim_blocks, lstrip_blocks, ...).

    `variables` are passed to the template as-is (special tokens, `enable_thinking`, ...). Errors raise
    ChatTemplateError naming `origin`.
    """
    if tools is not None:
        for i, t in enumerate(tools):
            if not isinstance(t, Mapping):
                raise ChatTemplateError(f"tools[{i}] must be a JSON-schema dict, got {type(t).__name__}")
    if documents is not None:
        for i, d in enumerate(documents):
            if not isinstance(d, Mapping):
                raise ChatTemplateError(f"documents[{i}] must be a dict (e.g. with 'title' and 'text'), got {type(d).__name__}")
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template from {origin} does not compile: line {e.lineno}: {e.message}") from e
    context = dict(_plain(dict(variables or {})))
    try:
        return compiled.render(
            messages=_prepare_messages(messages),
            tools=_plain(list(tools)) if tools is not None else None,
            documents=_plain(list(documents)) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template from {origin} failed: {e}") from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise ChatTemplateError(
            f"chat template from {origin} failed on these messages: {type(e).__name__}: {e}"
        ) from e
