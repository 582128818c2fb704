"""Which requests run in the next step and with how many tokens: admission, chunked prefill, the prefill pacer, and
a prompt's choices sharing its prefill."""
