"""`exl serve` end to end: one real server process (SmolLM2, fp32) driven with the official `openai` client.

Outputs are checked against the same model in-process (one forward pass, no cache) and the
model's own log-probabilities; limits, auth, path safety, disconnects and shutdown through HTTP.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest
import torch

from test_server_utils import REPO, Server, link_model, make_tool_model

REPO_TESTS = REPO / "tests"

pytestmark = pytest.mark.timeout(300)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"],
                   "additionalProperties": False}}}


@pytest.fixture(scope="module")
def env(smollm_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    models = root / "models"
    link_model(smollm_dir, models / "smol")
    make_tool_model(smollm_dir, models / "smol-tools")
    outside = link_model(smollm_dir, root / "outside")  # a real model folder outside the model directory
    (models / "escape").symlink_to(outside, target_is_directory=True)
    sneaky = models / "sneaky"  # inside, but its weights are a symlink to the outside
    sneaky.mkdir()
    (sneaky / "config.json").write_text((outside / "config.json").read_text())
    (sneaky / "model.safetensors").symlink_to(outside / "model.safetensors")
    server = Server(models, "smol", root, ["--max-seq-len", "1024", "--cache-size", "8192", "--max-batch-size", "16",
                                           "--shutdown-grace", "20"])
    try:
        server.wait_ready()
        yield server
    finally:
        code = server.stop()
        print(server.log()[-3000:])
        assert code in (0, -signal.SIGTERM), f"server exited with {code}"  # uvicorn re-raises SIGTERM once done


@pytest.fixture(scope="module")
def client(env):
    return openai.OpenAI(base_url=env.url + "/v1", api_key=env.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref(smollm_dir):
    """The same model in-process, and its tokenizer."""
    import exl
    from exl.tokenizer import Tokenizer

    return exl.load_model(smollm_dir, progress=False), Tokenizer.from_dir(smollm_dir)


def reference_logprobs(ref, ids, new_ids):
    """Log-probabilities [len(new_ids), vocab] the model gives each new token's position (one forward pass)."""
    model, _ = ref
    with torch.no_grad():
        logits = model(torch.tensor([ids + new_ids]))[0, len(ids) - 1: len(ids) + len(new_ids) - 1]
    return torch.log_softmax(logits.float(), -1)


def check_greedy(ref, ids, new_ids, finish, tol=2e-2):
    """Every generated token is the reference argmax (up to fp16-cache rounding); a "stop" ends at EOS."""
    _, tok = ref
    tail = [tok.eos_token_id] if finish == "stop" else []
    lp = reference_logprobs(ref, ids, new_ids + tail)
    for k, t in enumerate(new_ids + tail):
        assert lp[k, t] >= lp[k].max() - tol, f"token {k} ({t}) is not the greedy choice"
    return lp


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


# ---------------------------------------------------------------------------------------------------------------------
# generation


def test_chat_greedy_matches_reference_with_logprobs(client, ref):
    model, tok = ref
    ids = tok.encode(tok.apply_chat_template(MESSAGES), add_bos=False)
    r = client.chat.completions.create(model="smol", messages=MESSAGES, temperature=0, max_tokens=12, logprobs=True,
                                       top_logprobs=3, extra_body={"return_token_ids": True})
    choice = r.choices[0]
    new = choice.token_ids
    assert r.prompt_token_ids == ids and r.usage.prompt_tokens == len(ids)
    assert tok.decode(new) == choice.message.content and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    ended_by_eos = choice.finish_reason == "stop"
    assert r.usage.completion_tokens == len(new) + ended_by_eos  # the EOS token counts as generated
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.model_extra["completion_tokens_per_second"] > 0
    lp = check_greedy(ref, ids, new, choice.finish_reason)
    assert len(choice.logprobs.content) == len(new)
    for k, (entry, tid) in enumerate(zip(choice.logprobs.content, new)):
        assert entry.token == tok.id_to_piece(tid) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(lp[k, tid].item(), abs=2e-2)
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert tops[1] == pytest.approx(lp[k].topk(2).values[1].item(), abs=2e-2)


