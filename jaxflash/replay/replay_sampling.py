"""Which stored trajectories a replay draw picks: pure rules over numpy arrays.

Two families, each rule a small function of per-entry arrays so it can be checked
against hand-worked numbers:

Buffer-wide rules (draw n trajectories from the whole buffer, without replacement
within one draw; nothing is removed from the buffer by drawing):

- ``uniform``: every eligible trajectory equally likely (Arnal et al., arXiv
  2604.08706: FIFO buffer, uniform sampling without removal).
- ``recency``: weight (i + 1)^a with i the position in insertion order, 0 the
  oldest (Marin's replay buffer: ``weights = (arange(n) + 1) ** alpha``); a = 0 is
  uniform, larger a favours newer trajectories.
- ``freshness``: priority p = p_base * exp(-age / tau), age in policy versions
  (FreshPER, arXiv 2604.16918). p_base is |advantage| + ``PRIORITY_FLOOR`` (the
  advantage-magnitude base priority FreshPER stacks its decay on) or 1 (pure age
  decay); the half-life of a priority is tau * ln 2 versions.

Per-prompt strategies (RePO, arXiv 2506.09340: for each prompt of the batch,
retrieve k earlier samples *of that prompt*); deterministic, no RNG:

- ``recent``: the k most recently stored.
- ``highest_reward``: the k with the highest reward (ties: more recent first).
- ``max_variance``: the k whose rewards have the largest population variance.

Every function returns indices into the arrays it was given.
"""

from __future__ import annotations

import numpy as np

BUFFER_RULES = ("uniform", "recency", "freshness")
PROMPT_STRATEGIES = ("recent", "highest_reward", "max_variance")
FRESHNESS_BASES = ("abs_advantage", "uniform")
PRIORITY_FLOOR = 1e-6  # keeps a zero-advantage trajectory drawable (PER's epsilon)


def recency_weights(n: int, exponent: float) -> np.ndarray:
    """Marin's recency weights (i + 1)^a for i = 0 (oldest) .. n - 1 (newest).

    Args:
      n: number of eligible trajectories, in insertion order.
      exponent: a >= 0.

    Returns:
      float64 [n], unnormalised.

    Raises:
      ValueError: n < 0 or exponent < 0.
    """
    if n < 0:
        raise ValueError(f"recency_weights: n must be >= 0, got {n}")
    if not exponent >= 0:
        raise ValueError(f"recency_weights: exponent must be >= 0, got {exponent}")
    return (np.arange(n, dtype=np.float64) + 1.0) ** float(exponent)


def freshness_priorities(base_n: np.ndarray, age_n: np.ndarray, tau: float) -> np.ndarray:
    """FreshPER priority p = p_base * exp(-age / tau).

    Args:
      base_n: float [n] base priorities, >= 0.
      age_n: int [n] ages in policy versions (learner version - start version), >= 0.
      tau: decay constant in policy versions, > 0.

    Returns:
      float64 [n].

    Raises:
      ValueError: shapes differ, tau <= 0, a negative base or age.

    References: FreshPER, arXiv 2604.16918.
    """
    base_n = np.asarray(base_n, np.float64)
    age_n = np.asarray(age_n, np.float64)
    if base_n.shape != age_n.shape or base_n.ndim != 1:
        raise ValueError(
            f"freshness_priorities: base_n {base_n.shape} and age_n {age_n.shape} must be "
            "equal 1-D shapes"
        )
    if not tau > 0:
        raise ValueError(f"freshness_priorities: tau must be > 0, got {tau}")
    if np.any(base_n < 0) or np.any(age_n < 0):
        raise ValueError("freshness_priorities: base priorities and ages must be >= 0")
    return base_n * np.exp(-age_n / float(tau))


