"""The attention rank's serving engine: the step loop (`engine`), requests and their intake, step inputs and
outputs, and the offline batch; by concern below it: `scheduling`, `sampling`, `structured_output`, `text`
(tokenizer, detokenizer, stop strings) and `recovery` (a lost peer)."""