def test_hostile_text_is_a_400_never_a_500(env, client):
    h = {**env.headers(), "content-type": "application/json"}
    cases = [("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "ab\\ud800c"}], "max_tokens": 2}',
              "messages[0].content", 2),
             ("/v1/completions", b'{"prompt": ["ok", "x\\udfffy"], "max_tokens": 2}', "prompt[1]", 1),
             ("/v1/token/encode", b'{"text": "\\ud800"}', "text", 0)]
    for path, body, where, at in cases:
        r = httpx.post(env.url + path, headers=h, content=body)
        assert r.status_code == 400, (path, r.text)
        message = r.json()["error"]["message"]
        assert where in message and f"at character {at}" in message and "surrogate" in message, message
    # a high-low pair is fine
    r = httpx.post(env.url + "/v1/token/encode", headers=h, content=b'{"text": "\\ud83d\\ude00"}')
    assert r.status_code == 200 and r.json()["length"] >= 1
    # a prompt far beyond the context is refused before it is tokenized (no tokenizer time or memory)
    t0 = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="word " * 1_500_000, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded" and "characters" in e.value.body["message"]
    assert time.perf_counter() - t0 < 60  # tokenizing 7.5 MB would take ~10 s; sanity bound only
    assert httpx.get(env.url + "/health").json()["status"] == "ok"


