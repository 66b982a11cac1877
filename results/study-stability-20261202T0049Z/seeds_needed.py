"""How many seeds the stability claim would need (docs/study-stability: `python3 seeds_needed.py`).

The committed run's per-seed differences of the largest stable rate were 0, +1, +1, +1, −1, +1 sweep
steps. The claim's test (normswap/study/stats.py ``interval(exact=True)``) decides when the 95 %
t-interval excludes 0 AND the exact sign-flip test gives p ≤ 0.05. For values in {−1, 0, +1} the
sign-flip null of the sum is 2·Bin(k, ½) − k over the k nonzero seeds, computed exactly here. Each
row: n seeds resampled from the six observed differences, 4000 draws, the share that decides (the
power at that n, before the Holm adjustment the study adds)."""

import math
import random

from scipy.stats import binom, t

OBSERVED = [0, 1, 1, 1, -1, 1]


def decided(d: list[int]) -> bool:
    n = len(d)
    m = sum(d) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1))
    t_ok = (m != 0) if sd == 0 else 2 * t.sf(abs(m) / (sd / math.sqrt(n)), n - 1) <= 0.05
    k = sum(1 for x in d if x)
    if k == 0:
        return False
    s = abs(sum(d))
    p = sum(binom.pmf(b, k, 0.5) for b in range(k + 1) if abs(2 * b - k) >= s - 1e-9)
    return t_ok and p <= 0.05


rng = random.Random(0)
print("seeds  power")
for n in (6, 10, 14, 18, 22, 26, 30, 34, 40):
    hits = sum(decided([rng.choice(OBSERVED) for _ in range(n)]) for _ in range(4000))
    print(f"{n:5d}  {hits / 4000:.3f}")
