"""Chat templates (workers/chat.py) and the chat request schema (deployments/schemas.py): the plain transcript of
a checkpoint without a template, a checkpoint's own template (both places HF keeps it) rendered as transformers
renders it, template errors as the client's 400 or the checkpoint's load error, and a chat body becoming the
completion request the worker runs.

Run alone:  .venv/bin/python -P -m pytest tests/test_chat.py -q
"""

from __future__ import annotations

import json

import pytest

from rankserve.deployments.schemas import (ChatRequest, Choice, FamilyLimits, RequestError, chat_chunk_body,
                                           chat_completion_body, check_request, parse_request)
from rankserve.workers.chat import PLAIN_STOP, ChatError, ChatTemplate, read_chat_template
from rankserve.workers.checkpoint import CheckpointError

# A LLaMA-2-chat-like template: system folded into the first user turn, roles must alternate.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set sys = '' %}{% endif %}"
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + (sys if loop.first else '') + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}"
    "{% endfor %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Tell a story."}]
FAMILIES = {"svd-llm": FamilyLimits(max_tokens=256)}


def test_plain_transcript_without_a_template():
    t = ChatTemplate()
    assert t.render(MESSAGES) == "system: Be brief.\nuser: Hi\nassistant: Hello.\nuser: Tell a story.\nassistant:"
    assert t.render([{"role": "developer", "content": "x"}]) == "system: x\nassistant:"
    assert t.stop == PLAIN_STOP


def test_checkpoint_template_renders_as_transformers_does(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": LLAMA2, "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}))
    t = read_chat_template(tmp_path)
    assert (t.bos_token, t.eos_token, t.stop) == ("<s>", "</s>", ())
    ours = t.render(MESSAGES)  # the leading BOS is the engine's to add (as a token, not as the text "<s>")
    assert ours == "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello. </s><s>[INST] Tell a story. [/INST]"

    from transformers.utils.chat_template_utils import render_jinja_template  # transformers' own renderer

    theirs, _ = render_jinja_template(conversations=[MESSAGES], chat_template=LLAMA2, add_generation_prompt=True,
                                      bos_token="<s>", eos_token="</s>")
    assert "<s>" + ours == theirs[0]


def test_template_file_wins_and_named_templates(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ 1 + 1 }}"}]}))
    assert read_chat_template(tmp_path).render(MESSAGES) == "D2"
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{% endfor %}"
                                                  "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert read_chat_template(tmp_path).render(MESSAGES[1:2]) == "<user><assistant>"
    assert read_chat_template(tmp_path / "missing") == ChatTemplate()  # no tokenizer files: the plain transcript


def test_template_errors(tmp_path):
    t = ChatTemplate(LLAMA2, "<s>", "</s>")
    with pytest.raises(ChatError, match="roles must alternate"):  # the conversation's fault: a 400
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatError, match="sandbox"):  # a template reaching for Python internals is stopped
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(MESSAGES)
    with pytest.raises(ChatError, match="role"):
        ChatTemplate().render([{"role": "tool", "content": "x"}])

    with pytest.raises(ChatError, match="ZeroDivisionError"):  # any failure of the template's own code: a 400
        ChatTemplate("{{ 1 // (messages | length - 1) }}").render(MESSAGES[1:2])

    # the checkpoint's fault: found at load; chat is refused with the reason, the model still serves completions
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    broken = read_chat_template(tmp_path)
    assert "does not compile" in broken.error
    with pytest.raises(ChatError, match="unusable .*does not compile"):
        broken.render(MESSAGES)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_chat_template(tmp_path)


def test_what_transformers_templates_use():
    """Loop controls, `{% generation %}` blocks, tojson's keywords, the developer role read as system."""
    t = ChatTemplate("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                     "{% generation %}{{ m.role }}={{ m.content | tojson(ensure_ascii=False, sort_keys=True) }};"
                     "{% endgeneration %}{% endfor %}")
    assert t.render([{"role": "developer", "content": "é"}, {"role": "user", "content": "b"},
                     {"role": "user", "content": "c"}]) == 'system="é";user="b";'


def chat(**kw) -> ChatRequest:
    return parse_request({"model": "svd-llm", "messages": MESSAGES[1:2], **kw}, ChatRequest)


def test_chat_request_becomes_a_completion():
    r = chat(temperature=0, stop="\n\n", seed=3)
    check_request(r, FAMILIES)
    c = r.to_completion(ChatTemplate(), FAMILIES["svd-llm"])
    assert c.prompt == "user: Hi\nassistant:"
    assert c.max_tokens == 256  # chat runs to the family's limit unless told otherwise, as OpenAI's does
    assert c.stop == ["\n\n", *PLAIN_STOP] and (c.temperature, c.seed) == (0, 3)
    assert chat(max_completion_tokens=7).to_completion(ChatTemplate(), FAMILIES["svd-llm"]).max_tokens == 7
    parts = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert parts.to_completion(ChatTemplate(), FAMILIES["svd-llm"]).prompt == "user: ab\nassistant:"
    # the template's own stop strings don't count against the client's four
    four = chat(stop=["a", "b", "c", "d"]).to_completion(ChatTemplate(), FAMILIES["svd-llm"])
    assert four.stop == ["a", "b", "c", "d", *PLAIN_STOP]


