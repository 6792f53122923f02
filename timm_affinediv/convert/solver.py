""" The ridge least-squares fit of a corrected layer, exact and closed form

Each fit solves `v = argmin |U v - Z|^2 + lambda |v - v0|^2` per group: the rows of `U` are the features at sampled
positions (`features.patch_features`), `Z` the original's values there, `v0` the analytic map the penalty pulls
towards, as post-training quantisation methods do. `NormalEquations` accumulates `U^T U` and `U^T Z` over the
calibration batches (float32 products, float64 solve); `solve_normal_equations` and `dual_fit` are its two solves.
"""
import contextlib
from typing import List, Tuple

import torch

__all__ = ['Fidelity', 'NormalEquations', 'solve_normal_equations', 'dual_fit']

Fidelity = Tuple[float, float]


class NormalEquations:
    """ The ridge least-squares fit of `U v ~ Z` per group, from rows (sampled positions) added batch by batch.

    While the rows are fewer than the features they are kept as they are: such a fit is solved in its dual
    form, on the `n x n` products of its rows, and the features no row reaches (the kernel taps that only read
    padding, as in the last stage of a small input) are left out of it. Beyond that they are pooled into
    products of at least as many rows as features (or `pool_rows`; each product reads and writes all of `U^T U`)
    and summed into `U^T U` and `U^T Z`, of which only the blocks on and above the diagonal are computed. Sums
    and products are in the features' dtype, at least float32 (float32: the GEMMs at about four times float64's
    speed, exact to about 1e-6 of their terms, far inside the ridge); the solve is in float64.
    """

    # blocks of 384 leave about 0.6 of a 2306-feature product to compute (1024: 0.7, a 1154-feature one 0.9) and
    # still run at the GEMM's peak: 6% off ResNet-50's conversion at 32x32, 3% at 224x224
    def __init__(self, pool_rows: int = 4096, block: int = 384):
        self.pool_rows, self.block = pool_rows, block
        self._pending: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._pending_rows = 0
        self._gram = self._cross = self.target_sq = None
        self.count = 0

    def add(self, u: torch.Tensor, z: torch.Tensor) -> None:
        dtype = torch.promote_types(u.dtype, torch.float32)  # a half-precision model's features: summed in float32
        self._pending.append((u.to(dtype), z.to(dtype)))
        self._pending_rows += u.shape[1]
        sq = z.double().square().sum((1, 2))
        self.target_sq = sq if self.target_sq is None else self.target_sq + sq
        self.count += u.shape[1]
        if self.count >= u.shape[-1] and self._pending_rows >= min(self.pool_rows, u.shape[-1]):
            self._flush()

    def _take_pending(self) -> Tuple[torch.Tensor, torch.Tensor]:
        u = torch.cat([u for u, _ in self._pending], 1)
        z = torch.cat([z for _, z in self._pending], 1)
        self._pending, self._pending_rows = [], 0
        return u, z

    def _flush(self) -> None:
        if not self._pending:
            return
        u, z = self._take_pending()
        if self._gram is None:
            self._gram = u.new_zeros(u.shape[0], u.shape[2], u.shape[2])
            self._cross = u.new_zeros(u.shape[0], u.shape[2], z.shape[-1])
        with _float32_highest():
            self._cross.baddbmm_(u.transpose(1, 2), z)
            _add_symmetric_product(self._gram, u.transpose(1, 2), self.block)

    def fit(self, v0: torch.Tensor, ridge: float, free_last: bool) -> Tuple[torch.Tensor, Fidelity, Fidelity]:
        """ `v = argmin |U v - Z|^2 + lambda |v - v0|^2`, `lambda = ridge * mean diag(U^T U)`, the last row (a
        constant feature) free if asked; returns `v` and the (relative error, cosine) of `v0` and of `v`.
        """
        k = v0.shape[1]
        if self._gram is None:  # every row is still a row: fewer than the features, or a single pool
            u, z = self._take_pending()
            lam = ridge * u.square().sum((1, 2)).double() / k
            read = u.ne(0).any(1).any(0)
            if read.all():
                return self._fit_read(u, z, v0, lam, free_last)
            v = v0.clone()
            v[:, read], before, after = self._fit_read(u[..., read], z, v0[:, read], lam, free_last)
            return v, before, after
        self._flush()
        lam = ridge * self._gram.diagonal(dim1=1, dim2=2).sum(1).double() / k
        return solve_normal_equations(self._gram, self._cross, self.target_sq, v0, lam, free_last, self.block)

    def _fit_read(self, u, z, v0, lam, free_last) -> Tuple[torch.Tensor, Fidelity, Fidelity]:
        if u.shape[1] < u.shape[2]:
            return dual_fit(u, z, self.target_sq, v0, lam, free_last, self.block)
        self._pending = [(u, z)]
        self._flush()
        return solve_normal_equations(self._gram, self._cross, self.target_sq, v0, lam, free_last, self.block)



