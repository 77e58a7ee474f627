"""Rollout: multi-turn episodes, token-in/token-out trajectories, inference engines."""
