"""The optimizer a server runs on its own pieces.

Dense pieces use torch's `SGD` (with momentum) or `Adam` on the fp32 shard tensors: both are element-wise,
so a shard's update is exactly the update those elements get in one process holding the whole model.

Sparse pieces are updated only at the rows a step touched ("lazy"):

* SGD without momentum: exactly dense SGD (an untouched row has a zero gradient).
* SGD with momentum: a touched row's buffer is ``m * buf + g`` and moves the row; an untouched row's
  buffer neither decays nor moves it (TensorFlow's lazy momentum; dense momentum would keep moving it).
* Adam: torch's `SparseAdam` formula: moments of touched rows only, bias correction from the piece's
  step count (one per update, touched or not), ``eps`` added to ``sqrt(v)``.
"""

from __future__ import annotations

import math

import torch

from .sharding import Piece

__all__ = ["ShardOptimizer"]


class ShardOptimizer:
    """Update a server's pieces from one step's gradient.

    Args:
        pieces: the server's pieces.
        values: the fp32 tensor of each piece, by parameter name (updated in place).
        optimizer: ``"sgd"`` or ``"adam"``.
        lr, momentum, betas, eps: the optimizer's settings (momentum for SGD; betas and eps for Adam).
    """

    def __init__(self, pieces: list[Piece], values: dict[str, torch.Tensor], optimizer: str, *, lr: float,
                 momentum: float, betas: tuple[float, float], eps: float) -> None:
        self.values = values
        self.optimizer, self.lr, self.momentum, self.betas, self.eps = optimizer, lr, momentum, betas, eps
        self.dense = [p.name for p in pieces if not p.sparse]
        self.sparse = [p.name for p in pieces if p.sparse]
        dense_tensors = [values[n] for n in self.dense]
        self._torch = None
        if dense_tensors:
            if optimizer == "sgd":
                self._torch = torch.optim.SGD(dense_tensors, lr=lr, momentum=momentum)
            else:
                self._torch = torch.optim.Adam(dense_tensors, lr=lr, betas=betas, eps=eps)
        self.state: dict[str, dict[str, torch.Tensor | int]] = {}

    def step(self, dense: dict[str, torch.Tensor], sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One update: `dense` maps a dense piece to its gradient (the piece's shape); `sparse` maps a
        sparse piece to ``(rows, gradient rows)``, rows unique local indices."""
        if self._torch is not None:
            for name in self.dense:
                self.values[name].grad = dense.get(name)  # (None: no worker's step reached it)
            self._torch.step()
            for name in self.dense:
                self.values[name].grad = None
        for name in self.sparse:
            rows, grad = sparse[name]
            if self.optimizer == "sgd":
                self._sgd_rows(name, rows, grad)
            else:
                self._adam_rows(name, rows, grad)

    def _sgd_rows(self, name: str, rows: torch.Tensor, grad: torch.Tensor) -> None:
        param = self.values[name]
        update = grad
        if self.momentum:
            if name not in self.state:  # (not setdefault: that would allocate a table-sized buffer every step)
                self.state[name] = {"momentum_buffer": torch.zeros_like(param)}
            buf = self.state[name]["momentum_buffer"]
            update = buf[rows].mul_(self.momentum).add_(grad)
            buf[rows] = update
        param.index_add_(0, rows, update, alpha=-self.lr)

    def _adam_rows(self, name: str, rows: torch.Tensor, grad: torch.Tensor) -> None:
        param = self.values[name]
        if name not in self.state:
            self.state[name] = {"step": 0, "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
        state = self.state[name]
        state["step"] += 1
        beta1, beta2 = self.betas
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        old_avg, old_sq = exp_avg[rows], exp_avg_sq[rows]
        avg_update = grad.sub(old_avg).mul_(1 - beta1)
        sq_update = grad.pow(2).sub_(old_sq).mul_(1 - beta2)
        exp_avg.index_add_(0, rows, avg_update)
        exp_avg_sq.index_add_(0, rows, sq_update)
        numer = avg_update.add_(old_avg)
        denom = sq_update.add_(old_sq).sqrt_().add_(self.eps)
        step_size = self.lr * math.sqrt(1 - beta2 ** state["step"]) / (1 - beta1 ** state["step"])
        param.index_add_(0, rows, numer.div_(denom), alpha=-step_size)

    def state_dict(self) -> dict:
        """The optimizer state of the pieces (for checkpoints)."""
        return {"torch": self._torch.state_dict() if self._torch else None, "rows": self.state}

    def piece_state(self) -> dict[str, dict[str, torch.Tensor | int | float]]:
        """Each piece's optimizer state by parameter name (the live tensors, not copies): torch's state of
        a dense piece (``momentum_buffer``; ``step``, ``exp_avg``, ``exp_avg_sq``), the lazy state of a
        sparse one. A piece not updated yet has none."""
        state: dict[str, dict] = {}
        if self._torch is not None:
            for name in self.dense:
                held = self._torch.state.get(self.values[name])
                if held:
                    state[name] = dict(held)
        state.update({name: dict(held) for name, held in self.state.items()})
        return state

    def hyperparameters(self) -> dict[str, object]:
        """The settings of the update, as torch's param group would hold them (without ``params``)."""
        if self.optimizer == "sgd":
            return {"lr": self.lr, "momentum": self.momentum, "dampening": 0.0, "weight_decay": 0.0,
                    "nesterov": False, "maximize": False}
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": 0.0, "amsgrad": False,
                "maximize": False}

    def load_piece_state(self, state: dict[str, dict[str, torch.Tensor | int | float]]) -> None:
        """Replace the optimizer state of the pieces named in `state` (by parameter name; tensors of the
        piece's shape, Adam's ``step`` a number or a 0-dim tensor). State names the optimizer does not keep
        are an error naming them."""
        keeps = {"sgd": {"momentum_buffer"}, "adam": {"step", "exp_avg", "exp_avg_sq"}}[self.optimizer]
        for name, held in state.items():
            if name not in self.values:
                raise KeyError(f"optimizer state of '{name}': not a piece of this server")
            unknown = sorted(set(held) - keeps)
            if unknown:
                raise ValueError(f"optimizer state of '{name}': {unknown} is not state of {self.optimizer!r} "
                                 f"(it keeps {sorted(keeps)})")
            value = self.values[name]
            entry: dict[str, torch.Tensor | int] = {}
            for key, v in held.items():
                if key == "step":
                    step = float(v)
                    entry[key] = torch.tensor(step) if name in self.dense else int(step)
                elif v is not None:
                    if tuple(v.shape) != tuple(value.shape) and v.numel() != value.numel():
                        raise ValueError(f"optimizer state '{key}' of '{name}': {v.numel()} elements, the piece has "
                                         f"{value.numel()}")
                    entry[key] = v.detach().to(value.device, value.dtype).reshape(value.shape).clone()
            if not entry:
                continue
            if name in self.dense:
                self._torch.state[value] = entry
            else:
                self.state[name] = entry
