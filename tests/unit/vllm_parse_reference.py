"""Run under the vLLM venv's python: vLLM's own tool parser read each text (the reference for
``test_family_parsers_vs_vllm.py``). Not a test module; it imports nothing of relax_agent.

stdin: ``[{"parser": vLLM tool parser name, "reasoning": vLLM reasoning parser name or null,
"tools": [OpenAI tool schemas], "texts": [str]}]``; stdout (last line): one list per job of
``{"called": bool, "calls": [{"name", "arguments"}], "error": str}``, arguments decoded (an
exception of the parser is its ``error``). The reasoning parser, when named, splits the reply
first and the tool parser reads what it leaves as content. vLLM's parsers read special tokens
through ``tokenizer.get_vocab()`` only (for whole replies): a vocabulary that gives every token an
id stands in for the family's tokenizer.
"""

import json
import sys


class _Vocab(dict):
    def get(self, key, default=None):
        return self.setdefault(key, len(self) + 1000)

    def __getitem__(self, key):
        return self.get(key)

    def __contains__(self, key):
        return True


class _Tokenizer:
    vocab = _Vocab()

    def get_vocab(self):
        return self.vocab


def _read(job: dict, text: str) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=job["tools"] or None)
    if job.get("reasoning"):
        reasoner = ReasoningParserManager.get_reasoning_parser(job["reasoning"])(_Tokenizer())
        _, text = reasoner.extract_reasoning(text, request)
        text = text or ""
    parser = ToolParserManager.get_tool_parser(job["parser"])(_Tokenizer(), request.tools)
    info = parser.extract_tool_calls(text, request)
    calls = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in info.tool_calls]
    return {"called": bool(info.tools_called), "calls": calls if info.tools_called else [], "error": ""}


def main() -> None:
    out = []
    for job in json.load(sys.stdin):
        replies = []
        for text in job["texts"]:
            try:
                replies.append(_read(job, text))
            except Exception as exc:  # the reference failing on a text is a verdict too
                replies.append({"called": False, "calls": [], "error": f"{type(exc).__name__}: {exc}"[:300]})
        out.append(replies)
    print(json.dumps(out))

if __name__ == "__main__":
    main()
