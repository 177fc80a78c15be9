"""RL math on tensors: advantages, policy losses, loss aggregation, KL, rollout correction, sampling."""
