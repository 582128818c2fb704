"""Structured outputs with llguidance: compiled grammars and a matcher per request, and each step's allowed-token
masks on the device."""