def draw_without_replacement(rng: np.random.Generator, k: int, weights_n: np.ndarray) -> np.ndarray:
    """k distinct indices in [0, n), with probabilities proportional to ``weights_n``.

    Equal weights are uniform. Draws min(k, number of positive weights): a
    zero-weight entry is never drawn. Uses ``rng.choice(..., replace=False)``, so
    the result is a function of the generator's state (resume-exact).

    Args:
      rng: the buffer's own generator (advanced by the call).
      k: how many to draw, >= 0.
      weights_n: float [n], >= 0; its length is n.

    Returns:
      int64 [min(k, n_positive)], in draw order.

    Raises:
      ValueError: k < 0, or weights not finite, negative or not 1-D.
    """
    if k < 0:
        raise ValueError(f"draw_without_replacement: k must be >= 0, got {k}")
    w = np.asarray(weights_n, np.float64)
    if w.ndim != 1 or np.any(~np.isfinite(w)) or np.any(w < 0):
        raise ValueError("draw_without_replacement: weights must be finite, >= 0, 1-D")
    positive = int(np.count_nonzero(w))
    k = min(k, positive)
    if k == 0:
        return np.zeros(0, np.int64)
    if np.all(w == w[0]):
        # Uniform: no probability vector, so equal weights take numpy's exact path.
        return rng.choice(w.size, size=k, replace=False).astype(np.int64)
    return rng.choice(w.size, size=k, replace=False, p=w / w.sum()).astype(np.int64)


def recent_k(order_n: np.ndarray, k: int) -> np.ndarray:
    """RePO recent-k: indices of the k largest ``order_n`` (insertion counters), newest first."""
    order_n = np.asarray(order_n)
    idx = np.argsort(-order_n, kind="stable")
    return idx[: max(0, min(k, order_n.size))].astype(np.int64)


def highest_reward_k(reward_n: np.ndarray, order_n: np.ndarray, k: int) -> np.ndarray:
    """RePO highest-reward-k: the k largest rewards; equal rewards newest first."""
    reward_n, order_n = np.asarray(reward_n, np.float64), np.asarray(order_n)
    idx = np.lexsort((-order_n, -reward_n))  # last key is primary
    return idx[: max(0, min(k, reward_n.size))].astype(np.int64)


def max_variance_k(reward_n: np.ndarray, order_n: np.ndarray, k: int) -> np.ndarray:
    """RePO max-variance-k: the k-subset whose rewards have the largest variance.

    A k-subset of maximal variance consists of the j smallest and the k - j
    largest values for some j (moving any inner value outward never lowers the
    spread), so the k + 1 splits are compared exactly. Ties between splits go to
    the smaller j; equal rewards are taken newest first.

    Args:
      reward_n: float [n] rewards; order_n: int [n] insertion counters; k >= 0.

    Returns:
      int64 [min(k, n)] indices (smallest-reward part first).
    """
    reward_n, order_n = np.asarray(reward_n, np.float64), np.asarray(order_n)
    k = max(0, min(k, reward_n.size))
    if k == 0:
        return np.zeros(0, np.int64)
    low = np.lexsort((-order_n, reward_n))  # ascending reward, newest first among ties
    high = np.lexsort((-order_n, -reward_n))  # descending reward, newest first among ties
    best, best_var = None, -1.0
    for j in range(k + 1):
        chosen = np.concatenate([low[:j], high[: k - j]])
        if np.unique(chosen).size < k:
            continue  # the two ends overlap (only when k is close to n): not a k-subset
        var = float(np.var(reward_n[chosen]))
        if var > best_var + 1e-12:
            best, best_var = chosen, var
    if best is None:  # k == n: every split overlaps except the whole set
        best = low[:k]
    return best.astype(np.int64)


def select_for_prompt(
    strategy: str, reward_n: np.ndarray, order_n: np.ndarray, k: int
) -> np.ndarray:
    """Dispatch a ``PROMPT_STRATEGIES`` name; ValueError lists the valid ones."""
    if strategy == "recent":
        return recent_k(order_n, k)
    if strategy == "highest_reward":
        return highest_reward_k(reward_n, order_n, k)
    if strategy == "max_variance":
        return max_variance_k(reward_n, order_n, k)
    raise ValueError(f"unknown per-prompt strategy {strategy!r}; choose from {PROMPT_STRATEGIES}")
