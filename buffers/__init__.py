"""The buffer service: ZeroMQ ingest into Redis streams, the prompt feed and admission control."""
