"""Operator review and delivery: the web page (``web``), decisions, export, previews."""

LOOPBACK = ("127.0.0.1", "localhost", "::1")  # a server without a token binds to, and answers to, these names only
