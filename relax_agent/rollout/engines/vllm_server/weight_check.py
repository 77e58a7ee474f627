"""Checks of a weight version in the server: the digest of each tensor as read from the version
file (:func:`verify_tensors`) and the weights the engine serves after the reload
(:func:`served_mismatches`).

A leaf module (stdlib at import, torch and vLLM inside the functions), so relax-agent's own venv
imports it too: its :func:`tensor_digest` must equal ``relax_agent.weights.digest.tensor_digest``.
"""

from typing import Any


class VerificationError(Exception):
    """A version's tensors, as the server read or serves them, differ from what the client sent."""


SERVED_COLUMNS = 8
"""Columns of each linear layer's weight read back exactly from the engine after every load."""
SERVED_ROW_STRIDE = 8
"""The random probe's output is compared on every this-many-th row (another set each version): the
expected side reads that share of each weight (7.5 % of a SmolLM2 fp32 sync measured, 21.5 % with
every row)."""
SERVED_RTOL = {"torch.float32": 1e-5, "torch.bfloat16": 1.6e-2, "torch.float16": 4e-3}
"""Bound on ``|served - expected| / sum_k |x_k w_nk|`` of the random probe, per dtype: 4 units in the last
place of a half type (the kernels round the output to it), ~60x the error measured for fp32's oneDNN."""


def served_mismatches(model: Any, read: dict[str, Any], tied: list[list[str]],
                      version: int) -> tuple[int, int, list[str]]:
    """Check the weights ``model`` serves against ``read`` (checkpoint name -> tensor of the version file,
    as read): ``(checkpoint tensors checked, engine parameters not checked, differences)``.

    vLLM fuses q/k/v and gate/up and, on CPU, repacks each linear weight into a kernel handle whose values
    cannot be read. So each linear layer (and the LM head) is run on a probe batch through its own
    ``quant_method.apply``: :data:`SERVED_COLUMNS` one-hot rows (``x = e_k``, so ``y = W[:, k]`` exactly in
    any accumulation order: the adjacent columns from ``8 * version mod K``, another block each version) and
    one seeded random row (``y = W x`` within :data:`SERVED_RTOL`, compared on the rows ``version mod 8``,
    ``+ 8``, ...: every element of those rows; all rows over 8 versions). Each slice
    of a fused output is compared with its checkpoint tensor (``packed_modules_mapping``; a tied head with
    the embedding). Plain parameters (norms, the embedding's lookup table, biases) are compared exactly
    (above 65536 elements on the probe's rows).
    Not checked: parameters without a checkpoint name of their own (an MoE's fused experts): counted.
    """
    import torch
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    alias = {n: next((o for o in group if o in read), None) for group in tied for n in group}

    def source(name: str) -> str | None:
        return name if name in read else alias.get(name)

    checked, unchecked, bad, probed = 0, 0, [], set()
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, (LinearBase, ParallelLMHead)):  # an embedding's table is compared below
                continue
            prefix, _, last = name.rpartition(".")
            parts = [f"{prefix}.{p}.weight" if prefix else f"{p}.weight" for p in packed.get(last, [last])]
            sources = [source(p) for p in parts]
            if None in sources:
                continue
            bad += _probe(module, [(p, read[s]) for p, s in zip(parts, sources, strict=True) if s is not None], version)
            checked += len(parts)
            probed.add(f"{name}.weight")
        for name, param in model.named_parameters():
            s = source(name)
            if s is None:
                unchecked += name not in probed
                continue
            if param.numel() == 0:
                continue
            want = read[s]
            got = param.detach()[: want.shape[0]] if param.shape[1:] == want.shape[1:] else param.detach()
            if tuple(got.shape) == tuple(want.shape) and want.dim() and want.numel() > 65536:
                rows = slice(version % SERVED_ROW_STRIDE, None, SERVED_ROW_STRIDE)  # as the probe's rows
                got, want = got[rows], want[rows]
            if tuple(got.shape) != tuple(want.shape) or not torch.equal(got.to("cpu", want.dtype), want):
                bad.append(f"{name}: the engine holds other values than the file's {s}")
            checked += 1
    return checked, unchecked, bad


