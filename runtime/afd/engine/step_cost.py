"""What one engine step costs, learned from the engine's own steps, and the prefill cap it implies.

Running decodes see one inter-token gap per step, so a step that also prefills 2,000 prompt
tokens is a gap several times the usual one. `PrefillPacer` caps the prompt tokens of a step
that has decodes, so that its predicted time stays within `itl_ratio` × the predicted time of
the decode-only step; but never below `min_tokens` (prompts always progress), nor below
1/`backlog_steps` of the prompt tokens waiting: when prompts arrive faster than the cap lets them
in, the backlog (and so the time to first token, about `backlog_steps` steps) stays bounded
instead of growing while the batch empties, and the steps grow as much as the load needs. Where
no prompt chunk fits the ratio (a few decodes, short graph-replayed steps) while as many requests
wait for their first token as are decoding (a burst of new prompts), no cap.

The prediction is `StepCostModel`: a monotone piecewise-linear curve, seconds against the
step's token count, through the medians of the last steps in each half-octave of token counts
(made non-decreasing by weighted isotonic regression). Medians shrug off the odd slow step (a
collection, a first compile, a busy host); buckets keep the rare large steps from being drowned by
the frequent decode-only ones; and a curve, unlike one straight line, follows a step time that is
flat while the device is launch-bound and then rises (or jumps where decode graphs end). Until two
buckets hold `min_samples` steps each, every bucket's median counts, however few steps it holds: a
run's first prompt step and the first capped step beside decodes already give a curve (a pacer that
waited for more would cap every step to the floors while a burst of prompts waits, and capped steps
all fall in one bucket: it would never learn). With steps of one size only, no prediction, and a step
beside decodes takes only the floors.
`StepClock` gives each step's own duration in a loop that runs one step ahead.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

MIN_PREFILL_TOKENS = 32  # prompt tokens a capped step still takes (2 KV blocks of 16)
BACKLOG_STEPS = 64  # a capped step still takes 1/64 of the prompt tokens waiting (AFD_PREFILL_BACKLOG_STEPS)


class StepClock:
    """Each step's own wall time, from host timestamps of a loop that launches step N+1 before waiting for N.

    A step is *ready* when its result is: at the end of the host's wait for it if that wait
    blocked (the device was still running it), else when its launch returned (it ran inside the
    launch: a CPU step, or a zmq link that waits layer by layer). It ran from its launch, or from
    when the step before it was ready if later (a device runs them one after the other), until
    it was ready. The simpler `drain time - launch time` counts the next step too on a
    synchronous device, and the one before too on a busy asynchronous one.
    """

    def __init__(self, blocked_s: float = 2e-4):
        self.blocked_s = blocked_s  # a wait longer than this blocked on the step
        self.previous_ready = -math.inf

    def done(self, started: float, launched: float, wait_from: float, waited: float) -> float:
        """Seconds the step ran: its launch began at `started` and returned at `launched`; the host waited for
        its result from `wait_from` to `waited` (the link and the copy to the host, not the reading)."""
        ready = waited if waited - wait_from > self.blocked_s else launched
        seconds = ready - max(started, self.previous_ready)
        self.previous_ready = ready
        return max(seconds, 0.0)


class StepCostModel:
    """Step seconds as a function of the step's token count, from the recent measured steps."""

    def __init__(self, per_bucket: int = 16, min_samples: int = 3, horizon: int = 1024):
        self.per_bucket = per_bucket  # recent steps kept per bucket
        self.min_samples = min_samples  # steps a bucket needs before its median counts
        self.horizon = horizon  # a step older than this many steps no longer counts (load and contexts change)
        self._steps = 0
        self._buckets: dict[int, deque[tuple[int, int, float]]] = {}
        self._curve: list[tuple[float, float]] | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds > 0:
            return
        self._steps += 1
        bucket = round(2 * math.log2(tokens))  # half-octaves: 64 and 90 apart, 2048 and 2900 apart
        self._buckets.setdefault(bucket, deque(maxlen=self.per_bucket)).append((self._steps, tokens, seconds))
        self._curve = None

    def curve(self) -> list[tuple[float, float]]:
        """(tokens, seconds) points, tokens increasing, seconds never falling; fewer than two: nothing can be predicted."""
        if self._curve is None:
            recent = [[(t, s) for step, t, s in self._buckets[bucket] if step > self._steps - self.horizon]
                      for bucket in sorted(self._buckets)]
            full = [steps for steps in recent if len(steps) >= self.min_samples]
            if len(full) < 2:  # still learning: every bucket's median counts, however few steps it holds
                full = [steps for steps in recent if steps]
            self._curve = _monotone([(statistics.median(t for t, _ in steps), statistics.median(s for _, s in steps),
                                      len(steps)) for steps in full])
        return self._curve

    def predict(self, tokens: float) -> float | None:
        """Seconds of a step of `tokens` (flat below the smallest known step, extrapolated above the largest)."""
        points = self.curve()
        if len(points) < 2:
            return None
        if tokens <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if tokens <= x1:
                return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        x, y = points[-1]
        return y + _tail_slope(points) * (tokens - x)

    def tokens_within(self, seconds: float) -> float | None:
        """The most tokens a step may hold and still be predicted to take at most `seconds` (inf: no limit known)."""
        points = self.curve()
        if len(points) < 2:
            return None
        if seconds < points[0][1]:
            return 0.0
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if seconds < y1:
                return x0 + (x1 - x0) * (seconds - y0) / (y1 - y0)
        x, y = points[-1]
        slope = _tail_slope(points)
        return x + (seconds - y) / slope if slope > 0 else math.inf


