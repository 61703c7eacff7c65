"""LLM.chat renders conversations with the chat template, as vLLM's does."""

from __future__ import annotations

import pytest

from shardline import LLM, SamplingParams
from shardline.engine.inputs.chat import ChatRenderError
from shardline.engine.model.tiny import build_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
HELLO = [{"role": "user", "content": "hello"}]


def test_chat_equals_generate_on_the_rendered_prompt(tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    expected_ids = tokenizer(
        tokenizer.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    ).input_ids
    [single] = tiny_llm.chat(HELLO, GREEDY, use_tqdm=False)
    both = tiny_llm.chat([HELLO, [{"role": "user", "content": "bye"}]], GREEDY, use_tqdm=False)
    [generated] = tiny_llm.generate({"prompt_token_ids": expected_ids}, GREEDY, use_tqdm=False)
    assert single.prompt_token_ids == expected_ids == both[0].prompt_token_ids
    assert single.outputs[0].token_ids == generated.outputs[0].token_ids
    assert tokenizer.decode(expected_ids).endswith("<|assistant|>")
    assert len(both) == 2 and both[1].prompt_token_ids != expected_ids


def _prompt_text(llm, messages, **options):
    [output] = llm.chat(messages, GREEDY, use_tqdm=False, **options)
    return llm.get_tokenizer().decode(output.prompt_token_ids)


def test_chat_template_override_and_generation_prompt(tiny_llm):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}" \
               "{% if add_generation_prompt %}[assistant]{% endif %}"
    assert _prompt_text(tiny_llm, HELLO, chat_template=template) == "[user] hello\n[assistant]"
    assert _prompt_text(tiny_llm, HELLO, chat_template=template, add_generation_prompt=False) == "[user] hello\n"


def test_continue_final_message(tiny_llm):
    messages = HELLO + [{"role": "assistant", "content": "Hi th"}]
    text = _prompt_text(tiny_llm, messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|assistant|>Hi th")
    with pytest.raises(ValueError, match="continue_final_message"):
        tiny_llm.chat(messages, GREEDY, use_tqdm=False, continue_final_message=True)


def test_tools_and_template_kwargs_reach_the_template(tiny_llm):
    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{% endif %}"
                "{% if enable_thinking %}THINK{% endif %}{{ messages[0]['content'] }}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text = _prompt_text(tiny_llm, HELLO, chat_template=template, tools=tools,
                        chat_template_kwargs={"enable_thinking": True})
    assert text == "TOOLS:get_weather;THINKhello"


@pytest.mark.parametrize("content_format,expected", [("string", "a\nb"), ("openai", "a|b|")])
def test_content_formats(tiny_llm, content_format, expected):
    template = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
                "{% else %}{% for p in m['content'] %}{{ p['text'] }}|{% endfor %}{% endif %}{% endfor %}")
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert _prompt_text(tiny_llm, messages, chat_template=template,
                        chat_template_content_format=content_format) == expected


def test_auto_content_format_detects_part_iterating_templates(tiny_llm):
    parts_template = "{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}{% endfor %}"
    assert _prompt_text(tiny_llm, HELLO, chat_template=parts_template) == "<hello>"
    assert _prompt_text(tiny_llm, [{"role": "user", "content": [{"type": "text", "text": "x"}]}]) \
        == "<|bos|><|user|>x<|end|><|assistant|>"


def test_malformed_conversation_names_its_index(tiny_llm):
    with pytest.raises(ChatRenderError, match="conversation 1"):
        tiny_llm.chat([HELLO, [{"content": "no role"}]], GREEDY, use_tqdm=False)
    with pytest.raises(ChatRenderError, match="conversation 0.*refused"):
        tiny_llm.chat([HELLO], GREEDY, use_tqdm=False, chat_template="{{ raise_exception('refused') }}")
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_structured_delimiters_are_kept_when_thinking(tmp_path):
    model_dir = build_tiny_model(tmp_path / "m", "llama", extra_special_tokens=["<think>", "</think>"])
    llm = LLM(str(model_dir), dtype="float64")
    think_id = llm.get_tokenizer().convert_tokens_to_ids("<think>")
    assert think_id >= 512
    params = SamplingParams(max_tokens=2, logit_bias={think_id: 100.0}, ignore_eos=True)
    [kept] = llm.chat(HELLO, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": True})
    [plain] = llm.chat(HELLO, params, use_tqdm=False)
    assert kept.outputs[0].text == "<think> <think>"
    assert plain.outputs[0].text == ""
