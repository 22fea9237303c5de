"""Accuracy metrics the field uses, always against exact FP32 attention."""
import torch


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    denom = a.norm() * b.norm()
    if denom == 0:
        return 1.0 if torch.equal(a, b) else 0.0
    return float((a @ b) / denom)


def rel_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    """sum|a - b| / sum|b|, with b the exact result."""
    a, b = a.double(), b.double()
    denom = b.abs().sum()
    return float((a - b).abs().sum() / denom) if denom > 0 else float((a - b).abs().sum())


def psnr(a: torch.Tensor, b: torch.Tensor, peak: float = None) -> float:
    """PSNR of a against b in dB; peak defaults to b's value range."""
    a, b = a.double(), b.double()
    mse = float(((a - b) ** 2).mean())
    if peak is None:
        peak = float(b.max() - b.min()) or 1.0
    return float("inf") if mse == 0 else 10.0 * torch.log10(torch.tensor(peak * peak / mse)).item()
