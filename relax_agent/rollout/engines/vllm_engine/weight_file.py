"""The weight-file handover from :class:`~relax_agent.rollout.engines.vllm_engine.VLLMEngine` to its
server: the model folder the server starts from, and each new version written as one safetensors
file (in shared memory, ``engine.vllm.weights_dir``) that the server reloads between two steps.

This is the engine's own hop from its process to the server it runs, after a weight-sync transport
(:mod:`relax_agent.weights`) has delivered the tensors to ``load_weights``: the file holds every
checkpoint tensor (a partial update is merged with the version served now), under the checkpoint's
names (transformers 5 saves an MoE's fused experts per expert), cast to the engine dtype, and the
server, which cannot import relax_agent, reads it with plain ``safetensors``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from relax_agent.errors import WeightSyncError
from relax_agent.weights.digest import TensorDigest, tensor_digest

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def save_model(model: Any, out: Path,
               dtype: torch.dtype) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], set[str]]:
    """Save ``model`` in ``dtype`` as the server's model folder ``out``; (layout: name -> (shape, dtype)
    of its ``state_dict``, names in the file)."""
    from safetensors import safe_open

    state = model.state_dict()
    layout = {name: (tuple(t.shape), dtype) for name, t in state.items()}
    model.save_pretrained(out, state_dict={name: t.detach().to(dtype) for name, t in state.items()})
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    return layout, names


def write_version(path: Path, state_dict: Mapping[str, Any], current_file: Path, file_names: set[str],
                  dtype: torch.dtype, to_checkpoint: Any) -> dict[str, tuple[str, torch.Tensor]]:
    """Write every checkpoint tensor (``state_dict`` values, the rest from ``current_file``, the version
    served now, whose tensors are ``file_names``) to ``path`` in ``dtype``;
    returns checkpoint name -> (the ``state_dict`` name it came from, or "" for a renamed one, the
    tensor written) for the tensors taken from ``state_dict``.

    ``state_dict`` has the model's names; they are turned into the checkpoint's names first, as
    ``save_pretrained`` does (transformers 5 un-fuses MoE experts: ``mlp.experts.gate_up_proj``
    [E, 2I, H] is saved as ``mlp.experts.{e}.gate_proj.weight`` and ``up_proj.weight``) by ``to_checkpoint``
    (:func:`checkpoint_renamer`; None: the names are the checkpoint's)."""
    from safetensors import safe_open

    given = state_dict
    if to_checkpoint is not None:
        state_dict = to_checkpoint(dict(state_dict))
    missing = sorted(file_names - set(state_dict))
    with safe_open(str(current_file), framework="pt") as current:
        tensors = [(n, state_dict[n]) for n in sorted(file_names) if n in state_dict]
        sent = {n: (n if n in given else "", t) for n, t in tensors}
        tensors += [(n, current.get_tensor(n)) for n in missing]
        write_safetensors(path, [(n, t.detach().to("cpu", dtype).contiguous()) for n, t in tensors])
    return sent


def file_digests(written: Mapping[str, tuple[str, torch.Tensor]], expected: Mapping[str, TensorDigest],
                 dtype: torch.dtype) -> dict[str, list[Any]]:
    """The ``expected`` body of ``/load_weights``: per checkpoint name, the digest of what was sent
    (``expected`` under its state_dict name), or for a tensor the checkpoint renames (MoE experts
    split per expert), the digest of the tensor written (cast to the engine ``dtype``), with the
    same sample count."""
    samples = next(iter(expected.values())).samples if expected else 0
    out = {}
    for name, (source, tensor) in written.items():
        if source and source in expected:
            out[name] = expected[source].to_json()
        elif samples:
            out[name] = tensor_digest(tensor, dtype if tensor.is_floating_point() else None, samples).to_json()
    return out


def checkpoint_renamer(model: Any) -> Any:
    """A function from ``model``'s state_dict names to its checkpoint's (transformers' reverse weight
    conversion, which ``save_pretrained`` applies), or None where transformers has none. It keeps an
    empty meta-device copy of the model, not its weights."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5: checkpoints use the state_dict names
        return None
    with torch.device("meta"):
        shell = type(model)(model.config)
    if getattr(model, "_weight_conversions", None) is not None:  # how from_pretrained loaded it
        shell._weight_conversions = model._weight_conversions
    return lambda state_dict: dict(revert_weight_conversion(shell, state_dict))


def write_safetensors(path: Path, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Write ``(name, tensor)`` pairs as one safetensors file, byte for byte from each tensor.

    Unlike ``safetensors.torch.save_file`` this accepts tensors that share storage (views
    into one received buffer); the format is an 8-byte little-endian header length, a
    JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` padded with
    spaces to 8 bytes, then the tensors' bytes in header order.

    Raises:
        WeightSyncError: a dtype other than fp32/bf16/fp16.
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors:
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise WeightSyncError(f"load_weights: {name} has dtype {t.dtype}; expected fp32, bf16 or fp16")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, t in tensors:
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
    os.replace(tmp, path)
