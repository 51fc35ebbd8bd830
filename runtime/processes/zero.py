"""ZeRO-1 on the runtime (``train.zero: 1``), and REFT's AOR on top of it.

Each group of replicas (the holders of the same layers) splits its optimizer state. The group's parameters are laid
end to end in one flat buffer, padded to the members times q elements (``snapshot_layout.Geometry``: the same
chunks as a snapshot's shards), and member i owns chunk i. An iteration reduce-scatters the gradient bucket (member i
receives the sum of chunk i); the commit steps AdamW on chunk i only, then all-gathers the chunks into every
member's parameters. AdamW is element-wise, so this is the update every replica would make on the whole layers (up
to the order of the gradient sums, which the reduce-scatter chooses): the equivalence oracle holds.

The commit is no longer local: a member lost during the all-gather leaves the survivors with their own chunk
stepped and the others not, so they drop their state (``Worker._forget_state``) and the restart that follows
restores the newest saved state: that one committed step is lost, where without ZeRO-1 none is. The coordinator,
which never waits for a commit, has meanwhile sent them the next step or a checkpoint to write: a member without
state answers each with ``Failed`` until the Abort that the lost member's death brings. Layers are never
copied in place under ZeRO-1 (no member holds a layer's whole optimizer state): policies that do
(``Policy.moves_layers``) are refused with it.

**AOR** (Asynchronous Optimizer Recomputing, the paper's Section 4.2). Under ZeRO-1 no member holds a peer's
optimizer chunk, so ARC has nothing to copy. Member i therefore keeps chunk i+1's optimizer state on its host and
advances it every step with the same AdamW, on chunk i+1's gradient (which member i+1 sends it right after the
reduce-scatter) and chunk i+1's parameters as they were before the step. Same kernel, same inputs: the host state is
member i+1's bit for bit, so member i's snapshot holds a copy of member i+1's shard. The recomputation runs on the
worker's host thread, off the critical path, like the snapshot copies (``runtime.state.snapshot``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ftlab.runtime.control.update import Update
from ftlab.runtime.processes.comm import GenerationComm
from ftlab.runtime.core.model_spec import ModelConfig
from ftlab.runtime.training.optim import OptimSettings, layer_optimizer
from ftlab.runtime.state.snapshot import MOMENTS, Flat, GroupState, geometry, member_state
from ftlab.runtime.core.snapshot_layout import Group


def _adamw(param: nn.Parameter, settings: OptimSettings) -> torch.optim.AdamW:
    holder = nn.Module()
    holder.chunk = param
    return layer_optimizer(holder, settings)


class ZeroGroup:
    """One member's part of a group's ZeRO-1 state: the flat parameters, its optimizer chunk, and (AOR) the next
    member's optimizer chunk recomputed on its host."""

    def __init__(
        self, model: ModelConfig, group: Group, member: int, layers: dict[int, nn.Module],
        optimizers: dict[int, torch.optim.Optimizer], settings: OptimSettings, comm: GenerationComm, aor: bool,
    ) -> None:  # fmt: skip
        """Adopt the group's layers, whose whole optimizer state (if any: none before the first step) is in
        ``optimizers``; the caller clears those afterwards."""
        self.group = group
        self.member = member
        self.comm = comm
        self.settings = settings
        g = self.geometry = geometry(model, group)
        c = g.chunk
        full = member_state(model, group, layers, optimizers) if _has_state(group, layers, optimizers) else None
        self.flat = torch.zeros(g.members * c)
        offset = 0
        with torch.no_grad():
            for index in group.layers:
                for p in layers[index].parameters():
                    n = p.numel()
                    self.flat[offset : offset + n].copy_(p.reshape(-1))
                    p.data = self.flat[offset : offset + n].view_as(p)
                    offset += n
        self.param = nn.Parameter(self.flat[member * c : (member + 1) * c])  # an alias: its steps write the flat
        self.param.grad = torch.zeros(c)
        self.optimizer = _adamw(self.param, settings)
        if full is not None:
            self.optimizer.state[self.param] = _chunk_state(full, member, c)
        self.peer = (member + 1) % g.members if aor else None
        if self.peer is not None:
            self.host = nn.Parameter(torch.zeros(c))
            self.host_optimizer = _adamw(self.host, settings)
            # Before the first step the state is what AdamW would create lazily, made now so a snapshot can name it.
            self.host_optimizer.state[self.host] = (
                _chunk_state(full, self.peer, c) if full is not None
                else {"step": torch.tensor(0.0), **{name: torch.zeros(c) for name in MOMENTS}}
            )  # fmt: skip
            self._peer_grads = [torch.zeros(c), torch.zeros(c)]
            self._received = 0
        comm.shard_gradients(group.layers, self.param.grad, self._peer_buffer if self.peer is not None else None)

    def _peer_buffer(self) -> torch.Tensor:
        """Alternate buffers: the recomputation of one step may still read the last while the next arrives."""
        self._received ^= 1
        return self._peer_grads[self._received]

    def step(self, lr: float, update: Update = Update()) -> Callable[[], None] | None:
        """The commit: step this member's chunk (its gradient multiplied by the update's factor) and all-gather the
        parameters; the AOR recomputation to run off the critical path, if any. A skipped step (every member skips
        it) changes nothing but the gradients, which are zeroed."""
        c = self.geometry.chunk
        recompute = None
        if update.skip:
            self.comm.gradient_bucket(self.group.layers).zero_()
            return None
        if update.factor != 1.0:
            self.param.grad.mul_(update.factor)
            if self.peer is not None:  # the next member scales its chunk by the same factor: AOR stays exact
                self._peer_grads[self._received].mul_(update.factor)
        if self.peer is not None:
            before = self.flat[self.peer * c : (self.peer + 1) * c].clone()
            grad = self._peer_grads[self._received]
            recompute = lambda: self._recompute(before, grad, lr)  # noqa: E731
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.comm.all_gather(self.group.layers, self.flat, self.param.detach().clone())
        self.comm.gradient_bucket(self.group.layers).zero_()
        return recompute

    def _recompute(self, params: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
        with torch.no_grad():
            self.host.copy_(params)
        self.host.grad = grad
        for group in self.host_optimizer.param_groups:
            group["lr"] = lr
        self.host_optimizer.step()

    def state(self) -> GroupState:
        """What this member can snapshot: every parameter, its own chunk's moments and (AOR) the next member's."""
        c = self.geometry.chunk
        own = self.optimizer.state[self.param]
        moments = {name: [(self.member * c, own[name])] for name in MOMENTS}
        if self.peer is not None:
            peer = self.host_optimizer.state[self.host]
            for name in MOMENTS:
                moments[name] = sorted([*moments[name], (self.peer * c, peer[name])], key=lambda item: item[0])
        return GroupState(self.geometry, Flat([(0, self.flat)]), {k: Flat(v) for k, v in moments.items()},
                          float(own["step"]))  # fmt: skip

    def gather(self, layers: dict[int, nn.Module]) -> dict[int, torch.optim.Optimizer]:
        """Every member's chunk gathered (a collective: every member calls it): an optimizer per layer of the group
        with its whole state, as a checkpoint stores it."""
        c, m = self.geometry.chunk, self.geometry.members
        own = self.optimizer.state[self.param]
        full = {}
        for name in MOMENTS:
            full[name] = torch.zeros(m * c)
            self.comm.all_gather(self.group.layers, full[name], own[name].detach().clone())
        optimizers = {}
        offset = 0
        for index in self.group.layers:
            optimizer = layer_optimizer(layers[index], self.settings)
            for p in layers[index].parameters():
                n = p.numel()
                optimizer.state[p] = {"step": own["step"].clone(),
                                      **{k: v[offset : offset + n].view_as(p).clone() for k, v in full.items()}}  # fmt: skip
                offset += n
            optimizers[index] = optimizer
        return optimizers


def _has_state(group: Group, layers: dict[int, nn.Module], optimizers: dict[int, torch.optim.Optimizer]) -> bool:
    return any(optimizers[i].state for i in group.layers)


def _chunk_state(full: GroupState, index: int, c: int) -> dict[str, torch.Tensor]:
    state = {"step": torch.tensor(full.step, dtype=torch.float32)}
    for name in MOMENTS:
        chunk = torch.zeros(c)
        for offset, values in full.moments[name].pieces(index * c, (index + 1) * c):
            chunk[offset : offset + values.numel()].copy_(values)
        state[name] = chunk
    return state
