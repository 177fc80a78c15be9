"""Generator processes: lease prompts, sample groups with vLLM, score, push over ZeroMQ."""