def _monotone(points: list[tuple[float, float, int]]) -> list[tuple[float, float]]:
    """(tokens, seconds) with the seconds of (tokens, seconds, steps) made non-decreasing the least-squares way
    (pool adjacent violators, weighted by steps): a noisy bucket of few steps is averaged into its neighbours
    instead of lifting, or lowering, the whole curve."""
    blocks: list[list[float]] = []  # [seconds, weight, points pooled]
    for _, seconds, weight in points:
        blocks.append([seconds, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (s2, w2, n2), (s1, w1, n1) = blocks.pop(), blocks[-1]
            blocks[-1] = [(s1 * w1 + s2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    seconds = [value for value, _, count in blocks for _ in range(int(count))]
    return [(tokens, value) for (tokens, _, _), value in zip(points, seconds)]


def _tail_slope(points: list[tuple[float, float]]) -> float:
    """Seconds per token past the largest known step: the steeper of the last segment and the whole
    chord, so that an extrapolation errs toward smaller prefill chunks."""
    (x0, y0), (xa, ya), (xb, yb) = points[0], points[-2], points[-1]
    return max((yb - ya) / (xb - xa), (yb - y0) / (xb - x0))


class PrefillPacer:
    """The prompt tokens a step with running decodes may take, so the decodes' inter-token gap stays
    within `itl_ratio` × a decode-only step's."""

    def __init__(self, itl_ratio: float, min_tokens: int = MIN_PREFILL_TOKENS, cost: StepCostModel | None = None,
                 backlog_steps: int = BACKLOG_STEPS):
        self.itl_ratio = itl_ratio  # below 1: only the floors below next to decodes
        self.min_tokens = min_tokens
        self.backlog_steps = backlog_steps
        self.cost = cost or StepCostModel()
        self.last_cap: int | None = None  # the last cap asked for (a metric); None: uncapped

    def observe(self, tokens: int, seconds: float) -> None:
        self.cost.observe(tokens, seconds)

    def prefill_cap(self, decodes: int, backlog: int = 0, prompts: int = 0) -> int | None:
        """Prompt tokens for a step next to `decodes` decoding requests while `prompts` requests with `backlog`
        prompt tokens wait to be prefilled; None: no limit. No limit without decodes, nor where no step could
        reach the limit, nor where not even `min_tokens` fit (beside a few decodes whose graph-replayed step is
        short, any step with a prompt chunk is over the ratio) while as many requests wait for their first token
        as are decoding: there a cap would only starve the prompts of a burst, and one long gap for the few
        decoding streams buys a first token for as many or more. Before steps of two sizes are timed, only
        the floors."""
        if not decodes:
            self.last_cap = None
            return None
        decode_only = self.cost.predict(decodes)
        total = None if decode_only is None else self.cost.tokens_within(self.itl_ratio * decode_only)
        floor = max(self.min_tokens, -(-backlog // self.backlog_steps))
        if total is None:
            cap = floor
        elif math.isinf(total):
            cap = None
        elif total - decodes < self.min_tokens and prompts >= decodes and self.itl_ratio >= 1:
            cap = None  # a burst beside a few short decode steps
        else:
            cap = max(floor, int(total) - decodes)
        self.last_cap = cap
        return cap
