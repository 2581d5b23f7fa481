"""RadiX-Net sparse DNN generator and the Sparse DNN Graph Challenge network family.

A RadiX-Net (Kepner & Robinett, ref. [37] of the H-SGD paper, §6.1) is built from a mixed-radix
system r_1, ..., r_k with product n.  The radix r_t at place value pv_t = r_1 ... r_{t-1} gives the
n x n 0/1 matrix

    M_t[i, (i - j * pv_t) mod n] = 1      for j = 0, ..., r_t - 1,

so every neuron of one layer is connected to r_t neurons of the previous one and the product of the
k layers connects every input to every output exactly once.  Each M_t is then widened by a
Kronecker product with a dense block of ones, ``kron(ones(B_{k+1}, B_k), M_t)``, which gives B*r_t
connections per neuron.

Convention (the paper's, eq. 3): ``W[k]`` maps layer k-1 to layer k, rows are the neurons of layer
k (outputs) and columns the neurons of layer k-1 (inputs), ``z^k = W^k x^{k-1}``.  The Graph
Challenge TSV files store the transpose (``Y W`` with row vectors); :mod:`sparse_sgd.io` converts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

__all__ = [
    "CHALLENGE_BIAS",
    "CHALLENGE_YMAX",
    "ChallengeNetwork",
    "RadixNetConfig",
    "challenge_config",
    "graph_challenge_network",
    "mixed_radix_layer",
    "period",
    "place_values",
    "radixnet",
    "random_regular_layer",
    "random_regular_network",
    "relabel_owners",
    "relabelling",
    "spff_lower_bound",
]

#: Graph Challenge bias per neuron count (constant over all neurons and layers).
CHALLENGE_BIAS = {1024: -0.3, 4096: -0.35, 16384: -0.4, 65536: -0.45}
#: Graph Challenge ReLU clamp: Y <- min(max(Y W + b, 0), YMAX).
CHALLENGE_YMAX = 32.0
#: Graph Challenge dense block size (32 connections per neuron = B * radix 2).
CHALLENGE_BLOCK = 16


def place_values(radices) -> np.ndarray:
    """Place values pv_t = r_1 r_2 ... r_{t-1} of a mixed-radix system (pv_1 = 1)."""
    r = np.asarray(radices, dtype=np.int64)
    if r.ndim != 1 or r.size == 0 or np.any(r < 1):
        raise ValueError(f"radices must be a non-empty list of positive integers, got {radices!r}")
    return np.concatenate(([1], np.cumprod(r)[:-1]))


def mixed_radix_layer(radices, t: int) -> sp.csr_matrix:
    """The n x n 0/1 matrix M_t of radix ``radices[t]`` (RadiX-Net, ref. [37]).

    Row i (output neuron) has its nonzeros in columns ``(i - j * pv_t) mod n`` for j < r_t, where
    pv_t is the place value of radix t and n the product of all radices.

    Parameters
    ----------
    radices : sequence of int
        The mixed-radix system r_1, ..., r_k.
    t : int
        0-based index of the radix whose layer is built.

    Returns
    -------
    scipy.sparse.csr_matrix of shape (n, n), dtype float64, entries 1.
    """
    pv = place_values(radices)
    if not 0 <= t < len(pv):
        raise ValueError(f"radix index t={t} out of range: choose 0 <= t < {len(pv)}")
    n = int(np.prod(radices))
    r = int(radices[t])
    i = np.repeat(np.arange(n, dtype=np.int64), r)
    j = np.tile(np.arange(r, dtype=np.int64), n)
    cols = (i - j * pv[t]) % n
    M = sp.csr_matrix((np.ones(n * r), (i, cols)), shape=(n, n))
    M.sum_duplicates()
    M.data[:] = 1.0
    return M


@dataclass(frozen=True)
class RadixNetConfig:
    """Configuration of a RadiX-Net sparse DNN.

    Attributes
    ----------
    radices : tuple of int
        Mixed-radix system; layer k uses radix ``radices[k mod len(radices)]``.
    num_layers : int
        Number of weight matrices L.
    blocks : tuple of int
        Dense Kronecker block sizes B_0, ..., B_L (layer k has B_k * n neurons); a single value
        means every layer has the same width.
    weight : float
        Value of every connection (the Graph Challenge uses 1/16).
    permute : bool
        Relabel the hidden neurons: draw a random permutation P_k of layer k for every hidden
        layer k = 1 .. L-1 (P_0 = P_L = I, so inputs and outputs keep their indices) and use
        ``P_k W^k P_{k-1}^T`` (:func:`relabelling`).  The network is isomorphic to the
        unpermuted one: the same function of x^0, the same path counts, the same partition
        volumes under the mapped partition (:func:`relabel_owners`).
    seed : int
        Seed of the permutation generator.
    """

    radices: tuple = (2, 2, 2, 2, 2, 2)
    num_layers: int = 6
    blocks: tuple = (CHALLENGE_BLOCK,)
    weight: float = 1.0 / CHALLENGE_BLOCK
    permute: bool = True
    seed: int = 0

    def __post_init__(self):
        place_values(self.radices)  # validates
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if len(self.blocks) not in (1, self.num_layers + 1) or min(self.blocks) < 1:
            raise ValueError(
                f"blocks must hold one positive size or num_layers+1 = {self.num_layers + 1} "
                f"sizes, got {self.blocks!r}"
            )

    def block(self, k: int) -> int:
        """Kronecker block size B_k of layer k (k = 0 is the input layer)."""
        return int(self.blocks[0] if len(self.blocks) == 1 else self.blocks[k])


def relabelling(config: RadixNetConfig) -> list[np.ndarray]:
    """The permutations P_0, ..., P_L of :attr:`RadixNetConfig.permute` as index arrays.

    ``perms[k][a]`` is the neuron of the unpermuted layer k that becomes neuron a of the
    relabelled one, so ``W'^k = W^k[perms[k]][:, perms[k-1]]`` = P_k W^k P_{k-1}^T.  P_0 and P_L
    are identities; all are identities when ``permute`` is False.
    """
    L = config.num_layers
    n = int(np.prod([int(r) for r in config.radices]))
    sizes = [config.block(k) * n for k in range(L + 1)]
    rng = np.random.default_rng(config.seed)
    return [rng.permutation(sizes[k]) if config.permute and 0 < k < L
            else np.arange(sizes[k]) for k in range(L + 1)]


def relabel_owners(owners, perms) -> tuple:
    """Map a row partition of the unpermuted network onto the relabelled one.

    Neuron a of relabelled layer k is neuron ``perms[k][a]`` of the unpermuted layer, so it gets
    that neuron's owner: ``owners'[k] = owners[k][perms[k]]``.  Every pair volume D^k[m, n]
    (eq. 9) is unchanged.
    """
    if len(owners) != len(perms):
        raise ValueError(f"{len(owners) - 1} partitioned layers but {len(perms) - 1} "
                         "permutations; relabel the same network")
    return tuple(np.asarray(o)[p] for o, p in zip(owners, perms))


def radixnet(config: RadixNetConfig) -> list[sp.csr_matrix]:
    """Generate the weight matrices W^1, ..., W^L of a RadiX-Net.

    ``W^k = P_k kron(ones(B_k, B_{k-1}), M_t) P_{k-1}^T * weight`` with t = (k-1) mod
    len(radices) and P_k the relabelling of :func:`relabelling` (identities when ``permute`` is
    False), so without ``permute`` the layers repeat with period ``len(radices)``.

    Returns
    -------
    list of scipy.sparse.csr_matrix, ``W[k-1]`` of shape (B_k n, B_{k-1} n), sorted indices.
    """
    radices = tuple(int(r) for r in config.radices)
    kr = len(radices)
    base = [mixed_radix_layer(radices, t) for t in range(kr)]
    perms = relabelling(config)
    weights = []
    for k in range(1, config.num_layers + 1):
        t = (k - 1) % kr
        Bo, Bi = config.block(k), config.block(k - 1)
        W = sp.kron(np.ones((Bo, Bi)), base[t], format="csr") * config.weight
        if config.permute:
            W = sp.csr_matrix(W)[perms[k]][:, perms[k - 1]]
        W = sp.csr_matrix(W)
        W.sort_indices()
        weights.append(W)
    return weights


def random_regular_layer(rows: int, cols: int, degree: int, rng: np.random.Generator, *,
                         weight: float = 1.0 / CHALLENGE_BLOCK) -> sp.csr_matrix:
    """A uniformly shuffled ``degree``-regular sparsity pattern: every row and every column of
    the square layer holds exactly ``degree`` nonzeros, no structure (the worst case for
    partitioning, the shape of a pruned network with equal fan-in and fan-out).

    The union of ``degree`` random perfect matchings (permutations); a position that repeats
    an earlier matching's entry of its row is swapped with a random other position until both
    are new.
    """
    if rows != cols:
        raise ValueError(f"a regular layer here is square, got {rows} x {cols}")
    if not 1 <= degree <= rows:
        raise ValueError(f"degree must be in [1, {rows}], got {degree}")
    n = rows
    taken = np.zeros(0, dtype=np.int64)  # sorted row * n + col of the entries so far

    def free(key: int) -> bool:
        at = int(np.searchsorted(taken, key))
        return at == taken.size or taken[at] != key

    cols_of = np.empty((n, degree), dtype=np.int64)
    base = np.arange(n, dtype=np.int64) * n
    for t in range(degree):
        perm = rng.permutation(n)
        keys = base + perm
        at = np.minimum(np.searchsorted(taken, keys), max(taken.size - 1, 0))
        clash = np.flatnonzero(taken[at] == keys) if taken.size else np.zeros(0, np.int64)
        for i in clash.tolist():
            while not free(i * n + int(perm[i])):
                j = int(rng.integers(n))
                if free(i * n + int(perm[j])) and free(j * n + int(perm[i])):
                    perm[i], perm[j] = perm[j], perm[i]
        taken = np.sort(np.concatenate((taken, base + perm)))
        cols_of[:, t] = perm
    cols_of.sort(axis=1)
    return sp.csr_matrix((np.full(n * degree, weight), cols_of.ravel(),
                          np.arange(0, n * degree + 1, degree)), shape=(n, n))


def random_regular_network(neurons: int, layers: int, degree: int = 32, *, seed: int = 0,
                           weight: float = 1.0 / CHALLENGE_BLOCK) -> list[sp.csr_matrix]:
    """``layers`` independent :func:`random_regular_layer` s of ``neurons`` neurons: a network
    without period and without twins (the non-periodic benchmark: 32-regular, the
    connections per neuron of the Graph Challenge networks)."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    rng = np.random.default_rng(seed)
    return [random_regular_layer(neurons, neurons, degree, rng, weight=weight)
            for _ in range(layers)]


