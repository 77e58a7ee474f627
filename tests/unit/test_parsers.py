import pytest

from relax_agent.errors import ConfigError
from relax_agent.rollout.parsers import HermesParser, build_parser


def test_single_call_and_content():
    p = HermesParser().parse('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert p.content == "Sure."
    assert p.tool_calls == ({"id": "call_0", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},)
    assert p.errors == ()


def test_parallel_calls_string_arguments_and_unclosed_last_block():
    text = ('<tool_call>{"name": "a", "arguments": "{\\"k\\": \\"v\\"}"}</tool_call>'
            '<tool_call>{"name": "b", "parameters": {"n": 2}}')
    p = HermesParser().parse(text)
    assert [c["function"]["name"] for c in p.tool_calls] == ["a", "b"]
    assert p.tool_calls[0]["function"]["arguments"] == {"k": "v"}
    assert p.tool_calls[1]["function"]["arguments"] == {"n": 2}


def test_malformed_calls_are_reported_not_raised():
    p = HermesParser().parse('<tool_call>{"name": f}</tool_call><tool_call>[1]</tool_call>')
    assert p.tool_calls == ()
    assert len(p.errors) == 2 and "not valid JSON" in p.errors[0] and "string 'name'" in p.errors[1]
    assert p.message()["parse_errors"] == list(p.errors)


def test_no_call_is_plain_content():
    p = HermesParser().parse("The answer is 4.")
    assert p.message() == {"role": "assistant", "content": "The answer is 4.", "tool_calls": []}


def test_unknown_parser_name():
    with pytest.raises(ConfigError, match="rollout.tool_parser='nope'"):
        build_parser("nope")


def test_complete_json_without_closing_tag_parses_and_keeps_the_rest_as_content():
    text = '<tool_call>\n{"name": "math.factorial", "arguments": {"number": 5}}\n```\nmore text'
    p = HermesParser().parse(text)
    assert [c["function"]["name"] for c in p.tool_calls] == ["math.factorial"]
    assert p.tool_calls[0]["function"]["arguments"] == {"number": 5}
    assert p.content == "```\nmore text"


def test_truncated_json_is_an_error():
    p = HermesParser().parse('<tool_call>{"name": "f", "arguments": {"x": ')
    assert p.tool_calls == () and len(p.errors) == 1


def test_strict_mode_refuses_junk_after_the_call():
    junk = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}}}}}</tool_call}'
    assert [c["function"]["name"] for c in HermesParser().parse(junk).tool_calls] == ["f"]
    strict = build_parser("hermes_strict").parse(junk)
    assert strict.tool_calls == () and "instead of </tool_call>" in strict.errors[0]
    clean = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert len(build_parser("hermes_strict").parse(clean).tool_calls) == 1
    assert len(build_parser("hermes_strict").parse('<tool_call>{"name": "f", "arguments": {}}  ').tool_calls) == 1