def _probe(module: Any, parts: list[tuple[str, Any]], version: int) -> list[str]:
    """Differences between ``module``'s served output on the probe batch and each part's weight
    (see :func:`served_mismatches`)."""
    import torch

    k = int(parts[0][1].shape[1])
    if any(w.dim() != 2 or int(w.shape[1]) != k for _, w in parts):
        return [f"{parts[0][0]}: checkpoint shapes {[tuple(w.shape) for _, w in parts]} do not share an input size"]
    dtype = parts[0][1].dtype
    m = min(SERVED_COLUMNS, k)
    first = (version * m) % (k - m + 1)  # one cache line of each row: a block of adjacent columns
    cols = torch.arange(first, first + m)
    x = torch.zeros(len(cols) + 1, k, dtype=dtype)
    x[torch.arange(len(cols)), cols] = 1
    x[-1] = torch.randn(k, generator=torch.Generator().manual_seed(k)).to(dtype)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    y = module.quant_method.apply(module, x.to(device)).float().cpu()
    rtol = SERVED_RTOL.get(str(dtype), 1.6e-2)
    probe = x[-1].float()
    bad, offset = [], 0
    for name, w in parts:
        n = int(w.shape[0])
        got = y[:, offset:offset + n] if y.shape[-1] >= offset + n else None
        offset += n
        if got is None:
            bad.append(f"{name}: the engine's output has {y.shape[-1]} features, the checkpoint's weights {offset}")
            continue
        columns = w[:, first:first + m].float()
        differ = (got[:-1] != columns.T).nonzero()
        if len(differ):
            row, out = (int(v) for v in differ[0])
            bad.append(f"{name}: column {int(cols[row])} read back from the engine differs at {len(differ)} "
                       f"element(s), e.g. row {out}: served {got[row, out].item():.6g}, file "
                       f"{columns[out, row].item():.6g}")
            continue
        rows = slice(version % SERVED_ROW_STRIDE, n, SERVED_ROW_STRIDE) if n > SERVED_ROW_STRIDE else slice(0, n)
        sub = w[rows].float()  # a strided view (fp32: no copy)
        bound = rtol * (sub.abs() @ probe.abs()) + 1e-30
        err = ((got[-1, rows] - sub @ probe).abs() / bound).max().item()
        if err > 1.0:
            bad.append(f"{name}: the engine's output on a random probe is {err:.3g}x the {dtype} tolerance off "
                       f"what the file's weights give")
    return bad


def tensor_digest(tensor: Any, samples: int) -> list:
    """``[shape, dtype, sample hash, samples]`` of ``tensor``: the same digest as
    ``relax_agent.weights.digest.tensor_digest`` (this script cannot import relax_agent): CRC-32 of
    ``repr((shape, "torch.<dtype>"))``, then of the raw bytes of the sampled elements (all of them
    up to ``samples``; else ``samples // 16`` evenly spaced blocks of 16, then the last 16)."""
    import zlib

    import torch

    shape = tuple(int(d) for d in tensor.shape)
    crc = zlib.crc32(repr((shape, str(tensor.dtype))).encode())
    flat = tensor.detach().reshape(-1)
    numel = flat.numel()
    if numel:
        if numel <= samples:
            index = torch.arange(numel)
        else:
            blocks = max(1, samples // 16)
            starts = torch.arange(blocks) * (numel // blocks)
            index = torch.cat([(starts[:, None] + torch.arange(16)).reshape(-1), torch.arange(numel - 16, numel)])
        picked = flat.index_select(0, index.to(flat.device)).to("cpu").contiguous()
        crc = zlib.crc32(picked.view(torch.uint8).numpy(), crc)
    return [list(shape), str(tensor.dtype).removeprefix("torch."), f"{crc:08x}", samples]


def verify_tensors(tensors: list, expected: dict[str, list], version: int) -> None:
    """Compare the digest of each tensor named in ``expected`` with it.

    Raises:
        VerificationError: names the version and every tensor that differs or is missing.
    """
    held = dict(tensors)
    bad = []
    for name, want in expected.items():
        if name not in held:
            bad.append(f"{name}: not in the version file the server read")
            continue
        got = tensor_digest(held[name], int(want[3]))
        if got[:3] != [list(want[0]), want[1], want[2]]:
            bad.append(f"{name}: the server read shape {tuple(got[0])} {got[1]}, sample hash {got[2]}; "
                       f"sent {tuple(want[0])} {want[1]}, sample hash {want[2]}")
    if bad:
        raise VerificationError(f"version {version}: {len(bad)} tensor(s) differ from what was sent, the engine "
                                f"keeps serving its previous version (weights.verify): " + "; ".join(bad[:20]))