def period(config: RadixNetConfig) -> int | None:
    """Period of the layer sequence: ``len(radices)`` for an unpermuted net with equal blocks
    (W^{k + period} = W^k), else None."""
    if config.permute or len({config.block(k) for k in range(config.num_layers + 1)}) > 1:
        return None
    return len(config.radices)


def spff_lower_bound(config: RadixNetConfig, parts: int, epsilon: float = 0.01) -> np.ndarray:
    """A lower bound on the SpFF words of layer k summed over processors, for every k.

    Any row partition with every block's rows at most ``cap_k = max(floor(N_k/P (1+eps)),
    ceil(N_k/P))`` (eq. 2 with unit row weights; RadiX-Net rows all have the same nnz) obeys
    it; relabelling does not change it.  Argument: the rows of ``kron(ones(B_k, B_{k-1}), M_t)``
    fall into classes of B_k identical rows; class i uses the column classes
    {i - j pv_t mod n : j < r_t}, each of B_{k-1} columns.  c row classes inside one coset of
    the cyclic group generated by pv_t (order q_t = n / pv_t) use at least
    c + min(r_t - 1, q_t - c) column classes (adding the interval {0, .., r_t-1} grows any
    proper subset of Z_q by one per step).  Processor m with R_m > 0 rows touches
    c_m >= ceil(R_m / B_k) classes and receives at least |cols(R_m)| - |O_m| words (O_m: its
    x^{k-1} entries).  Summing, with sum R_m = N_k, sum O_m = N_{k-1}, at least
    p' = ceil(N_k / cap_k) non-empty processors and sum c_m >= max(p', ceil(N_k / B_k)):

        V_k >= B_{k-1} (max(p', ceil(N_k/B_k)) + p' min(r_t - 1, q_t - c_max)) - N_{k-1}

    with c_max = ceil(cap_k / B_k) (the extra term is 0 when c_max >= q_t).
    """
    radices = [int(r) for r in config.radices]
    n = int(np.prod(radices))
    pv = place_values(radices)
    out = np.zeros(config.num_layers, dtype=np.float64)
    for k in range(1, config.num_layers + 1):
        t = (k - 1) % len(radices)
        Bo, Bi = config.block(k), config.block(k - 1)
        Nk, Nprev = Bo * n, Bi * n
        cap = max(int(np.floor(Nk / parts * (1.0 + epsilon))), -(-Nk // parts))
        q = n // int(pv[t])
        c_max = -(-cap // Bo)
        extra = max(0, min(radices[t] - 1, q - c_max))
        nonempty = -(-Nk // cap)
        classes = max(nonempty, -(-Nk // Bo))
        out[k - 1] = max(0.0, Bi * (classes + nonempty * extra) - Nprev)
    return out


def challenge_config(neurons: int, layers: int, *, permute: bool = True, seed: int = 0
                     ) -> RadixNetConfig:
    """RadiX-Net configuration of the Graph Challenge network with ``neurons`` per layer.

    N = 16 * n with n = 2^m (radices [2]*m), 32 connections per neuron, weights 1/16.
    """
    if neurons not in CHALLENGE_BIAS:
        raise ValueError(f"Graph Challenge networks have N in {sorted(CHALLENGE_BIAS)}, got "
                         f"{neurons}; use RadixNetConfig directly for other sizes")
    n = neurons // CHALLENGE_BLOCK
    m = n.bit_length() - 1  # n is a power of two
    return RadixNetConfig(radices=(2,) * m, num_layers=layers, blocks=(CHALLENGE_BLOCK,),
                          weight=1.0 / CHALLENGE_BLOCK, permute=permute, seed=seed)


@dataclass
class ChallengeNetwork:
    """A Graph Challenge sparse DNN: weights in paper orientation, constant bias, clamp."""

    weights: list
    bias: float
    ymax: float = CHALLENGE_YMAX
    neurons: int = field(init=False)

    def __post_init__(self):
        self.neurons = int(self.weights[0].shape[1])

    @property
    def num_layers(self) -> int:
        return len(self.weights)

    @property
    def nnz(self) -> int:
        return int(sum(W.nnz for W in self.weights))


def graph_challenge_network(neurons: int, layers: int, *, permute: bool = True, seed: int = 0
                            ) -> ChallengeNetwork:
    """Generate the Graph Challenge network N=``neurons`` with ``layers`` layers (§6.1)."""
    cfg = challenge_config(neurons, layers, permute=permute, seed=seed)
    return ChallengeNetwork(weights=radixnet(cfg), bias=CHALLENGE_BIAS[neurons])
