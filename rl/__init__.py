"""Reinforcement learning on answers a program can check: sampling, rewards and the policy-gradient loss
(docs/rl.md). Read only by a run whose config sets rl.task."""
