"""Tool-call parsers of the popular policy families, one file per family.

Each parser follows :class:`relax_agent.rollout.parsers.ToolCallParser`: strict about what is a
call, parse errors returned as data (``ParsedAction.errors``, the env sees ``parse_errors``),
reasoning kept out of the content (``ParsedAction.reasoning``), and a ``format`` method that
writes calls the way the family's template does (demonstrations, tests).

=============  =====================================  ==========================  ==============
name           families                               call format                 reasoning
=============  =====================================  ==========================  ==============
qwen3          Qwen3, QwQ                             ``<tool_call>`` JSON        ``<think>``
qwen3_coder    Qwen3-Coder                            ``<function=..>`` XML       none
llama3         Llama 3.1 / 3.2 / 3.3                  JSON, ``<|python_tag|>``    none
mistral        Mistral, Nemo, Small, Devstral         ``[TOOL_CALLS]``            ``[THINK]``
gpt_oss        gpt-oss                                harmony ``functions.X``     analysis channel
deepseek_v3    DeepSeek V3 / V3.1 / R1                ``<｜tool▁calls▁begin｜>``  ``<think>``
glm45          GLM-4.5 / 4.6 / 4.7                    ``<arg_key>`` XML           ``<think>``
kimi_k2        Kimi K2                                ``<|tool_calls_section..``  ``<think>``
gemma          Gemma 4                                ``<|tool_call>call:``       thought channel
=============  =====================================  ==========================  ==============

``auto`` (:func:`~relax_agent.rollout.tool_parsers.auto.resolve_tool_parser`) picks one.
"""

from __future__ import annotations

from collections.abc import Callable

from relax_agent.rollout.tool_parsers.auto import resolve_tool_parser
from relax_agent.rollout.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from relax_agent.rollout.tool_parsers.gemma import GemmaParser
from relax_agent.rollout.tool_parsers.glm45 import Glm45Parser
from relax_agent.rollout.tool_parsers.gpt_oss import GptOssParser
from relax_agent.rollout.tool_parsers.kimi_k2 import KimiK2Parser
from relax_agent.rollout.tool_parsers.llama3 import Llama3JsonParser
from relax_agent.rollout.tool_parsers.mistral import MistralParser
from relax_agent.rollout.tool_parsers.qwen3 import Qwen3Parser
from relax_agent.rollout.tool_parsers.qwen3_coder import Qwen3CoderParser

FAMILY_PARSERS: dict[str, Callable[[], object]] = {
    "qwen3": Qwen3Parser,
    "qwen3_coder": Qwen3CoderParser,
    "llama3": Llama3JsonParser,
    "mistral": MistralParser,
    "gpt_oss": GptOssParser,
    "deepseek_v3": DeepSeekV3Parser,
    "glm45": Glm45Parser,
    "kimi_k2": KimiK2Parser,
    "gemma": GemmaParser,
}
"""Family parsers by their ``rollout.tool_parser`` name."""

__all__ = ["FAMILY_PARSERS", "DeepSeekV3Parser", "GemmaParser", "Glm45Parser", "GptOssParser", "KimiK2Parser",
           "Llama3JsonParser", "MistralParser", "Qwen3CoderParser", "Qwen3Parser", "resolve_tool_parser"]
