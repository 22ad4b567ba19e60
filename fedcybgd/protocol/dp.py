"""User-level differential privacy: the clip and the Gaussian noise both sides apply alike.

A node's contribution to a round is its block delta (trained minus the block it started from).
With ``dp`` on, the node clips that delta to L2 norm ``dp-clip-norm`` before it is compressed
(:func:`clip_delta`), and with ``dp = "local"`` adds Gaussian noise of standard deviation
``dp-noise-multiplier x dp-clip-norm`` to every coordinate before upload (:func:`add_noise`).
The server clips every decoded upload again (a hostile node's too, and lossy codecs can move
the norm a little), and with ``dp = "central"`` adds noise of the same scale to the sum of a
block's clipped deltas (that is, ``multiplier x clip / n`` to their mean).

Noise is drawn from a seeded CPU generator in float64 and cast to each tensor's dtype, so a run
is reproducible; the seeds are the server's (central) or the node's own (local).

:func:`epsilon` is the one accountant both sides read: the server for user-level DP, each node
for its own example-level DP (``dp = "example"``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

Tensors = dict[str, torch.Tensor]

# Integer orders: the RDP of a subsampled Gaussian is exact and fast there (fractional orders
# need a series that may not converge), and they cover epsilons from ~0.1 to hundreds.
RDP_ORDERS: tuple[float, ...] = tuple(
    float(a) for a in (*range(2, 64), 80, 96, 128, 192, 256, 512))


def epsilon(rounds: Iterable[tuple[float, int]], noise_multiplier: float, delta: float) -> float:
    """Epsilon at ``delta`` after ``rounds``: ``(sampling rate, count)`` pairs of Gaussian
    rounds with ``noise_multiplier`` (``inf`` when the multiplier is 0: no privacy)."""
    return epsilon_of([(rate, noise_multiplier, count) for rate, count in rounds], delta)


def epsilon_of(events: Iterable[tuple[float, float, int]], delta: float) -> float:
    """Epsilon at ``delta`` after ``events``: ``(sampling rate, noise multiplier, count)``,
    each ``count`` Poisson-subsampled Gaussian mechanisms (rate 1: not subsampled); ``inf``
    when one with a count has multiplier 0 (no privacy)."""
    try:  # an extra: a node that never accounts privacy need not install it
        import dp_accounting
        from dp_accounting.rdp import RdpAccountant
    except ImportError as err:
        raise ImportError(f"privacy accounting needs dp-accounting ({err}); install it with "
                          "pip install 'fedcybgd[privacy]'") from None
    accountant = RdpAccountant(orders=list(RDP_ORDERS))
    for rate, multiplier, count in events:
        if count <= 0 or rate <= 0:
            continue
        if multiplier <= 0:
            return math.inf
        gaussian = dp_accounting.GaussianDpEvent(multiplier)
        event = gaussian if rate >= 1 else dp_accounting.PoissonSampledDpEvent(rate, gaussian)
        accountant.compose(event, int(count))
    return float(accountant.get_epsilon(delta))


@torch.no_grad()
def delta_norm(tensors: Mapping[str, torch.Tensor], start: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of ``tensors - start`` over every tensor (float64)."""
    total = 0.0
    for name, t in tensors.items():
        diff = t.double() - start[name].double()
        total += float(torch.dot(diff.flatten(), diff.flatten()))
    return math.sqrt(total)


@torch.no_grad()
def clip_delta(tensors: Mapping[str, torch.Tensor], start: Mapping[str, torch.Tensor],
               clip: float) -> tuple[Tensors, float]:
    """``start + delta * min(1, clip / |delta|)``: the delta clipped to L2 norm ``clip``.

    Returns the clipped tensors (in their own dtypes) and the delta's norm before clipping.
    """
    if not clip > 0 or not math.isfinite(clip):
        raise ValueError(f"dp-clip-norm must be finite and > 0, got {clip}")
    norm = delta_norm(tensors, start)
    if not math.isfinite(norm):
        raise ValueError("the update's norm is not finite: nothing to clip")
    if norm <= clip:
        return {name: t.clone() for name, t in tensors.items()}, norm
    scale = clip / norm
    return {name: (start[name].double() + (t.double() - start[name].double()) * scale)
            .to(t.dtype) for name, t in tensors.items()}, norm


@torch.no_grad()
def add_noise(tensors: Mapping[str, torch.Tensor], std: float, seed: int) -> Tensors:
    """``tensors`` plus Gaussian noise of standard deviation ``std`` on every coordinate,
    drawn from a CPU generator seeded with ``seed`` (in sorted tensor-name order)."""
    if std < 0 or not math.isfinite(std):
        raise ValueError(f"noise standard deviation must be finite and >= 0, got {std}")
    generator = torch.Generator().manual_seed(seed)
    out: Tensors = {}
    for name in sorted(tensors):
        t = tensors[name]
        noise = torch.randn(t.shape, generator=generator, dtype=torch.float64) * std
        out[name] = (t.double() + noise).to(t.dtype)
    return {name: out[name] for name in tensors}


def adaptive_noise(noise_multiplier: float, count_stddev: float) -> float:
    """The multiplier of the noise on the updates under adaptive clipping, so that the updates
    and the noised count of unclipped nodes together are a Gaussian mechanism of multiplier
    ``noise_multiplier`` (what the ledger accounts): ``(z**-2 - (2 sigma_b)**-2)**-0.5``, the
    bits centred (sensitivity 1/2), after Andrew et al., "Differentially Private Learning with
    Adaptive Clipping" (2021). Flower's ``compute_adaptive_noise_params`` does the same sum.

    Raises
    ------
    ValueError
        ``2 x count_stddev`` is not above ``noise_multiplier``: the count alone would spend
        the whole budget.
    """
    if not 2 * count_stddev > noise_multiplier > 0:
        raise ValueError(f"adaptive clipping needs 2 x dp-clip-count-stddev "
                         f"({2 * count_stddev:g}) above dp-noise-multiplier "
                         f"({noise_multiplier:g})")
    return float((noise_multiplier ** -2 - (2 * count_stddev) ** -2) ** -0.5)


def count_stddev(configured: float, clients_per_round: int, noise_multiplier: float) -> float:
    """Adaptive clipping's count noise: ``configured``, or for 0 ``max(clients_per_round / 20,
    noise_multiplier)`` (Andrew et al.'s ``m / 20``, raised where it would not exceed half the
    multiplier; at the multiplier the update noise is ``2 / sqrt(3)`` = 1.15x the fixed clip's)."""
    return configured or max(clients_per_round / 20, noise_multiplier)
