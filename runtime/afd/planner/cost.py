"""A step-cost model of an AFD group fitted from measured windows, and its predictions (pure).

An attention rank's decode step of n tokens whose FFN rank sees m rows:

    step(n, m) = host(n) + attention(n) + send(n) + wait(n, m)
    wait       = ffn(m) + wire(n)                      with one stage
    wait       = max(0, ffn(m) - attention(n)) + wire(n)  with two (the FFN hides behind attention)

host is what the attention rank spends outside the layers (scheduling, sampling, the serving
loop); wire is the waiting that FFN compute does not explain (transfers). Each term is a line
in its token count, fitted by least squares over the windows; a term seen at one load only is
flat, and the model then says it cannot extrapolate.
"""

from __future__ import annotations

from dataclasses import dataclass

from afd.planner.samples import RankWindow
from afd.config.topology import Topology

MIN_SPREAD = 1.2  # loads count as different when the largest is this much above the smallest


@dataclass(frozen=True)
class Line:
    intercept: float
    slope: float
    varied: bool  # fitted over more than one load

    def __call__(self, x: float) -> float:
        return max(0.0, self.intercept + self.slope * x)

    @classmethod
    def fit(cls, points: list[tuple[float, float]], weights: list[float] | None = None) -> "Line":
        """Weighted least squares (weights: how many steps each point averages), slope never negative."""
        if not points:
            raise ValueError("a line needs at least one point")
        weights = weights or [1.0] * len(points)
        total = sum(weights)
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        mean_x = sum(w * x for w, x in zip(weights, xs)) / total
        mean_y = sum(w * y for w, y in zip(weights, ys)) / total
        if min(xs) <= 0 or max(xs) < MIN_SPREAD * min(xs):
            return cls(mean_y, 0.0, False)
        var = sum(w * (x - mean_x) ** 2 for w, x in zip(weights, xs))
        slope = max(0.0, sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(weights, xs, ys)) / var)
        return cls(mean_y - slope * mean_x, slope, True)


@dataclass(frozen=True)
class CostModel:
    host: Line
    attention: Line
    send: Line
    wire: Line
    ffn: Line
    stages: int
    generated_per_token: float  # tokens generated per token computed (1 in pure decode)

    @property
    def can_extrapolate(self) -> bool:
        return self.attention.varied and self.ffn.varied

    def wait(self, n: float, m: float) -> float:
        exposed = self.ffn(m) if self.stages == 1 else max(0.0, self.ffn(m) - self.attention(n))
        return exposed + self.wire(n)

    def step_seconds(self, n: float, m: float) -> float:
        return self.host(n) + self.attention(n) + self.send(n) + self.wait(n, m)

    def tokens_per_s(self, topology: Topology, concurrency: float) -> float:
        """Generated tokens/s of one group of `topology` holding `concurrency` decoding sequences."""
        n = concurrency / topology.num_attention
        m = concurrency / topology.num_ffn
        return self.generated_per_token * concurrency / self.step_seconds(n, m)

    def busy(self, topology: Topology, concurrency: float) -> dict[str, float]:
        """Share of a step each side computes: what the recommendation explains itself with."""
        n, m = concurrency / topology.num_attention, concurrency / topology.num_ffn
        step = self.step_seconds(n, m)
        return {"attention": self.attention(n) / step, "ffn": self.ffn(m) / step, "host": self.host(n) / step}


def fit_model(pairs: list[tuple[RankWindow, RankWindow]], ffn_windows: list[RankWindow], stages: int) -> CostModel:
    """Fit from (attention window, its FFN rank's window over the same time) pairs.

    Token counts are per step: an attention rank's tokens, and the FFN's rows per crossing layer
    (one FFN step may serve several attention ranks' rows, or one rank's alone).
    """
    if not pairs or not ffn_windows:
        raise ValueError("no window with profiled steps on both roles: send traffic and wait for profiled steps")
    scales = [profile_scale(a) for a, _ in pairs]
    weights = [a.profiled_steps for a, _ in pairs]
    attention_points, send_points, wire_points, host_points = [], [], [], []
    for (a, f), scale in zip(pairs, scales):
        parts = a.compute_s + a.send_s + a.wait_s
        exposed = f.compute_s if stages == 1 else max(0.0, f.compute_s - a.compute_s)
        attention_points.append((a.tokens_per_step, a.compute_s * scale))
        send_points.append((a.tokens_per_step, a.send_s * scale))
        wire_points.append((a.tokens_per_step, max(0.0, a.wait_s - exposed) * scale))
        host_points.append((a.tokens_per_step, max(0.0, a.step_s - parts * scale)))
    ffn = Line.fit([(w.tokens_per_step, w.compute_s * _ffn_scale(w, pairs, scales)) for w in ffn_windows],
                   [w.profiled_steps for w in ffn_windows])
    attention, send = Line.fit(attention_points, weights), Line.fit(send_points, weights)
    generated = sum(a.generated_per_step * a.steps for a, _ in pairs) / max(sum(a.tokens_per_step * a.steps for a, _ in pairs), 1e-9)
    return CostModel(Line.fit(host_points, [a.steps for a, _ in pairs]), attention, send, Line.fit(wire_points, weights),
                     ffn, stages, min(1.0, generated))


def profile_scale(a: RankWindow) -> float:
    """Ordinary step time ÷ what the attention rank's profiled step spent in its layers, at most 1.

    Profiled steps time every layer and run eagerly (no CUDA graphs: every kernel launched from
    the host), so on a GPU their layers take far longer than in the replayed steps around them.
    Their split (attention vs send vs waiting for the FFN) is kept; their level is brought down
    to the window's measured step. Below 1 only when the layers alone outlast a step; otherwise
    the rest of the step is host time.
    """
    parts = a.compute_s + a.send_s + a.wait_s
    return min(1.0, a.step_s / parts) if parts > 0 else 1.0


def _ffn_scale(w: RankWindow, pairs: list[tuple[RankWindow, RankWindow]], scales: list[float]) -> float:
    """The FFN computes in the same profiled steps as its attention ranks (they mark them), so the
    same inflation: the mean scale of its attention ranks in that window, else of every pair."""
    own = [scale for (_, f), scale in zip(pairs, scales) if f is w] or scales
    return sum(own) / len(own)
