"""The proxy: a mitmproxy addon that enforces ``policy``, its runner, logs, metrics and the CLI."""
