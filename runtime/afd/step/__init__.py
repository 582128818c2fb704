"""What describes one step, below every layer that builds or reads it: its sequences (`layout`: `SeqLayout`), their
split into micro-batches (`stages`: `StagePolicy`), and its host-built inputs sent to the device (`host_copy`)."""
