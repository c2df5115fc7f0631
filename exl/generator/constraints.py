"""Constrained output: JSON schema, regex and grammar constraints applied as a token mask.

Built on llguidance (chosen over xgrammar by measured overhead on SmolLM2's 49k vocabulary: grammar
compile ~1 ms vs ~5 ms and 10-20 µs vs 3-5 µs per token mask, so llguidance costs less per request up to a
few hundred tokens; both are far below one decode step; see docs/generator.md).

A constraint object is compiled once and can serve many jobs; each job gets its own `ConstraintState`:

    c = JsonSchemaConstraint(tokenizer, {"type": "object", "properties": {"x": {"type": "integer"}}})
    job = Job(ids, max_new_tokens=100, constraint=c)
"""

from __future__ import annotations

import json
import threading
import weakref

import numpy as np
import torch

from exl.errors import ExlError


class ConstraintError(ExlError):
    """A schema, regex or grammar is invalid."""


class ConstraintUnsatisfiable(ConstraintError):
    """A valid constraint needs text that no token of this model's vocabulary can produce (e.g. a byte the
    tokenizer has no token for): the request cannot be served as asked, which is the client's to change."""

    code = "constraint_unsatisfiable"


def _llguidance():
    try:
        import llguidance  # noqa: F401
        import llguidance.numpy  # noqa: F401
    except ImportError as e:  # pragma: no cover - a dependency of exl
        raise ExlError("constrained generation needs the `llguidance` package: pip install llguidance") from e
    return llguidance


_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def ll_tokenizer(tokenizer):
    """The llguidance view of an exl Tokenizer (built once per tokenizer: ~1 s)."""
    llg = _llguidance()
    with _lock:
        lt = _tokenizers.get(tokenizer)
        if lt is None:
            lt = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                 eos_token=list(tokenizer.eos_token_ids) or None)
            _tokenizers[tokenizer] = lt
        return lt


class Constraint:
    """A compiled llguidance grammar for one tokenizer. Subclasses only build the grammar text."""

    kind = "grammar"

    def __init__(self, tokenizer, grammar: str, description: str):
        llg = _llguidance()
        self.tokenizer, self.grammar, self.description = tokenizer, grammar, description
        self._lt = ll_tokenizer(tokenizer)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self._lt)
        if is_error:
            raise ConstraintError(f"invalid {self.kind} constraint ({description}): {messages[0] if messages else ''}")

    def start(self) -> "ConstraintState":
        """A fresh matcher for one job."""
        return ConstraintState(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description})"


class JsonSchemaConstraint(Constraint):
    """Output must be JSON matching `schema` (a dict or JSON string). Whitespace is compact by default."""

    kind = "JSON schema"

    def __init__(self, tokenizer, schema, whitespace_flexible: bool = False):
        llg = _llguidance()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict):
            raise ConstraintError(f"JSON schema must be an object (dict), got {type(schema).__name__}")
        self.schema = schema
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": whitespace_flexible})
        except ValueError as e:
            raise ConstraintError(f"invalid JSON schema: {e}") from e
        super().__init__(tokenizer, grammar, json.dumps(schema)[:80])


class RegexConstraint(Constraint):
    """Output must match the regular expression `pattern` (Rust regex syntax, anchored at both ends)."""

    kind = "regex"

    def __init__(self, tokenizer, pattern: str):
        llg = _llguidance()
        self.pattern = pattern
        super().__init__(tokenizer, llg.LLMatcher.grammar_from_regex(pattern), repr(pattern)[:80])


class GrammarConstraint(Constraint):
    """Output must follow a context-free grammar, in Lark syntax (llguidance dialect) or llama.cpp GBNF."""

    kind = "grammar"

    def __init__(self, tokenizer, grammar: str):
        llg = _llguidance()
        try:
            text = llg.grammar_from("grammar", grammar)  # accepts Lark, converts GBNF
        except ValueError as e:
            raise ConstraintError(f"grammar does not parse: {e}") from e
        super().__init__(tokenizer, text, grammar.strip().splitlines()[0][:80] if grammar.strip() else "")


class ConstraintState:
    """One job's position in a constraint: the allowed-token mask, and the tokens consumed so far."""

    def __init__(self, constraint: Constraint):
        llg = _llguidance()
        self.constraint = constraint
        self.matcher = llg.LLMatcher(constraint._lt, constraint.grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"{constraint}: {self.matcher.get_error()}")
        self.vocab = constraint.tokenizer.vocab_size
        self._bits = np.full(((self.vocab + 31) // 32,), -1, dtype=np.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._masked = False  # _bits hold the mask of the current position

    def mask(self) -> torch.Tensor:
        """bool [vocab]: True where the next token is allowed."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._masked = True
        bits = torch.from_numpy(self._bits)
        mask = ((bits[:, None] >> self._shifts) & 1).flatten()[: self.vocab].bool()
        if not mask.any() and not self.matcher.is_stopped():
            raise ConstraintUnsatisfiable(f"{self.constraint}: no token of this model's vocabulary can continue the "
                                          f"output here ({self._why()})")
        return mask

    def advance(self, token: int) -> None:
        token = int(token)
        allowed = self._masked and 0 <= token < self.vocab and (int(self._bits[token // 32]) >> (token % 32)) & 1
        self._masked = False
        if not self.matcher.consume_token(token):
            if allowed:  # llguidance offered it, then refused it: the text it forces has bytes no token spells
                raise ConstraintUnsatisfiable(f"{self.constraint}: the output must continue with text this model's "
                                              f"vocabulary cannot produce ({self._why()})")
            raise ConstraintError(f"{self.constraint}: token {token} was not allowed ({self._why()})")

    def _why(self) -> str:
        error = (self.matcher.get_error() or "").strip().splitlines()
        return error[0] if error else "no further detail"

    def rollback(self, n: int) -> None:
        if n and not self.matcher.rollback(n):
            raise ConstraintError(f"{self.constraint}: cannot roll back {n} tokens")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()
