"""User-level differential privacy: the clip and the Gaussian noise both sides apply alike.

A node's contribution to a round is its block delta (trained minus the block it started from).
With ``dp`` on, the node clips that delta to L2 norm ``dp-clip-norm`` before it is compressed
(:func:`clip_delta`), and with ``dp = "local"`` adds Gaussian noise of standard deviation
``dp-noise-multiplier x dp-clip-norm`` to every coordinate before upload (:func:`add_noise`).
The server clips every decoded upload again (a hostile node's too, and lossy codecs can move
the norm a little), and with ``dp = "central"`` adds noise of the same scale to the sum of a
block's clipped deltas (that is, ``multiplier x clip / n`` to their mean).

Every draw privacy rests on comes from a :class:`NoiseKey`: 32 bytes of OS entropy that never
leave the side that drew them (the server's for central noise, the adaptive clip's count noise
and the node sampling that amplification assumes; a fresh key per upload on the node for local
noise). Draws are SHAKE-256 output keyed by it, turned into Gaussians in float64 and cast to each
tensor's dtype. Nothing in the run config, the summary, the metrics or the logs derives them:
anyone holding those cannot regenerate the noise and subtract it. The server keeps its key in
its checkpoint (server-side state), so a resumed run draws what the uninterrupted one would.

:func:`epsilon` is the one accountant both sides read: the server for user-level DP, each node
for its own example-level DP (``dp = "example"``).
"""

from __future__ import annotations

import hashlib
import math
import random
import secrets
from collections.abc import Iterable, Mapping

import numpy as np
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


class NoiseKey:
    """A secret from which the draws privacy rests on are derived (see the module docstring).

    Each draw is named by a ``label`` (what it is for and its index, e.g. ``"merge/3"``); the
    same key and label give the same draw, different labels independent ones. Without the key
    they cannot be told from fresh randomness (SHAKE-256 as a keyed extendable-output function).

    Parameters
    ----------
    key : bytes, optional
        At least 32 bytes; by default 32 fresh bytes of OS entropy (:func:`secrets.token_bytes`).
    """

    SIZE = 32
    _CHUNK = 1 << 20  # Gaussians drawn per SHAKE call (8 MiB of output)

    def __init__(self, key: bytes | None = None) -> None:
        key = secrets.token_bytes(self.SIZE) if key is None else bytes(key)
        if len(key) < self.SIZE:
            raise ValueError(f"a noise key needs at least {self.SIZE} bytes, got {len(key)}")
        self._key = key

    def __repr__(self) -> str:  # never the key itself: reprs reach logs
        return "NoiseKey(<secret>)"

    def hex(self) -> str:
        """The key, for the server's checkpoint (never the run config, summary or logs)."""
        return self._key.hex()

    @classmethod
    def from_hex(cls, text: str) -> NoiseKey:
        """The key :meth:`hex` wrote (``ValueError`` if it is not one)."""
        if not isinstance(text, str):
            raise ValueError("a noise key must be given as hex text")
        return cls(bytes.fromhex(text))

    def restore(self, text: str) -> None:
        """Take the key :meth:`hex` wrote, in place (every holder of this object draws from it
        from now on)."""
        self._key = NoiseKey.from_hex(text)._key

    def _stream(self, label: str, nbytes: int) -> bytes:
        return hashlib.shake_256(self._key + b"\x00" + label.encode()).digest(nbytes)

    def normal(self, count: int, label: str) -> np.ndarray:
        """``count`` standard Gaussians (float64), the draw named ``label`` (Box-Muller on
        53-bit uniforms in (0, 1))."""
        out = np.empty(count, dtype=np.float64)
        for start in range(0, count, self._CHUNK):
            size = min(self._CHUNK, count - start)
            pairs = (size + 1) // 2
            raw = np.frombuffer(self._stream(f"{label}/{start}", 16 * pairs), dtype="<u8")
            uniform = ((raw >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53
            radius = np.sqrt(-2.0 * np.log(uniform[:pairs]))
            angle = 2.0 * math.pi * uniform[pairs:]
            pair = np.empty(2 * pairs, dtype=np.float64)
            pair[0::2], pair[1::2] = radius * np.cos(angle), radius * np.sin(angle)
            out[start:start + size] = pair[:size]
        return out

    def rng(self, label: str) -> random.Random:
        """A :class:`random.Random` seeded with 256 secret bits for the draw ``label`` (a small
        choice, such as which nodes a round samples)."""
        return random.Random(int.from_bytes(self._stream(label, 32), "big"))


@torch.no_grad()
def add_noise(tensors: Mapping[str, torch.Tensor], std: float, key: NoiseKey,
              label: str) -> Tensors:
    """``tensors`` plus Gaussian noise of standard deviation ``std`` on every coordinate, the
    draw ``label`` of ``key`` (each tensor's noise named by the label and the tensor's name)."""
    if std < 0 or not math.isfinite(std):
        raise ValueError(f"noise standard deviation must be finite and >= 0, got {std}")
    out: Tensors = {}
    for name, t in tensors.items():
        noise = torch.from_numpy(key.normal(t.numel(), f"{label}/{name}")).reshape(t.shape)
        out[name] = (t.double() + noise * std).to(t.dtype)
    return out


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