@pytest.mark.parametrize("body, words", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0.tool_calls: unknown field"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "disagree"),
    ({"max_completion_tokens": 1.5}, "integer"),
    ({"stream_options": {"include_usage": True}}, "only allowed with stream"),
    ({"prompt": "x"}, "prompt: unknown field"),
])
def test_bad_chat_bodies(body, words):
    with pytest.raises(RequestError, match=words):
        chat(**body)


def test_huge_or_empty_conversations():
    big = "x" * 600_000
    with pytest.raises(RequestError, match="longer than"):  # refused before anything is rendered
        chat(messages=[{"role": "user", "content": big}, {"role": "user", "content": big}])
    empty = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(RequestError, match="empty prompt"):
        chat(messages=[{"role": "user", "content": ""}]).to_completion(empty, FAMILIES["svd-llm"])


def test_chat_over_the_limit_and_template_refusal():
    with pytest.raises(RequestError, match="above this model's limit"):
        check_request(chat(max_completion_tokens=257), FAMILIES)
    strict = ChatTemplate(LLAMA2, "<s>", "</s>")
    with pytest.raises(RequestError, match="messages: .*alternate") as e:
        chat(messages=[{"role": "assistant", "content": "x"}]).to_completion(strict, FAMILIES["svd-llm"])
    assert e.value.param == "messages"


def test_chat_response_shapes():
    body = chat_completion_body("chatcmpl-1", "svd-llm", [Choice("Hello", "stop")], 5, 2)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert body["usage"]["total_tokens"] == 7
    c = chat_chunk_body("chatcmpl-1", "svd-llm", {"content": "He"})
    assert c["object"] == "chat.completion.chunk" and c["choices"][0]["delta"] == {"content": "He"}


def test_a_saved_checkpoint_keeps_its_template(tmp_path):
    """Checkpoint writers (import, compress, train-parse) copy the template files with the tokenizer's."""
    from tiny_factorized import tiny_model

    from rankserve.workers.checkpoint import Manifest, save_checkpoint

    src = tmp_path / "src"
    src.mkdir()
    (src / "chat_template.jinja").write_text(LLAMA2)
    (src / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    out = save_checkpoint(tmp_path / "out", tiny_model(4), Manifest(family="test", ranks={}), tokenizer_dir=src)
    assert read_chat_template(out) == ChatTemplate(LLAMA2, "<s>", "</s>")


def test_logprobs_fields():
    t, lim = ChatTemplate(), FAMILIES["svd-llm"]
    assert chat(logprobs=True, top_logprobs=3).to_completion(t, lim).logprobs == 3
    assert chat(logprobs=True).to_completion(t, lim).logprobs == 0
    assert chat().to_completion(t, lim).logprobs is None
    for body, words in [({"top_logprobs": 2}, "needs logprobs"), ({"logprobs": True, "top_logprobs": 21}, "20"),
                        ({"logprobs": True, "top_logprobs": 1.5}, "integer")]:
        with pytest.raises(RequestError, match=words):
            chat(**body)
    ok = {"model": "svd-llm", "prompt": "x"}
    assert parse_request({**ok, "logprobs": 5}).sampling()["logprobs"] == 5
    assert parse_request(ok).sampling()["logprobs"] is None
    assert not parse_request({**ok, "stream": True, "stream_options": {"include_usage": None}}).include_usage
    assert parse_request({**ok, "stream": True, "stream_options": {"include_usage": True}}).include_usage
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(RequestError, match="logprobs"):
            parse_request({**ok, "logprobs": bad})


def test_logprobs_shapes():
    from rankserve.deployments.schemas import chat_logprobs, completion_logprobs

    entries = [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "offset": 0,
                "top": [("Hi", -0.5, [72, 105]), ("Yo", -1.5, [89, 111])]},
               {"token": "\ufffd", "logprob": -2.0, "bytes": [0xC3], "offset": 2, "top": [("\ufffd", -2.0, [0xC3])]}]
    c = completion_logprobs(entries)
    assert c == {"tokens": ["Hi", "\ufffd"], "token_logprobs": [-0.5, -2.0],
                 "top_logprobs": [{"Hi": -0.5, "Yo": -1.5}, {"\ufffd": -2.0}], "text_offset": [0, 2]}
    (first, second) = chat_logprobs(entries)["content"]
    assert first == {"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                     "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                                      {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]}]}
    assert second["bytes"] == [0xC3]  # half of "é": the token's own byte, as OpenAI gives it
