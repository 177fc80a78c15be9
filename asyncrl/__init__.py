"""asyncrl: asynchronous actor-learner RL post-training for LLMs over message queues."""

__version__ = "0.1.0"
