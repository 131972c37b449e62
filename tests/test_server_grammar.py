"""Constrained decoding (issue 13): OpenAI's ``response_format`` (json_object, json_schema) and
llama-server's ``json_schema`` / ``grammar`` (GBNF), on every generation endpoint, streamed and not,
with and without speculation. The output parses and validates; drafting changes nothing (greedy and
seeded); a draft token the grammar forbids is rejected; bad schemas and grammars are 400s naming the
field. One server: 2 slots, a small context, short replies."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
import torch

from conftest import ServerProcess
from gemmaspec.engine import RequestStats
from gemmaspec.grammar import GrammarError, gbnf_grammar, json_schema_grammar
from gemmaspec.sampling import SamplingParams
from gemmaspec.speculative.drafters import NgramDrafter
from gemmaspec.speculative.verify import verify_round

YES_NO = {"type": "object", "properties": {
    "answer": {"type": "string", "enum": ["yes", "no"]},
    "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["answer", "confidence"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
ASK_YES_NO = "Is Paris the capital of France? Answer in JSON."
ASK_PERSON = "Describe Ada Lovelace (name, age at death, tags) as JSON."
GBNF = 'root ::= "Answer: " ("yes" | "no") ", " [0-9] [0-9]? " times."'
GBNF_RE = re.compile(r"Answer: (yes|no), [0-9][0-9]? times\.")


def conforms(value, schema) -> bool:
    """A small validator for the keywords the schemas here use (type, enum, properties, required,
    additionalProperties, items, maxItems, maxLength, minimum, maximum)."""
    t = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if t == "object":
        if not isinstance(value, dict) or any(k not in value for k in schema.get("required", [])):
            return False
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return False
        return all(conforms(value[k], s) for k, s in props.items() if k in value)
    if t == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
                and all(conforms(v, schema.get("items", {})) for v in value))
    if t == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if t == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    return True


# ---- the machinery, without a server -------------------------------------------------------------------

def test_a_draft_the_grammar_forbids_is_rejected_and_the_best_allowed_token_replaces_it():
    logits = torch.zeros(3, 10)
    logits[:, 7] = 5.0  # the target's favourite everywhere: the drafts agree with it
    logits[:, 3] = 4.0
    params = SamplingParams(temperature=0)
    assert verify_round(logits, [0], [7, 7], None, params, None).n_accepted == 2
    allowed = torch.zeros(10, dtype=torch.bool)
    allowed[[3, 4]] = True
    seen = []

    only7 = torch.zeros(10, dtype=torch.bool)
    only7[7] = True

    def masks(i):
        seen.append(i)
        return allowed if i == 1 else only7

    v = verify_round(logits, [0], [7, 7], None, params, None, masks=masks)
    assert (v.n_accepted, v.next_token, v.kind) == (1, 3, "recovered")
    assert seen == [0, 1]  # lazily, in order, never past the rejection
    from gemmaspec.sampling import Sampler

    sp = SamplingParams(temperature=1.0, seed=4, top_k=0, top_p=1.0, min_p=0.0)
    for _ in range(3):  # sampled: a forbidden draft has probability 0, whatever its logit
        v = verify_round(logits, [0], [7, 7], None, sp, Sampler(sp), pos=1, masks=masks)
        assert v.n_accepted == 1 and v.next_token in (3, 4)


def test_constraint_checks_drafts_rolls_back_and_ends(tokenizer):
    c = gbnf_grammar(GBNF).constraint(tokenizer)
    ids = tokenizer.encode("Answer: no, 7 times.", add_bos=False)
    assert c.valid_prefix(ids + ids) == len(ids)  # a draft is cut where the grammar stops accepting
    assert c.valid_prefix(tokenizer.encode("Answer: maybe", add_bos=False)) < len(tokenizer.encode("Answer: maybe", add_bos=False))
    for t in ids[:3]:
        c.consume(t)
    c.rollback(2)
    assert c.consumed == 1
    for t in ids[1:]:
        c.consume(t)
    assert c.done and c.accepting
    allowed = c.mask().nonzero().view(-1).tolist()
    assert set(allowed) <= set(tokenizer.stop_ids)  # only a stop token may follow
    with pytest.raises(RuntimeError):
        c.consume(ids[0])


@pytest.mark.parametrize("bad,field,needle", [
    (lambda: json_schema_grammar({"type": "objectx"}, "json_schema"), "json_schema", "objectx"),
    (lambda: json_schema_grammar("{not json", "response_format"), "response_format", "not JSON"),
    (lambda: json_schema_grammar({"type": "string", "format": "weird"}), "json_schema", "weird"),
    (lambda: gbnf_grammar('x ::= "a"'), "grammar", "root"),
    (lambda: gbnf_grammar('root ::= "a" | missing'), "grammar", "missing"),
])
def test_bad_schemas_and_grammars_name_the_field_and_the_reason(bad, field, needle):
    with pytest.raises(GrammarError) as exc:
        bad()
    assert exc.value.field == field and needle in str(exc.value)


@pytest.mark.parametrize("schema,prompt", [(YES_NO, ASK_YES_NO), (PERSON, ASK_PERSON)], ids=["yes_no", "person"])
def test_engine_output_follows_the_schema_and_drafting_changes_nothing(engine, schema, prompt):
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    g = json_schema_grammar(schema)
    drafted = 0
    for params in (SamplingParams(temperature=0, max_tokens=60), SamplingParams(temperature=0.8, seed=2, max_tokens=60)):
        plain_st = RequestStats()
        plain = [t for e in engine.generate(ids, params, stats=plain_st, constraint=g.constraint(engine.tokenizer))
                 for t in e.tokens]
        assert plain_st.stop_reason == "eos", engine.tokenizer.decode(plain)
        assert conforms(json.loads(engine.tokenizer.decode(plain)), schema)
        for n_max in (1, 4, 8):
            st = RequestStats()
            spec = [t for e in engine.generate(ids, params, NgramDrafter(2, 1), n_max=n_max, stats=st,
                                               constraint=g.constraint(engine.tokenizer)) for t in e.tokens]
            assert spec == plain, (params, n_max)
            drafted += st.spec.drafted
    assert drafted > 0  # the drafter proposed, under the grammar, and verification kept the output


# ---- through the server ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("serve-grammar"), "-np", "2", "-c", "512",
                      "--spec-draft-n-max", "4", "--spec-ngram-size", "2", "--temp", "0")
    yield s
    s.close()


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=120)


def _stream(srv, path, body):
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_json_schema_validates_and_is_the_same_with_and_without_speculation(oai, stream):
    msgs = [{"role": "user", "content": ASK_PERSON}]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    texts, drafted = [], []
    for extra in ({}, {"speculative.n_max": 0}, {"temperature": 0.8, "seed": 2},
                  {"temperature": 0.8, "seed": 2, "speculative.n_max": 0}):
        kw = dict(model="x", messages=msgs, max_tokens=60, response_format=rf, extra_body=extra)
        if stream:
            chunks = list(oai.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            r = oai.chat.completions.create(**kw)
            text, finish = r.choices[0].message.content, [r.choices[0].finish_reason]
            drafted.append(r.model_extra["timings"]["draft_n"])
        assert finish == ["stop"] and conforms(json.loads(text), PERSON), text
        texts.append(text)
    assert texts[0] == texts[1] and texts[2] == texts[3]
    assert stream or (drafted[0] > 0 and drafted[2] > 0 and drafted[1] == drafted[3] == 0)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/completion"])
def test_json_object_on_every_endpoint(srv, path):
    prompt = 'Reply with a JSON object with keys "city" and "country" for Paris.'
    if "chat" in path:
        body = {"messages": [{"role": "user", "content": prompt}]}
    else:
        body = {"prompt": f"<start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"}
    body.update({"max_tokens": 40, "response_format": {"type": "json_object"}})
    r = _post(srv, path, body).json()
    if path == "/completion":
        text, done = r["content"], r["stop_type"] == "eos"
    else:
        c = r["choices"][0]
        text, done = c.get("text", c.get("message", {}).get("content")), c["finish_reason"] == "stop"
    assert done and isinstance(json.loads(text), dict), r


@pytest.mark.parametrize("path", ["/completion", "/v1/completions", "/v1/chat/completions"])
def test_llama_server_grammar_and_json_schema_fields(srv, path):
    chat = "chat" in path
    base = {"messages": [{"role": "user", "content": "How often? Answer."}]} if chat else {"prompt": "Q: How often?\nA:"}
    base["max_tokens" if path.startswith("/v1") else "n_predict"] = 30
    whole = _post(srv, path, {**base, "grammar": GBNF}).json()
    chunks = _stream(srv, path, {**base, "grammar": GBNF, "speculative.n_max": 0})
    if path == "/completion":
        text, streamed = whole["content"], "".join(c["content"] for c in chunks)
        assert whole["stop_type"] == "eos" and chunks[-1]["stop_type"] == "eos"
    else:
        key = (lambda c: c["delta"].get("content") or "") if chat else (lambda c: c["text"])
        text = whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"]
        streamed = "".join(key(c["choices"][0]) for c in chunks if c["choices"])
        assert whole["choices"][0]["finish_reason"] == "stop"
    assert GBNF_RE.fullmatch(text) and streamed == text, (text, streamed)
    r = _post(srv, path, {**base, "json_schema": YES_NO}).json()
    text = r["content"] if path == "/completion" else (r["choices"][0]["message"]["content"] if chat
                                                       else r["choices"][0]["text"])
    assert conforms(json.loads(text), YES_NO), text


@pytest.mark.parametrize("extra,field,needle", [
    ({"response_format": {"type": "nonsense"}}, "response_format", "json_object"),
    ({"response_format": "json"}, "response_format", "object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "json_schema", "nope"),
    ({"grammar": 'root ::= "a'}, "grammar", "end of input"),
    ({"grammar": 'x ::= "a"'}, "grammar", "root"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "json_schema", "grammar"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/completion"])
def test_bad_constraints_are_400s_naming_the_field(srv, path, extra, field, needle):
    body = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
    r = _post(srv, path, {**body, **extra})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert field in msg and needle in msg, msg
