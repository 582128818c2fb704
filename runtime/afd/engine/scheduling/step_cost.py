"""What one engine step costs, learned from the engine's own steps, and the prefill cap it implies.

Running decodes see one inter-token gap per step, so a step that also prefills 2,000 prompt
tokens is a gap several times the usual one. `PrefillPacer` caps the prompt tokens of a step
that has decodes, so that its predicted time stays within `itl_ratio` × the predicted time of
the decode-only step (aiming at `AIM` of that, so that the steps it mispredicts stay within it
too). It learns two curves: decode-only steps by batch (graph replays) and
steps with prompt tokens by token count (a different, costlier kind: one curve through both
would draw a slope from a 7 ms batch-1 replay to a 14 ms step of 150 tokens). The cap is never
below `min_tokens` (prompts always progress), nor below the deadline floor: every waiting prompt
gets its first token within `backlog_steps` steps of being queued, so when prompts arrive faster
than the cap lets them in, the time to first token stays bounded and the steps grow as much as
the load needs. Where no prompt chunk is known to fit the ratio (beside a few decodes whose
replayed step is short, or before any decode-only step was timed) while as many requests wait for
their first token as are decoding (a burst of new prompts), no cap: there a cap would only starve
the burst, and one long gap for the few decoding streams buys a first token for as many or more.

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
BACKLOG_STEPS = 64  # every prompt is in within 64 steps of being queued (AFD_PREFILL_BACKLOG_STEPS)
AIM = 0.75  # the cap aims at this share of the ratio: predictions err, and the ratio is a bound on the gaps users see


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


def deadline_floor(backlog: list[tuple[int, int]], steps: int) -> int:
    """Prompt tokens a step must take so that each prompt of `backlog` ((tokens left, steps since it was
    queued), oldest first, served in that order) is in within `steps` steps of being queued (pure)."""
    need, ahead = 0, 0
    for tokens, waited in backlog:
        ahead += tokens
        need = max(need, -(-ahead // max(1, steps - waited)))
    return need


class PrefillPacer:
    """The prompt tokens a step with running decodes may take, so the decodes' inter-token gap stays
    within `itl_ratio` × a decode-only step's."""

    def __init__(self, itl_ratio: float, min_tokens: int = MIN_PREFILL_TOKENS, cost: StepCostModel | None = None,
                 backlog_steps: int = BACKLOG_STEPS, decode_cost: StepCostModel | None = None):
        self.itl_ratio = itl_ratio  # below 1: only the floors below next to decodes
        self.min_tokens = min_tokens
        self.backlog_steps = backlog_steps
        self.cost = cost or StepCostModel()  # steps with prompt tokens, by token count
        self.decode_cost = decode_cost or StepCostModel()  # decode-only steps, by batch
        self.last_cap: int | None = None  # the last cap asked for (a metric); None: uncapped

    def observe(self, tokens: int, seconds: float, prompt: bool = True) -> None:
        """A step of `tokens` took `seconds`; `prompt`: it held prompt tokens (else it only decoded)."""
        (self.cost if prompt else self.decode_cost).observe(tokens, seconds)

    def prefill_cap(self, decodes: int, backlog: list[tuple[int, int]] = ()) -> int | None:
        """Prompt tokens for a step next to `decodes` decoding requests while the prompts of `backlog` ((tokens
        left, steps since queued), oldest first) wait; None: no limit (no decodes, no cost a step could reach,
        or a burst that no chunk is known to fit beside the decodes: see the module)."""
        if not decodes:
            self.last_cap = None
            return None
        decode_only = self.decode_cost.predict(decodes)
        limit = None if decode_only is None else AIM * self.itl_ratio * decode_only
        shortest = self.cost.predict(decodes + self.min_tokens)
        floor = max(self.min_tokens, deadline_floor(backlog, self.backlog_steps))
        if limit is not None and shortest is not None and shortest <= limit:
            total = self.cost.tokens_within(limit)
            cap = None if math.isinf(total) else max(floor, int(total) - decodes)
        elif len(backlog) >= decodes and self.itl_ratio >= 1:
            cap = None  # a burst: no chunk known to fit beside these decodes
        else:
            cap = floor
        self.last_cap = cap
        return cap
