"""Environments of multi-turn episodes (docs/agentic.md): the interface, tool calls, the shipped ones."""