def test_finish_reasons_are_openai_values_with_exl_reason_beside(env, client):
    r = client.completions.create(model="smol", prompt="1, 2, 3,", temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.choices[0].model_extra["exl_finish_reason"] == "max_new_tokens"
    r = client.chat.completions.create(model="smol", messages=MESSAGES, temperature=0, max_tokens=200)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["exl_finish_reason"] == "stop_token"
    chunks = list(client.completions.create(model="smol", prompt="1, 2, 3,", temperature=0, max_tokens=3,
                                            stream=True, stop=[" 4"]))
    last = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert last.finish_reason == "stop" and last.model_extra["exl_finish_reason"] == "stop_string"


def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model="smol", messages=MESSAGES, temperature=0, max_tokens=12)
    chunks = list(client.chat.completions.create(model="smol", messages=MESSAGES, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_stop_string_and_length(client, ref):
    prompt = "1, 2, 3, 4, 5,"
    base = client.completions.create(model="smol", prompt=prompt, temperature=0, max_tokens=16,
                                     extra_body={"return_token_ids": True})
    text = base.choices[0].text
    assert base.choices[0].finish_reason == "length" and base.usage.completion_tokens == 16
    check_greedy(ref, ref[1].encode(prompt), base.choices[0].token_ids, "length")
    assert " 8" in text, text
    cut = client.completions.create(model="smol", prompt=prompt, temperature=0, max_tokens=16, stop=[" 8", "zzz"])
    assert cut.choices[0].text == text[: text.index(" 8")]
    assert cut.choices[0].finish_reason == "stop"


def test_completion_stream_logprobs_and_echo(client):
    prompt = "The quick brown fox"
    full = client.completions.create(model="smol", prompt=prompt, temperature=0, max_tokens=8, logprobs=2)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == full.usage.completion_tokens
    assert "".join(lp.tokens) == full.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(len(t) <= 2 and max(t.values()) == pytest.approx(v, abs=1e-5) for t, v in
               zip(lp.top_logprobs, lp.token_logprobs))
    chunks = list(client.completions.create(model="smol", prompt=prompt, temperature=0, max_tokens=8, stream=True,
                                            echo=True))
    assert "".join(c.choices[0].text for c in chunks) == prompt + full.choices[0].text


EVAL_TEXT = ("The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest "
             "structure in Paris. Its base is square, measuring 125 metres on each side.")


def test_echo_logprobs_score_the_prompt_like_exl_eval_ppl(client, ref, smollm_dir, tmp_path):
    """lm-eval's loglikelihood requests: echo + logprobs (+ max_tokens 0 or 1). The prompt tokens' log-probs are
    the ones `exl eval ppl` averages, on the same tokens."""
    import subprocess
    import sys

    _, tok = ref
    ids = tok.encode(EVAL_TEXT)
    r = client.completions.create(model="smol", prompt=EVAL_TEXT, max_tokens=0, echo=True, logprobs=3)
    c = r.choices[0]
    assert c.text == EVAL_TEXT and c.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert "".join(lp.tokens) == EVAL_TEXT and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(ids))]
    for k in range(1, len(ids)):
        top = lp.top_logprobs[k]
        assert lp.tokens[k] in top and top[lp.tokens[k]] == lp.token_logprobs[k]
        assert 3 <= len(top) <= 4 and max(top.values()) >= lp.token_logprobs[k]
    # the same numbers as `exl eval ppl` on this text as one window
    text = tmp_path / "eval.txt"
    text.write_text(EVAL_TEXT)
    out = subprocess.run([sys.executable, "-m", "exl.cli", "eval", "ppl", "-m", str(smollm_dir), "--text", str(text),
                          "--ctx", str(len(ids)), "--json"], capture_output=True, text=True, check=True).stdout
    ppl = json.loads(out.strip().splitlines()[-1])
    assert ppl["tokens"] == len(ids) - 1
    server_nll = -sum(lp.token_logprobs[1:]) / (len(ids) - 1)
    assert server_nll == pytest.approx(ppl["nll"], rel=1e-5, abs=1e-6)
    # per token against the in-process forward exl.eval makes
    from exl.eval import prompt_logprobs

    chosen, tops = prompt_logprobs(ref[0], ids, 3)
    assert lp.token_logprobs[1:] == pytest.approx(chosen, abs=1e-4)
    assert [max(t.values()) for t in lp.top_logprobs[1:]] == pytest.approx([t[0][1] for t in tops], abs=1e-4)
    # lm-eval's request shape: token ids, max_tokens 1, logprobs 1; the echoed part is the same, one token follows
    r = client.completions.create(model="smol", prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp1 = r.choices[0].logprobs
    assert len(lp1.tokens) == len(ids) + 1 and r.choices[0].text.startswith(EVAL_TEXT)
    assert lp1.token_logprobs[1:len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert lp1.text_offset[len(ids)] == len(EVAL_TEXT)
    # streamed: the echo chunk carries the prompt's log-probs
    chunks = list(client.completions.create(model="smol", prompt=EVAL_TEXT, max_tokens=0, echo=True, logprobs=2,
                                            stream=True))
    assert chunks[0].choices[0].logprobs.token_logprobs == lp.token_logprobs
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.slow
def test_lm_eval_local_completions(env, ref, smollm_dir, tmp_path):
    """The real lm-eval harness (`pip install -e .[eval]`) scores a small local multiple-choice task through
    /v1/completions; every loglikelihood it reports equals exl's own forward pass on lm-eval's tokens."""
    import os
    import subprocess
    import sys

    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")
    from exl.eval import prompt_logprobs

    task_dir = REPO_TESTS / "lm_eval_task"
    args = ",".join(["model=smol", f"base_url={env.url}/v1/completions", "tokenizer_backend=huggingface",
                     f"tokenizer={smollm_dir}", "num_concurrent=2", "max_retries=1", "tokenized_requests=True"])
    out = tmp_path / "lm_eval_out"
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                           "--tasks", "exl_tiny_mc", "--include_path", str(task_dir), "--batch_size", "2",
                           "--output_path", str(out), "--log_samples"],
                          cwd=task_dir, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "OPENAI_API_KEY": env.api_key, "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    samples = [json.loads(line) for f in out.rglob("samples_exl_tiny_mc_*.jsonl") for line in f.read_text().splitlines()]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]["exl_tiny_mc"]
    assert len(samples) == 6 and 0 <= results["acc,none"] <= 1
    import transformers

    hf_tok = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    model, _ = ref
    correct = 0
    for sample in samples:
        lls = []
        pairs = [sample["arguments"][f"gen_args_{i}"] for i in range(len(sample["arguments"]))]
        for pair, resp in zip(pairs, sample["resps"]):
            context, continuation = pair["arg_0"], pair["arg_1"]
            whole = hf_tok.encode(context + continuation, add_special_tokens=False)
            n_ctx = len(hf_tok.encode(context, add_special_tokens=False))
            chosen, _ = prompt_logprobs(model, whole, 0)
            lls.append(sum(chosen[n_ctx - 1:]))
            assert float(resp[0][0]) == pytest.approx(lls[-1], abs=1e-3), (context, continuation)
        assert len(lls) == 4
        correct += max(range(4), key=lambda i: lls[i]) == int(sample["target"])
    assert results["acc,none"] == pytest.approx(correct / 6)


def test_completion_n_and_seed_reproducible(client):
    args = dict(model="smol", prompt="Once upon a time", temperature=1.0, max_tokens=10, n=3, seed=1234)
    # The same seed gives the same text when the server is in the same state (here: the prompt is cached).
    # Batching with other requests changes floating-point rounding, so it is not bit-identical across loads.
    client.completions.create(**{**args, "n": 1})
    a = client.completions.create(**args)
    b = client.completions.create(**args)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in sorted(a.choices, key=lambda c: c.index)] == \
           [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert len({c.text for c in a.choices}) > 1  # different seeds per choice
    assert 3 <= a.usage.completion_tokens <= 30
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_token_id_prompts_and_batch(client, ref):
    _, tok = ref
    ids = tok.encode("The capital of France is")
    by_text = client.completions.create(model="smol", prompt="The capital of France is", temperature=0, max_tokens=6)
    batch = client.completions.create(model="smol", prompt=[ids, ids[:3]], temperature=0, max_tokens=6)
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + 3


def test_json_schema_output_parses(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Invent a person."}], temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    data = json.loads(r.choices[0].message.content)
    assert set(data) == {"name", "age"} and isinstance(data["name"], str) and isinstance(data["age"], int)
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": 'Return {"ok": true} as JSON.'}],
                                       temperature=0, max_tokens=40, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_regex_the_vocabulary_cannot_spell_is_a_400_not_a_500(client):
    # SmolLM2 has no token for the byte 0xf2 that starts U+B3510 (found by schema fuzzing as a 500)
    ask = dict(model="smol", prompt="Say:", max_tokens=8, extra_body={"regex_pattern": "\U000b3510"})
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**ask)
    assert e.value.code == "constraint_unsatisfiable" and "vocabulary cannot produce" in str(e.value)
    with pytest.raises(openai.APIError) as e:  # streaming: the headers are out, the stream ends with an error event
        list(client.completions.create(**ask, stream=True))
    assert e.value.code == "constraint_unsatisfiable" and "vocabulary cannot produce" in str(e.value)


def test_extra_samplers_are_applied(client):
    base = dict(model="smol", prompt="1, 2, 3, 4, 5,", temperature=0, max_tokens=10)
    plain = client.completions.create(**base).choices[0].text
    banned = client.completions.create(**base, extra_body={"banned_strings": [" 6"]}).choices[0].text
    assert " 6" in plain and " 6" not in banned
    sampled = client.completions.create(**{**base, "temperature": 0.8}, seed=5, extra_body={
        "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "dry_multiplier": 0.8, "xtc_probability": 0.5,
        "xtc_threshold": 0.1, "typical": 0.9}).choices[0].text
    assert sampled  # the full sampler chain runs
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**base, extra_body={"logit_bias": {"99999999": 5}})


