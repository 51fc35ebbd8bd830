"""GPU-to-stage mapping (Oobleck, SOSP'23, Section 4.1.2): the fastest pipeline on ``n`` nodes of ``M`` GPUs.

The paper's divide and conquer splits a problem ``T(S', u, v, d)`` (layers ``[u, v)`` in ``S'`` stages on ``d``
GPUs) into two halves, solves each, and keeps per sub-problem the split minimising ``T1 + T2 + T3``:

    T1 = sum of F + B over the stages                           (warm-up and cool-down, Eq. 1)
    T2 = (Nb - S' + k* - 1) * (F + B of the slowest stage k*)  (steady phase, Eq. 2; Nb = 4 S' while planning)
    T3 = sum of F + B of stage k* and of the stages after it    (Eq. 3)

We keep that objective, the (T1, slowest time, k*, T3) tuple per sub-problem and the paper's rule for joining
two halves, and choose the split order so that the table stays small:

- Stages never span nodes and a node's GPUs are all used, so a pipeline is a chain of nodes, each running a run
  of consecutive stages. Splitting "first node | the other nodes" reaches every such pipeline, so sub-problems
  are suffixes ``(j nodes, first layer u, S' stages)``: O(n L^2) of them instead of the O(L^3 n M) of
  ``(S', u, v, d)``.
- Inside a node the ``M`` GPUs form ``M / g`` stages of ``g`` GPUs each, ``g`` a divisor of ``M``, run tensor
  parallel within the stage. Equal degrees inside a node are what Megatron-style tensor-parallel groups run;
  different nodes of one template may use different degrees. A node's run of stages is a sub-problem of its
  own, ``(g, [u, w))``, solved by "first stage | rest of the node".
- Every level is evaluated for all ``u``, ``w``, ``g`` and ``S'`` at once with numpy and memoised across node
  counts: the table for ``j`` nodes is built from the one for ``j - 1``, so the templates for 1..n nodes cost
  what the n-node template costs (the paper's remark on intermediate caches, Section 4.1.2).
- The number of stages S is not iterated from outside: the table holds every S' and the template takes the best.
  The paper's range ``n <= S <= L`` falls out (each node runs a stage or more, each stage a layer or more).

Ties for the slowest stage go to the later stage (``k*`` is the last index of the maximum), the conservative
reading of Eq. 2-3 (it subtracts less from the steady phase).

Memory: a stage with ``r`` stages after it holds ``r + 1`` micro-batches of activations (1F1B). Across nodes the
check is exact, since a suffix knows how many stages follow it. Inside a node the run of stages is chosen by time
among those that fit with no stage after the node, and it is then rejected where its first stages cannot hold the
micro-batches of the whole suffix; so every template respects memory, but a tight memory may hide a slower run
that would have fitted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ftlab.policies.oobleck.costs import StageCosts

INF = np.inf


@dataclass(frozen=True)
class Placement:
    """A stage of a found pipeline: layers ``[start, stop)`` on GPUs ``[gpu, gpu + degree)`` of the pipeline's
    ``node``-th node."""

    start: int
    stop: int
    node: int
    gpu: int
    degree: int


@dataclass(frozen=True)
class Parts:
    """T1, the slowest stage's time, its index k* and T3, for many sub-problems at once (arrays of one shape)."""

    t1: np.ndarray
    slow: np.ndarray
    k: np.ndarray
    t3: np.ndarray

    def total(self, stages: np.ndarray | int) -> np.ndarray:
        """T1 + T2 + T3 with Nb = 4 S', so T2 = (3 S' + k* - 1) * slowest."""
        return self.t1 + (3 * stages + self.k - 1) * self.slow + self.t3

    def where(self, keep: np.ndarray) -> Parts:
        """Infeasible (infinite, k* = 0) where ``keep`` is false."""
        return Parts(
            np.where(keep, self.t1, INF),
            np.where(keep, self.slow, INF),
            np.where(keep, self.k, 0),
            np.where(keep, self.t3, INF),
        )


@dataclass(frozen=True)
class _Node:
    """The best run of stages inside one node for every degree and layer range, stacked as [u, degree, w]."""

    degrees: tuple[int, ...]
    stages: np.ndarray
    """Stages per node for each degree: M / g."""
    parts: Parts
    fits: np.ndarray
    """Largest S' (stages from the node's first stage to the pipeline's end) the node's memory allows."""
    splits: dict[int, tuple[np.ndarray, ...]]
    """splits[g][i][u, w]: where the first stage of the best (i + 2)-stage run on [u, w) ends."""


@dataclass(frozen=True)
class _Level:
    """Suffixes run by ``j`` nodes, indexed [u, S' - 1]: the layers [u, L) in S' stages."""

    parts: Parts
    total: np.ndarray
    node_end: np.ndarray
    """Where the first node's layers end."""
    degree: np.ndarray
    """Index into the degrees of the first node's degree."""


