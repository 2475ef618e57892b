"""The knapsack against brute force on small random instances, and by hand."""
import itertools
import random

from quantize.knapsack import choose, lower_hull


def test_lower_hull_drops_dominated_and_concave_options():
    options = [(10, 5.0), (20, 1.0), (15, 4.5), (30, 0.5), (25, 2.0), (40, 0.2)]
    # (15, 4.5) saves less per byte than going straight to (20, 1.0); (25, 2.0) costs more than (20, 1.0)
    assert lower_hull(options) == [0, 1, 3, 5]
    assert lower_hull([(10, 1.0), (10, 0.5), (5, 2.0)]) == [2, 1]


def test_choose_is_within_one_upgrade_of_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        options = [[(rng.randint(1, 20), rng.random()) for _ in range(rng.randint(1, 4))] for _ in range(4)]
        smallest = sum(min(b for b, _ in o) for o in options)
        budget = rng.randint(smallest - 2, smallest + 40)
        best = min((sum(o[j][1] for o, j in zip(options, pick)) for pick in itertools.product(
            *[range(len(o)) for o in options]) if sum(o[j][0] for o, j in zip(options, pick)) <= budget), default=None)
        pick = choose(options, budget)
        if best is None:
            assert pick is None
            continue
        assert sum(o[j][0] for o, j in zip(options, pick)) <= budget
        cost = sum(o[j][1] for o, j in zip(options, pick))
        largest_step = max(max(c for _, c in o) - min(c for _, c in o) for o in options)
        assert best <= cost <= best + largest_step + 1e-12


def test_choose_spends_the_budget_where_it_saves_most_per_byte():
    options = [[(4, 1.0), (8, 0.9)],  # saves 0.1 for 4 bytes
               [(4, 1.0), (8, 0.2)]]  # saves 0.8 for 4 bytes
    assert choose(options, 12) == [0, 1] and choose(options, 16) == [1, 1] and choose(options, 8) == [0, 0]
    assert choose(options, 7) is None
