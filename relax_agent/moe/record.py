"""Recording the experts a rollout engine's routers choose (the "record" half of R3).

Alignment: a sampled token ``t`` is scored by the forward pass at position ``t - 1`` (the
last prompt position for the first token of a turn, then each decode step). The routes
recorded for token ``t`` are those of *that* forward position, in every MoE layer, so the
trainer, which scores token ``t`` from position ``t - 1`` too, can replay exactly the
computation that produced the token's rollout log-prob (see :mod:`relax_agent.moe.replay`).
The text engine records only those positions (prompt and observations are context). The
HF engine serving a multimodal policy, which prefills the whole episode for every turn, also keeps its prefill's routes
(:meth:`RouteRecorder.start_collecting`): they go on the turn as ``context_routed_experts``, so
the context tokens, media tokens included, are replayed too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from relax_agent.moe.routers import Router, replay_routers, route_dtype


class RouteRecorder:
    """Keeps the expert indices every router chose in the model's latest forward pass.

    Forward hooks on the routers store each layer's ``indices`` [N, k] (N = rows x positions
    of that forward); :meth:`last_position` returns the routes of each row's last position.
    Between :meth:`start_collecting` and :meth:`stop_collecting` the hooks also keep every
    forward's indices (a one-row ``generate``: the prefill, then each decode step).
    Only the thread that runs the model's forward passes may use it.

    Args:
        routers: the model's MoE routers (:func:`~relax_agent.moe.routers.find_routers`).
    """

    def __init__(self, routers: Sequence[Router]) -> None:
        assert routers, "a RouteRecorder needs at least one router"
        self.routers = list(routers)
        self.dtype = route_dtype(max(r.num_experts for r in self.routers))
        self._torch_dtype = torch.from_numpy(np.empty(0, dtype=self.dtype)).dtype
        self._latest: list[torch.Tensor | None] = [None] * len(self.routers)
        self._history: list[list[torch.Tensor]] | None = None
        self._handles = [r.module.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, layer: int) -> Any:
        def record(_module: nn.Module, _args: Any, output: tuple[torch.Tensor, ...]) -> None:
            self._latest[layer] = output[2]
            if self._history is not None:
                self._history[layer].append(output[2].detach().to(self._torch_dtype))

        return record

    def start_collecting(self) -> None:
        """Keep the routes of every forward pass from now until :meth:`stop_collecting`."""
        self._history = [[] for _ in self.routers]

    def stop_collecting(self) -> np.ndarray | None:
        """[N, layers, top_k] the routes of every router row of every forward pass since
        :meth:`start_collecting`, in order (for one-row forwards: one row per sequence position,
        the prefill's positions first, then one per decode step); None when no forward ran.
        Stops collecting."""
        history, self._history = self._history, None
        if not history or not all(history):
            return None
        return torch.stack([torch.cat(layer) for layer in history], dim=1).cpu().numpy()

    def last_position(self, rows: int) -> np.ndarray:
        """[rows, layers, top_k] experts of each row's last position in the latest forward pass.

        The forward pass must have had ``rows`` rows with every row's last position real
        (left padding, as the HF engine pads).
        """
        latest = [t for t in self._latest if t is not None]
        assert len(latest) == len(self._latest), "no forward pass recorded yet"
        last = [t.view(rows, -1, t.shape[-1])[:, -1] for t in latest]
        return torch.stack(last, dim=1).to(self._torch_dtype).cpu().numpy()  # narrowed before the host copy

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def build_route_recorder(model: nn.Module) -> RouteRecorder | None:
    """A recorder on ``model``'s routers; None (with a warning) for a dense model.

    Raises:
        ConfigError: an MoE family without a router adapter (see
            :func:`~relax_agent.moe.routers.find_routers`).
    """
    routers = replay_routers(model)
    return RouteRecorder(routers) if routers else None


def stack_routes(per_token: Sequence[np.ndarray]) -> np.ndarray:
    """[n, layers, top_k] from n >= 1 per-token [layers, top_k] arrays."""
    assert per_token, "a generation has at least one token"
    return np.stack(per_token)