def test_concurrent_requests_batch_correctly(env, ref):
    prompts = ["The capital of Italy is", "Water boils at", "My favourite colour is", "In 1969, astronauts",
               "The largest planet is", "Python is a"]

    async def together():
        aclient = openai.AsyncOpenAI(base_url=env.url + "/v1", api_key=env.api_key, max_retries=0)
        rs = await asyncio.gather(*[aclient.completions.create(
            model="smol", prompt=p, temperature=0, max_tokens=6 + i, extra_body={"return_token_ids": True})
            for i, p in enumerate(prompts)])
        await aclient.close()
        return rs

    for i, (p, r) in enumerate(zip(prompts, asyncio.run(together()))):
        c = r.choices[0]
        assert c.prompt_token_ids == ref[1].encode(p)
        assert len(c.token_ids) == 6 + i or c.finish_reason == "stop"
        check_greedy(ref, c.prompt_token_ids, c.token_ids, c.finish_reason)


# ---------------------------------------------------------------------------------------------------------------------
# models, tokens


def test_models_and_tokens(env, client, ref):
    _, tok = ref
    ids = [m.id for m in client.models.list().data]
    assert {"smol", "smol-tools"} <= set(ids) and "outside" not in ids
    h = env.headers()
    card = httpx.get(env.url + "/v1/model", headers=h).json()
    assert card["id"] == "smol" and card["max_seq_len"] == 1024 and card["cache_size"] == 8192
    enc = httpx.post(env.url + "/v1/token/encode", headers=h, json={"text": "Hello <|im_end|> world"}).json()
    assert enc["tokens"] == tok.encode("Hello <|im_end|> world") and enc["length"] == len(enc["tokens"])
    plain = httpx.post(env.url + "/v1/token/encode", headers=h,
                       json={"text": "Hello <|im_end|>", "encode_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode("Hello <|im_end|>", special=False)
    chat = httpx.post(env.url + "/v1/token/encode", headers=h, json={"text": MESSAGES}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(MESSAGES), add_bos=False)
    dec = httpx.post(env.url + "/v1/token/decode", headers=h, json={"tokens": enc["tokens"]}).json()
    assert dec["text"] == "Hello <|im_end|> world"
    dec = httpx.post(env.url + "/v1/token/decode", headers=h,
                     json={"tokens": enc["tokens"], "decode_special_tokens": False}).json()
    assert dec["text"] == tok.decode(enc["tokens"], skip_special=True)
    bad = httpx.post(env.url + "/v1/token/decode", headers=h, json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# ---------------------------------------------------------------------------------------------------------------------
# auth, errors, safety


def test_auth(env, client):
    assert httpx.get(env.url + "/health").status_code == 200  # open
    wrong = openai.OpenAI(base_url=env.url + "/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model="smol", prompt="x", max_tokens=1)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for path in ("/v1/models", "/v1/completions", "/metrics"):
        r = httpx.request("GET" if "models" in path or "metrics" in path else "POST", env.url + path,
                          json={"prompt": "x"})
        assert r.status_code == 401 and "no API key" in r.json()["error"]["message"]
    ok = httpx.post(env.url + "/v1/completions", headers={"x-api-key": env.api_key},
                    json={"prompt": "x", "max_tokens": 1})
    assert ok.status_code == 200
    for path in ("/v1/model/unload", "/v1/model/load"):
        r = httpx.post(env.url + path, headers=env.headers(), json={"name": "smol"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    with pytest.raises(openai.PermissionDeniedError):
        client.post("/model/unload", cast_to=object, body={})
    admin = openai.OpenAI(base_url=env.url + "/v1", api_key=env.admin_key, max_retries=0)
    assert admin.completions.create(model="smol", prompt="x", max_tokens=1).usage.completion_tokens == 1
    r = httpx.post(env.url + "/v1/model/load", headers={"x-admin-key": env.admin_key}, json={"name": "nope"})
    assert r.status_code == 404  # the admin key passed; the model does not exist


def test_errors_are_openai_shaped(env, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="hi " * 900, max_tokens=200)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=5000)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=MESSAGES, n=100)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:  # SmolLM2's template renders no tools
        client.chat.completions.create(model="smol", messages=MESSAGES, tools=[WEATHER_TOOL], tool_choice="required")
    assert e.value.body["code"] == "tools_not_supported"
    h = {**env.headers(), "content-type": "application/json"}
    r = httpx.post(env.url + "/v1/chat/completions", headers=h, content=b"{not json")
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(env.url + "/v1/completions", headers=h, content=b'{"prompt": "' + b"a" * (9 << 20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(env.url + "/v1/nothing", headers=h)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(env.url + "/v1/chat/completions", headers=h, json={"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
    assert r.status_code == 400 and "not supported" in r.json()["error"]["message"]


@pytest.mark.parametrize("name,status", [("../outside", 400), ("/etc", 400), ("smol/../../outside", 400),
                                         ("escape", 403), ("sneaky", 403), ("nope", 404)])
def test_model_load_stays_inside_model_dir(env, name, status):
    r = httpx.post(env.url + "/v1/model/load", headers=env.headers(admin=True), json={"name": name})
    assert r.status_code == status, r.text
    assert httpx.get(env.url + "/v1/model", headers=env.headers()).json()["id"] == "smol"  # still loaded


# ---------------------------------------------------------------------------------------------------------------------
# disconnects, metrics


def _wait_idle(env, timeout=30.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = env.metrics()
        if m["exl_cache_pages_in_use"] == 0 and m["exl_num_requests_running"] == 0:
            return m
        time.sleep(0.2)
    raise AssertionError(f"pages still in use after {timeout} s: {m}")


def test_client_disconnect_frees_pages(env):
    _wait_idle(env)
    body = {"model": "smol", "prompt": "Tell me a long story.", "max_tokens": 600, "ignore_eos": True,
            "temperature": 0.7, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", env.url + "/v1/completions", headers=env.headers(), json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            busy = env.metrics()
            assert busy["exl_cache_pages_in_use"] >= 1 and busy["exl_num_requests_running"] == 1
    _wait_idle(env, 20)  # 600 tokens would take far longer: the job was cancelled
    # the same for a non-streaming request whose client gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(env.url + "/v1/completions", headers=env.headers(), timeout=2.0,
                   json={**body, "stream": False})
    m = _wait_idle(env, 20)
    assert m['exl_requests_total{finish_reason="cancelled"}'] >= 2


def test_metrics(env, client):
    client.completions.create(model="smol", prompt="Hello", max_tokens=5, temperature=0)
    m = env.metrics()
    assert m["exl_model_loaded"] == 1 and m["exl_cache_pages_total"] == 8192 / 256
    assert m["exl_generation_tokens_total"] >= 5 and m["exl_prompt_tokens_total"] > 0
    assert m["exl_time_to_first_token_seconds_count"] >= 1
    assert m["exl_inter_token_latency_seconds_count"] >= 4
    assert m["exl_e2e_request_latency_seconds_count"] >= 1
    assert m['exl_requests_total{finish_reason="length"}'] >= 1
    assert 'exl_http_errors_total{status="401"}' in m


# ---------------------------------------------------------------------------------------------------------------------
# admin: unload / load, tool calls (needs the tool-template model)


def test_unload_load_and_tool_calls(env, client):
    admin = env.headers(admin=True)
    r = httpx.post(env.url + "/v1/model/load", headers=admin, json={"name": "smol-tools", "max_seq_len": 10**6})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert httpx.get(env.url + "/v1/model", headers=env.headers()).json()["id"] == "smol"  # still loaded
    r = httpx.post(env.url + "/v1/model/unload", headers=admin)
    assert r.status_code == 200 and r.json()["unloaded"] == "smol"
    assert httpx.get(env.url + "/health").json()["status"] == "no_model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=2)
    r = httpx.post(env.url + "/v1/model/load", headers=admin, json={"name": "smol-tools", "max_seq_len": 2048},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "smol-tools" and r.json()["tool_format"] == "hermes"
    ask = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    r = client.chat.completions.create(model="smol-tools", messages=ask, tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice="required", temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "get_time") and call.id
    args = json.loads(call.function.arguments)
    assert set(args) == ({"city"} if call.function.name == "get_weather" else {"zone"})
    # named function, streamed
    chunks = list(client.chat.completions.create(
        model="smol-tools", messages=ask, tools=[WEATHER_TOOL, TIME_TOOL], stream=True, temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the tool result goes back through the template
    follow = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    r = client.chat.completions.create(model="smol-tools", messages=follow, tools=[WEATHER_TOOL], temperature=0,
                                       max_tokens=8)
    assert r.choices[0].message.content and r.usage.prompt_tokens > 100
    r = httpx.post(env.url + "/v1/model/load", headers=admin, json={"name": "smol"}, timeout=120)
    assert r.status_code == 200 and r.json()["max_seq_len"] == 1024
    env.wait_ready()


# ---------------------------------------------------------------------------------------------------------------------
# shutdown (last: stops the server)


def test_graceful_shutdown_finishes_running_stream(env):
    body = {"model": "smol", "prompt": "Count: 1, 2, 3,", "max_tokens": 24, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", env.url + "/v1/completions", headers=env.headers(), json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            env.proc.terminate()  # SIGTERM while the job runs
            rest = [first] + [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest[:-1]]
    assert finish[-1] == "length"  # it ran to completion within the shutdown grace period
    assert env.proc.wait(60) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in env.log()
