"""Preflight of the weight-sync and data-bus sections per mode: refused or warned before any model loads."""

from __future__ import annotations

import warnings

import pytest

from relax_agent.config import load_config
from relax_agent.errors import ConfigError
from relax_agent.preflight import check_mode, preflight
from relax_agent.roles import start_data_bus


def test_async_with_nccl_on_cpu_is_refused_naming_the_value_and_the_device():
    cfg = load_config(None, ["mode=async", "weights.transport=nccl", "run.device=cpu"])
    with pytest.raises(ConfigError, match=r"weights.transport='nccl' with mode=async: run.device resolves to 'cpu'"):
        preflight(cfg)


def test_async_with_nccl_is_refused_on_cuda_too_since_the_engine_is_in_process():
    cfg = load_config(None, ["mode=async", "weights.transport=nccl"])
    with pytest.raises(ConfigError, match="engine shares the trainer's process; use weights.transport=tcp"):
        check_mode(cfg, "cuda")


def test_colocate_warns_naming_the_weights_keys_it_ignores():
    cfg = load_config(None, ["weights.transport=tcp", "weights.bucket_mb=8"])
    with pytest.warns(UserWarning, match="mode=colocate ignores") as record:
        check_mode(cfg, "cpu")
    message = str(record[0].message)
    assert "weights.transport='tcp'" in message and "weights.bucket_mb=8" in message, message


def test_colocate_uses_the_data_bus_keys_without_a_warning():
    cfg = load_config(None, ["data.backend=ray", "data.lease_timeout_s=30"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_mode(cfg, "cpu")
    assert start_data_bus(load_config(None, [])) is False  # the local bus needs no Ray


def test_default_colocate_and_async_with_tcp_pass_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_mode(load_config(None, []), "cpu")
        check_mode(load_config(None, ["mode=async", "weights.transport=tcp", "data.backend=ray"]), "cpu")
