"""Training: GRPO algorithms and trainer backends."""
