"""Trainer backends (torch; megatron at scale)."""
