"""What `afd up` tells a user while it starts and answers its demo request (pure; `afd.local.up` prints it)."""

from __future__ import annotations

from pathlib import Path

RANDOM_WEIGHTS_NOTE = ("(the tiny demo model has random weights, so its text is noise: the request went the whole "
                       "AFD path; --model PATH serves a real checkpoint)")


class WaitReport:
    """What to say while attention ranks start: once at first, when one more is ready, after every
    `quiet_s` without news (with the time waited), and once all are ready; None otherwise."""

    def __init__(self, total: int, now: float, quiet_s: float = 30.0):
        self.total, self.start, self.quiet_s = total, now, quiet_s
        self.last_pending: int | None = None
        self.last_said = now

    def update(self, pending: int, now: float) -> str | None:
        if pending == self.last_pending and (not pending or now - self.last_said < self.quiet_s):
            return None
        first, self.last_pending, self.last_said = self.last_pending is None, pending, now
        waited = f"{now - self.start:.0f} s"
        if not pending:
            return None if first else f"all {self.total} attention rank(s) ready after {waited}"
        if first:
            return f"waiting for {pending} attention rank(s) to load, connect and warm up"
        return f"{self.total - pending} of {self.total} attention rank(s) ready, still waiting ({waited})"


def has_random_weights(model: str | Path, cache: Path) -> bool:
    """True for the demo checkpoint `afd up` makes without --model in `cache` (a tiny model, random weights)."""
    path = Path(model).resolve()
    return path.parent == Path(cache).resolve() and path.name.startswith("tiny-")


def demo_answer(reply: dict, model: str | Path, cache: Path) -> list[str]:
    """The lines that show the demo request's answer, saying so where the model's weights are random."""
    text = reply["choices"][0]["message"]["content"]
    lines = [f"demo request answered ({reply['usage']['completion_tokens']} tokens): {text!r}"]
    if has_random_weights(model, cache):
        lines.append(RANDOM_WEIGHTS_NOTE)
    return lines
