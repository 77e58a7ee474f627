"""Omni-modal policies: content parts -> processor inputs, media tokens, media on the bus.

- :mod:`~relax_agent.multimodal.parts`: building and decoding image / audio / video content parts;
- :mod:`~relax_agent.multimodal.processor`: the model family (placeholder ids, patching) and the
  processor that turns one part into features and its placeholder-token count;
- :mod:`~relax_agent.multimodal.render`: token-in/token-out rendering that processes each new
  message's media once and expands its placeholders (the env driver,
  :mod:`relax_agent.rollout.env_driver`, plays media episodes with it and records media beside tokens);
- :mod:`~relax_agent.multimodal.batch`: media in training batches and the trainer's forward.

The HF engine serves a multimodal policy with media (:mod:`relax_agent.rollout.engines.hf.media`).

The per-sample record is :class:`relax_agent.records.MediaInputs` (the bus field ``media``).
"""

from relax_agent.multimodal.parts import audio_part, image_part, video_part
from relax_agent.multimodal.processor import FAMILIES, MediaFamily, MediaProcessor, check_placeholders

__all__ = ["FAMILIES", "MediaFamily", "MediaProcessor", "audio_part", "check_placeholders", "image_part", "video_part"]
