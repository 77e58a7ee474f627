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
    assert strict.tool_calls == () and "has no closing </tool_call>" in strict.errors[0]
    clean = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert len(build_parser("hermes_strict").parse(clean).tool_calls) == 1


@pytest.mark.parametrize("text", ['<tool_call>{"name": "f", "arguments": {}}  ',
                                  '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n',
                                  '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "f", "arguments": {}}'])
def test_strict_mode_refuses_a_final_block_without_its_closing_tag(text):
    """BFCL's handler reads an unclosed final block (a reply cut at the token limit) as no call."""
    strict = build_parser("hermes_strict").parse(text)
    assert [c["function"]["name"] for c in strict.tool_calls] == (["g"] if '"g"' in text else [])
    assert len(strict.errors) == 1 and "no closing </tool_call>" in strict.errors[0]
    assert strict.message()["parse_errors"] == list(strict.errors)
    assert [c["function"]["name"] for c in build_parser("hermes").parse(text).tool_calls][-1] == "f"


# ---------------------------------------------------------------- bare and fenced JSON
def _names(action) -> list[str]:
    return [c["function"]["name"] for c in action.tool_calls]


@pytest.mark.parametrize("name", ["json", "json_strict"])
def test_bare_json_call_and_list(name):
    parser = build_parser(name)
    one = parser.parse(' {"name": "math.factorial", "arguments": {"number": 5}} \n')
    assert one.tool_calls == ({"id": "call_0", "type": "function",
                               "function": {"name": "math.factorial", "arguments": {"number": 5}}},)
    assert one.content == "" and one.errors == ()
    many = parser.parse('[{"name": "a", "arguments": {"k": 1}}, {"name": "b", "parameters": "{\\"n\\": 2}"}]')
    assert _names(many) == ["a", "b"] and many.tool_calls[1]["function"]["arguments"] == {"n": 2}
    assert [c["id"] for c in many.tool_calls] == ["call_0", "call_1"]
    assert parser.parse("The answer is 42.").tool_calls == () and parser.parse("The answer is 42.").errors == ()


def test_bare_json_lenient_finds_calls_in_text_strict_does_not():
    text = 'Let me call it: {"name": "f", "arguments": {"x": 1}} and then {"name": "g", "arguments": {}}.'
    lenient = build_parser("json").parse(text)
    assert _names(lenient) == ["f", "g"] and lenient.content == "Let me call it:  and then ."
    strict = build_parser("json_strict").parse(text)
    assert strict.tool_calls == () and strict.errors == () and strict.content == text
    junk = build_parser("json_strict").parse('{"name": "f", "arguments": {}} trailing')
    assert junk.tool_calls == () and "trailing" in junk.errors[0]
    assert _names(build_parser("json").parse('{"name": "f", "arguments": {}} trailing')) == ["f"]


def test_bare_json_non_call_objects_are_content_and_broken_calls_errors():
    data = build_parser("json").parse('Result: {"temperature": 20}')
    assert data.tool_calls == () and data.errors == () and data.content == 'Result: {"temperature": 20}'
    broken = build_parser("json").parse('{"name": "f", "arguments": {"x": ')
    assert broken.tool_calls == () and "not valid JSON" in broken.errors[0]
    strict = build_parser("json_strict")
    assert "string 'name'" in strict.parse('{"temperature": 20}').errors[0]
    assert "not valid JSON" in strict.parse('[{"name": "f",').errors[0]
    assert "arguments" in strict.parse('{"name": "f", "arguments": [1]}').errors[0]


@pytest.mark.parametrize("name", ["json_fenced", "json_fenced_strict"])
def test_fenced_json_calls(name):
    text = 'I will look it up.\n```json\n{"name": "f", "arguments": {"x": 1}}\n```\nand\n```JSON\n[{"name": "g", "arguments": {}}]\n```'
    action = build_parser(name).parse(text)
    assert _names(action) == ["f", "g"] and action.errors == ()
    assert action.content == "I will look it up.\n\nand"
    code = build_parser(name).parse("Run this:\n```python\nprint({'name': 1})\n```")
    assert code.tool_calls == () and code.errors == () and "print" in code.content


def test_fenced_json_strictness():
    lenient, strict = build_parser("json_fenced"), build_parser("json_fenced_strict")
    untagged = '```\n{"name": "f", "arguments": {}}\n```'
    assert _names(lenient.parse(untagged)) == ["f"] and strict.parse(untagged).tool_calls == ()
    unclosed = '```json\n{"name": "f", "arguments": {}}'
    assert _names(lenient.parse(unclosed)) == ["f"] and strict.parse(unclosed).tool_calls == ()
    trailing = '```json\n{"name": "f", "arguments": {}} // the call\n```'
    assert _names(lenient.parse(trailing)) == ["f"]
    assert strict.parse(trailing).tool_calls == () and "// the call" in strict.parse(trailing).errors[0]
    broken = '```json\n{"name": "f", "arguments": \n```'
    for parser in (lenient, strict):
        action = parser.parse(broken)
        assert action.tool_calls == () and "not valid JSON" in action.errors[0]
        assert action.message()["parse_errors"] == list(action.errors)
    assert lenient.parse("```\nls -la\n```").errors == ()  # untagged non-JSON fences are code, not calls
    assert build_parser("json").parse("no JSON here").message() == {"role": "assistant", "content": "no JSON here",
                                                                     "tool_calls": []}
