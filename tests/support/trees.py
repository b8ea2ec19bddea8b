"""Tree batches checked the slow, obvious way: random forests in depth-first order, and the
ancestor mask of their parent links by walking up from every token."""

from __future__ import annotations

import numpy as np


def ancestors_brute_force(parent: np.ndarray) -> np.ndarray:
    n = len(parent)
    mask = np.zeros((n, n), dtype=bool)
    for q in range(n):
        k = q
        while k >= 0:
            mask[q, k] = True
            k = parent[k]
    return mask


def random_forest(n: int, rng: np.random.Generator, new_root: float = 0.02) -> np.ndarray:
    """Parent links of a random forest in depth-first order."""
    parent = np.full(n, -1, np.int64)
    for t in range(1, n):
        path = [t - 1]
        while parent[path[-1]] >= 0 and rng.random() < 0.7:
            path.append(int(parent[path[-1]]))
        parent[t] = -1 if rng.random() < new_root else path[-1]
    return parent
