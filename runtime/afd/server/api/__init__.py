"""The OpenAI-compatible HTTP API of an attention rank: the app, request bodies and their checks, response and
stream formatting, and the resume header a relay moves a stream with."""