@contextlib.contextmanager
def _float32_highest():
    """float32's own precision for the sums, whatever a training script set (TF32 or bf16 products would lose
    three digits); restored after."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision('highest')
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _blocks(k: int, block: int) -> List[slice]:
    edges = list(range(0, k, block)) + [k]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


def _add_symmetric_product(out: torch.Tensor, a: torch.Tensor, block: int) -> None:
    """`out += a a^T` (batched) on and above the diagonal, in blocks of `block` rows: the product is symmetric."""
    blocks = _blocks(out.shape[-1], block)
    for i, rows in enumerate(blocks):
        for columns in blocks[i:]:
            out[:, rows, columns].baddbmm_(a[:, rows], a[:, columns].transpose(1, 2))


def _symmetric(upper: torch.Tensor, block: int) -> torch.Tensor:
    """The float64 matrix whose blocks on and above the diagonal are `upper`'s (`_add_symmetric_product`)."""
    full = upper.to(torch.float64, copy=True)
    blocks = _blocks(full.shape[-1], block)
    for i, rows in enumerate(blocks):
        for columns in blocks[i + 1:]:
            full[:, columns, rows] = full[:, rows, columns].transpose(1, 2)
    return full


def _fidelity(fit_sq: torch.Tensor, inner: torch.Tensor, target_sq: torch.Tensor) -> Fidelity:
    """Relative error and cosine similarity of a fit to its target, from `|fit|^2`, `<fit, target>`, `|target|^2`."""
    target_sq = target_sq.sum().clamp_min(1e-30)  # a zero target: a zero-initialised gain
    fit_sq, inner = fit_sq.sum(), inner.sum()
    err_sq = (fit_sq - 2 * inner + target_sq).clamp_min(0)
    return (err_sq / target_sq).sqrt().item(), (inner / (fit_sq * target_sq).sqrt().clamp_min(1e-30)).item()


def _ridge(lam: torch.Tensor, k: int, free_last: bool) -> torch.Tensor:
    """The (groups, K) diagonal of the penalty: `lambda` per group, 0 on a free last row."""
    penalty = torch.ones(k, dtype=torch.float64, device=lam.device)
    if free_last:
        penalty[-1] = 0
    return lam.clamp_min(1e-12).view(-1, 1) * penalty


def _cholesky_solve(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve a symmetric positive (semi-)definite system: Cholesky, at half LU's cost; LU where it is not definite
    (no row reached a free constant feature) and the system is solvable all the same."""
    factor, info = torch.linalg.cholesky_ex(system)
    if info.any():
        return torch.linalg.solve(system, rhs)
    return torch.cholesky_solve(rhs, factor)


def solve_normal_equations(gram_upper, cross, target_sq, v0, lam, free_last, block) -> Tuple[
        torch.Tensor, Fidelity, Fidelity]:
    """The fit from the sums: `(U^T U + diag(reg)) v = U^T Z + reg v0`; both errors from the sums alone."""
    system = _symmetric(gram_upper, block)
    cross = cross.double()
    before = _fidelity(v0 * (system @ v0), v0 * cross, target_sq)
    reg = _ridge(lam, system.shape[-1], free_last)
    system.diagonal(dim1=1, dim2=2).add_(reg)
    v = _cholesky_solve(system, cross + reg.unsqueeze(-1) * v0)
    gram_v = cross + reg.unsqueeze(-1) * (v0 - v)  # U^T U v, from the normal equations themselves
    return v, before, _fidelity(v * gram_v, v * cross, target_sq)


def dual_fit(u, z, target_sq, v0, lam, free_last, block) -> Tuple[torch.Tensor, Fidelity, Fidelity]:
    """ The fit from fewer rows than features, on the rows' `n x n` products:
    `v = v0 + U^T (U U^T + lambda I)^-1 (Z - U v0)`. A free last row (a constant feature) is the mean of what the
    others leave of `Z`: the rest is fitted on centred rows.
    """
    def quality(v):
        fit = u @ v.to(u.dtype)
        return _fidelity(fit.double().square(), (fit * z).double(), target_sq)

    with _float32_highest():
        before = quality(v0)
        a, w0, target = u, v0, z
        if free_last:
            a, w0 = u[..., :-1], v0[:, :-1]
            a_mean, z_mean = a.mean(1, keepdim=True), z.mean(1, keepdim=True)
            a, target = a - a_mean, z - z_mean
        residual = (target - a @ w0.to(a.dtype)).double()
        products = a.new_zeros(a.shape[0], a.shape[1], a.shape[1])
        _add_symmetric_product(products, a, block)
        system = _symmetric(products, block)
        system.diagonal(dim1=1, dim2=2).add_(_ridge(lam, system.shape[-1], free_last=False))
        w = w0 + (a.transpose(1, 2) @ _cholesky_solve(system, residual).to(a.dtype)).double()
        v = torch.cat([w, (z_mean - a_mean @ w.to(a.dtype)).double()], 1) if free_last else w
        return v, before, quality(v)
