"""What is learned: synthetic tasks, datasets, reward functions, reward models, evaluation."""
