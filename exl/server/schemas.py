"""Request and response bodies (pydantic), shaped like OpenAI's API plus exl's extra samplers.

Unknown request fields are ignored (front ends send many); the extra samplers (`top_k`, `min_p`,
`repetition_penalty`, `dry_*`, `xtc_*`, `banned_strings`, ...) are passed by the `openai` client with
`extra_body={...}`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from exl.server.config import CacheMode

MAX_N = 16
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------------------------------------------------------------
# sampling shared by /v1/chat/completions and /v1/completions


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="send a last chunk with the usage of the whole request")


class TextFormat(_Request):
    type: Literal["text"]


class JsonObjectFormat(_Request):
    type: Literal["json_object"]


class JsonSchemaSpec(_Request):
    name: str = Field("output", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema",
                                    description="a JSON schema the output must follow")
    strict: bool | None = None


class JsonSchemaFormat(_Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat], Field(discriminator="type")]


class SamplingRequest(_Request):
    """Fields every generation request takes."""

    model: str | None = Field(None, description="the loaded model's name (see GET /v1/models)", max_length=1024)
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (default: up to the "
                                   "context limit)")
    n: int = Field(1, ge=1, le=MAX_N, description="completions to generate for the prompt")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOP} strings that end the completion "
                                         "(not included in the output)")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    user: str | None = Field(None, max_length=4096)
    response_format: ResponseFormat | None = None
    # exl / TabbyAPI / vLLM extras
    top_k: int | None = Field(None, ge=-1, description="sample among the k most likely tokens (0 or -1: off)")
    min_p: float | None = Field(None, ge=0, le=1)
    typical: float | None = Field(None, ge=0, le=1, description="locally typical sampling mass (1 = off)")
    repetition_penalty: float | None = Field(None, ge=0.01, le=10)
    penalty_range: int | None = Field(None, ge=-1, description="tokens the penalties look back over (0/-1: all)")
    dry_multiplier: float | None = Field(None, ge=0, le=100)
    dry_base: float | None = Field(None, ge=1, le=100)
    dry_allowed_length: int | None = Field(None, ge=0, le=1_000_000)
    dry_range: int | None = Field(None, ge=0)
    dry_sequence_breakers: list[str] | str | None = Field(None, description="strings that break DRY sequences "
                                                          "(a list, or a JSON list as a string)")
    xtc_probability: float | None = Field(None, ge=0, le=1)
    xtc_threshold: float | None = Field(None, ge=0, le=1)
    temperature_last: bool | None = None
    banned_strings: list[str] | str | None = Field(None, description="strings the model may not write")
    banned_tokens: list[int] | None = Field(None, description="token ids the model may not sample")
    min_tokens: int = Field(0, ge=0, description="tokens to generate before EOS or a stop string may end it")
    ignore_eos: bool = Field(False, description="keep generating past EOS (benchmarks)")
    stop_token_ids: list[int] | None = None
    json_schema: dict[str, Any] | None = Field(None, description="constrain the output to this JSON schema")
    regex_pattern: str | None = Field(None, max_length=10_000, description="constrain the output to this regex")
    grammar_string: str | None = Field(None, max_length=100_000, description="constrain the output to this grammar")
    skip_special_tokens: bool = True
    return_token_ids: bool = Field(False, description="add `prompt_token_ids` and each choice's `token_ids` to the "
                                   "response (stream: each chunk's new ids)")


# ---------------------------------------------------------------------------------------------------------------------
# chat


class TextPart(_Request):
    type: Literal["text"]
    text: str


class OtherPart(_Body):
    type: str


ContentPart = Union[TextPart, OtherPart]


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Request):
    name: str = Field(..., min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="same as max_tokens (newer name)")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="continue the last (assistant) message instead of "
                                         "starting a new one")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the chat template")


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(_Body):
    content: list[TokenLogprob] | None = None


class ResponseFunctionCall(_Body):
    name: str
    arguments: str


class ResponseToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ResponseMessage(_Body):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None
    time_to_first_token: float | None = Field(None, description="seconds from arrival to the first token")
    prompt_time: float | None = None
    completion_time: float | None = None
    total_time: float | None = None
    prompt_tokens_per_second: float | None = None
    completion_tokens_per_second: float | None = None


class ChatChoice(_Body):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(None, description="with return_token_ids: the generated ids")


class ChatCompletion(_Body):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids: the prompt's ids")


class DeltaToolCall(_Body):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None


class ChatDelta(_Body):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Body):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Body):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------------------------------------------------------
# completions


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="a prompt, several prompts, or token ids (one list or a list of lists)")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="return this many top log-probs "
                                 "per token (0: only the chosen token's)")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)


class CompletionLogprobs(_Body):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(None, description="with return_token_ids: the generated ids")
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids: this prompt's ids")


class Completion(_Body):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------------------------------------------------------
# models, tokens, health


class ModelCard(_Body):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "exl"
    loaded: bool = False
    max_seq_len: int | None = None
    cache_size: int | None = None
    cache_mode: str | None = None
    draft_model: str | None = None
    tool_format: str | None = None
    generator_restarts: int | None = None


class ModelList(_Body):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class DraftLoadOptions(_Request):
    name: str | None = Field(None, max_length=1024)
    num_draft_tokens: int | None = Field(None, ge=1, le=16)
    cache_mode: CacheMode | None = None
    ngram: bool | None = None


class ModelLoadRequest(_Request):
    name: str = Field(..., min_length=1, max_length=1024, description="a model folder inside the model directory")
    max_seq_len: int | None = Field(None, ge=16, le=10_000_000)
    cache_size: int | None = Field(None, ge=16, le=100_000_000)
    cache_mode: CacheMode | None = None
    max_batch_size: int | None = Field(None, ge=1, le=1024)
    tool_format: Literal["auto", "hermes", "llama3", "mistral", "none"] | None = None
    draft: DraftLoadOptions | None = None


class UnloadResponse(_Body):
    unloaded: str | None = None


class TokenEncodeRequest(_Request):
    text: str | list[ChatMessage] = Field(..., description="text, or chat messages rendered with the chat template")
    add_bos_token: bool | None = Field(None, description="add BOS (default: the model's choice; never for messages)")
    encode_special_tokens: bool = Field(True, description="read special-token text such as <|im_end|> as the "
                                        "special token")
    add_generation_prompt: bool = True


class TokenEncodeResponse(_Body):
    tokens: list[int]
    length: int


class TokenDecodeRequest(_Request):
    tokens: list[int] = Field(..., max_length=10_000_000)
    decode_special_tokens: bool = Field(True, description="keep special tokens in the text")


class TokenDecodeResponse(_Body):
    text: str


class Health(_Body):
    status: Literal["ok", "loading", "no_model", "unhealthy"]
    model: str | None = None
    detail: str | None = None


class ErrorDetail(_Body):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Body):
    error: ErrorDetail
