"""What processes share: wire schema, Redis keys and store, notifications, weight sync, security, retries, fleet rules, private torch APIs."""