def _node_runs(costs: StageCosts, gpus_per_node: int, degree: int) -> tuple[Parts, np.ndarray, tuple[np.ndarray, ...]]:
    """The best run of M / degree stages of ``degree`` GPUs on each [u, w), built as first stage + shorter run."""
    fits_one = costs.max_in_flight(degree)
    time = np.where(fits_one >= 1, costs.time[degree], INF)
    parts = Parts(time, time, np.zeros(time.shape, dtype=np.int64), time)
    fits, splits = fits_one, []
    u, w = np.indices(time.shape)
    for i in range(2, gpus_per_node // degree + 1):
        # First stage on [u, x), the best (i - 1)-stage run on [x, w): arrays over (u, w, x), x last for argmin.
        # Memory: the first stage holds i micro-batches, the run after it i - 1 (a separable check).
        c = 3 * i - 1
        ta = np.where(fits_one >= i, time, INF)
        tb = parts.slow.T[None]
        t1 = ta[:, None, :] + np.where(fits >= i - 1, parts.t1, INF).T[None]
        # T2 + T3 less T1: the run's part (k* weighted in) if it holds the slowest stage, else the first stage's
        # (k* = 0, T3 = T1).
        total = t1 + (c * ta)[:, None, :]
        run_slowest = ((1 + parts.k + c) * parts.slow + parts.t3).T[None]
        np.copyto(total, np.broadcast_to(run_slowest, total.shape), where=tb >= ta[:, None, :])
        total += t1
        x = np.argmin(total, axis=2)
        found = np.isfinite(total[u, w, x])
        a, b = time[u, x], Parts(parts.t1[x, w], parts.slow[x, w], parts.k[x, w], parts.t3[x, w])
        later = b.slow >= a
        parts = Parts(a + b.t1, np.maximum(a, b.slow), np.where(later, 1 + b.k, 0), np.where(later, b.t3, a + b.t1))
        parts = parts.where(found)
        fits = np.minimum(fits_one[u, x], 1 + fits[x, w])
        splits.append(x)
    return parts, fits, tuple(splits)


class StageMapper:
    """Memoised search over pipelines of 1, 2, ... nodes for one cost model and node shape."""

    def __init__(self, costs: StageCosts, gpus_per_node: int, degrees: tuple[int, ...]) -> None:
        if not degrees or any(gpus_per_node % g for g in degrees):
            raise ValueError(f"tensor-parallel degrees {degrees} must divide the {gpus_per_node} GPUs of a node")
        self.costs = costs
        self.gpus_per_node = gpus_per_node
        runs = {g: _node_runs(costs, gpus_per_node, g) for g in degrees}
        stack = lambda pick: np.stack([pick(runs[g]) for g in degrees], axis=1)  # noqa: E731 - [u, degree, w]
        self.node = _Node(
            degrees=degrees,
            stages=np.array([gpus_per_node // g for g in degrees]),
            parts=Parts(*(stack(lambda r, f=f: getattr(r[0], f)) for f in ("t1", "slow", "k", "t3"))),
            fits=stack(lambda r: r[1]),
            splits={g: runs[g][2] for g in degrees},
        )
        self.levels: list[_Level] = []
        self._node_terms: tuple[np.ndarray, np.ndarray] | None = None

    def _width(self, nodes: int) -> int:
        return min(self.costs.num_layers, nodes * self.gpus_per_node)

    def _first_level(self) -> _Level:
        """One node runs the whole suffix [u, L): S' is its number of stages."""
        n_layers, node = self.costs.num_layers, self.node
        width = self._width(1)
        shape = (n_layers + 1, width)
        parts = Parts(np.full(shape, INF), np.full(shape, INF), np.zeros(shape, dtype=np.int64), np.full(shape, INF))
        total = np.full(shape, INF)
        degree = np.zeros(shape, dtype=np.int64)
        for d, q in enumerate(node.stages):
            if q > width:
                continue
            run = Parts(*(getattr(node.parts, f)[:, d, n_layers] for f in ("t1", "slow", "k", "t3")))
            run = run.where(node.fits[:, d, n_layers] >= q)
            for f in ("t1", "slow", "k", "t3"):
                getattr(parts, f)[:, q - 1] = getattr(run, f)
            total[:, q - 1] = run.total(q)
            degree[:, q - 1] = d
        return _Level(parts, total, np.full(shape, n_layers), degree)

    def _prepare(self, width: int) -> None:
        """The first node's share of the join, which no level changes: arrays over [u, S' - 1, degree, w].

        t1: the node's T1, infinite where its first stage cannot hold the S' micro-batches 1F1B gives it.
        slowest: T2 + T3 for S' stages when the node holds the slowest stage, less the suffix's part.
        """
        if self._node_terms is not None and self._node_terms[0].shape[1] >= width:
            return
        a = self.node.parts
        stages = np.arange(1, width + 1)[None, :, None, None]
        t1 = np.where(self.node.fits[:, None] >= stages, a.t1[:, None], INF)
        feasible = np.isfinite(a.slow)
        rest = np.where(feasible, a.k * np.where(feasible, a.slow, 0.0) + a.t3, INF)
        slowest = a.slow[:, None] * (3 * stages - 1) + rest[:, None]
        self._node_terms = (t1, slowest)

    def _next_level(self, nodes: int) -> _Level:
        """The best first node (a run of stages on [u, w)) followed by the best suffix of ``nodes - 1`` nodes."""
        node, rest = self.node, self.levels[-1]
        n = self.costs.num_layers + 1
        width = self._width(nodes)
        stages = np.arange(1, width + 1)
        # The suffix after a node of q stages has S' - q of them: column S' - 1 of this level reads S' - q - 1.
        source = stages[:, None] - 1 - node.stages[None, :]  # [S', degree]
        present = ((source >= 0) & (source < rest.total.shape[1]))[:, :, None]
        source = np.clip(source, 0, rest.total.shape[1] - 1)

        def suffix(array: np.ndarray, fill: float) -> np.ndarray:
            return np.where(present, array.T[source], fill)  # [S', degree, w]

        r = rest.parts
        b = Parts(suffix(r.t1, INF), suffix(r.slow, INF), suffix(r.k, 0), suffix(r.t3, INF))
        a = node.parts
        a_t1, a_slowest = (term[:, :width] for term in self._node_terms)
        # Joining two halves, per the paper: if the suffix holds the slowest stage, k* moves by the node's q
        # stages and T3 is the suffix's; otherwise T3 is the node's plus all of the suffix (its T1).
        q = node.stages[None, :, None]
        b_slowest = (3 * stages[:, None, None] + q + b.k - 1) * b.slow + b.t3 + b.t1  # [S', degree, w]
        total = a_slowest + 2 * b.t1
        np.copyto(total, np.broadcast_to(b_slowest, total.shape), where=b.slow >= a.slow[:, None])
        total += a_t1
        flat = total.reshape(n, width, -1)
        choice = np.argmin(flat, axis=2)  # [u, S']: degree * n + w
        u, col = np.indices(choice.shape)
        best = flat[u, col, choice]
        d, w = np.divmod(choice, n)
        pa = Parts(a.t1[u, d, w], a.slow[u, d, w], a.k[u, d, w], a.t3[u, d, w])
        pb = Parts(b.t1[col, d, w], b.slow[col, d, w], b.k[col, d, w], b.t3[col, d, w])
        later = pb.slow >= pa.slow
        parts = Parts(
            pa.t1 + pb.t1,
            np.maximum(pa.slow, pb.slow),
            np.where(later, node.stages[d] + pb.k, pa.k),
            np.where(later, pb.t3, pa.t3 + pb.t1),
        ).where(np.isfinite(best))
        return _Level(parts, best, w, d)

    def extend(self, nodes: int) -> None:
        """Fill the tables up to ``nodes`` nodes."""
        if nodes > 1:
            self._prepare(self._width(nodes))
        while len(self.levels) < nodes:
            self.levels.append(self._first_level() if not self.levels else self._next_level(len(self.levels) + 1))

    def feasible(self, nodes: int) -> bool:
        self.extend(nodes)
        return bool(np.isfinite(self.levels[nodes - 1].total[0]).any())

    def best(self, nodes: int) -> list[Placement] | None:
        """The pipeline on ``nodes`` nodes with the least time per micro-batch, T(S) / Nb with Nb = 4 S, or None
        when none fits in memory."""
        if not self.feasible(nodes):
            return None
        row = self.levels[nodes - 1].total[0]
        stages = int(np.argmin(row / (4 * np.arange(1, len(row) + 1)))) + 1
        placements: list[Placement] = []
        u = 0
        for j in range(nodes, 0, -1):
            level = self.levels[j - 1]
            w = int(level.node_end[u, stages - 1])
            d = int(level.degree[u, stages - 1])
            placements.extend(self._unfold(self.node.degrees[d], u, w, nodes - j))
            stages -= int(self.node.stages[d])
            u = w
        return placements

    def _unfold(self, degree: int, u: int, w: int, node: int) -> list[Placement]:
        out = []
        splits = self.node.splits[degree]
        for i in range(self.gpus_per_node // degree, 1, -1):
            x = int(splits[i - 2][u, w])
            out.append(Placement(u, x, node, len(out) * degree, degree))
            u = x
        out.append(Placement(u, w, node, len(out) * degree, degree))
        return out
