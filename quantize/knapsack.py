"""The multiple-choice knapsack behind --target-bpw: one option (bytes, cost) per item, the least
total cost within a byte budget. Pure functions.

Solved by upgrading items along their lower convex hulls of (bytes, cost), most cost saved per byte
first: the optimum of the relaxed problem, short of at most one upgrade, then single switches that
still fit. Exact methods (dynamic programming over bytes) would need a table as large as the budget
in bytes over ~100 items; the greedy's gap is bounded by one upgrade (tested against brute force)."""
from __future__ import annotations


def lower_hull(options: list[tuple[int, float]]) -> list[int]:
    """Indices of the options on the lower convex hull of (bytes, cost), by bytes: from the smallest
    (cheapest among equals), each next one costs strictly less and saves less per extra byte."""
    order = sorted(range(len(options)), key=lambda j: options[j])
    hull: list[int] = []
    for j in order:
        if hull and options[j][1] >= options[hull[-1]][1]:
            continue  # bigger, and no better
        while len(hull) >= 2:
            (b0, c0), (b1, c1), (b2, c2) = options[hull[-2]], options[hull[-1]], options[j]
            if (c0 - c1) * (b2 - b1) <= (c1 - c2) * (b1 - b0):  # the middle one saves no more per byte
                hull.pop()
            else:
                break
        hull.append(j)
    return hull


def choose(options: list[list[tuple[int, float]]], budget: int) -> list[int] | None:
    """Multiple-choice knapsack: one option (bytes, cost) per unit, total bytes <= budget, least total
    cost; None when even the smallest options do not fit. Greedy over the hulls' upgrades, most cost
    saved per byte first (optimal but for at most one upgrade's worth), then any single switch that
    still fits and lowers the cost."""
    hulls = [lower_hull(o) for o in options]
    pick = [h[0] for h in hulls]
    used = sum(o[j][0] for o, j in zip(options, pick))
    if used > budget:
        return None
    steps = sorted(((o[a][1] - o[b][1]) / (o[b][0] - o[a][0]), u, a, b)
                   for u, (o, h) in enumerate(zip(options, hulls)) for a, b in zip(h, h[1:]))
    for _, u, a, b in reversed(steps):  # within a unit, the hull's upgrades come in order
        extra = options[u][b][0] - options[u][a][0]
        if pick[u] == a and used + extra <= budget:
            pick[u], used = b, used + extra
    improved = True
    while improved:  # what the greedy left: one switch at a time, the largest saving that fits
        improved = False
        gain, u, j = max(((options[u][pick[u]][1] - c, u, j) for u, o in enumerate(options)
                          for j, (b, c) in enumerate(o) if used + b - o[pick[u]][0] <= budget), default=(0, 0, 0))
        if gain > 0:
            used += options[u][j][0] - options[u][pick[u]][0]
            pick[u], improved = j, True
    return pick
