"""The settings of ``policy=adaptive``."""

from __future__ import annotations

from dataclasses import dataclass, field

TIE_ORDER = ("reroute", "reconfigure", "restart")
"""The order in which adaptive's candidates break ties, by the name each offers itself under (``Roles.candidate``):
reroute (ReCycle), reconfigure (Oobleck), restart (checkpoint-restart from whatever the protection holds: memory with
protection=reft, storage with storage). It only orders them: the candidates are the policies that offer themselves
(``ftlab.policies.catalog``), and one not named here comes after these, by its policy's name."""


@dataclass
class AdaptiveConfig:
    """Each candidate runs with its own policy's default settings, but for those it shares by name with these, which
    it takes from here (``fault_threshold`` is Oobleck's, ``solver`` ReCycle's)."""

    _target_: str = "ftlab.policies.adaptive.policy.Adaptive"
    name: str = "adaptive"
    candidates: list[str] = field(default_factory=list)
    """Which candidates to choose among (reroute, reconfigure, restart, and any other policy that offers itself as
    one); empty: every one that applies to the job (restart needs a protection that keeps state; reroute and
    reconfigure move layers, which ZeRO-1 forbids)."""
    mtbf_steps: float = 100.0
    """Steps expected until the next membership change when the fault schedule gives no rate (an explicit list)."""
    review_every: int = 10
    """Review the running plan after every this many committed steps of it, and leave it without a failure for a
    candidate's plan (reroute or reconfigure, in place, no step lost) when that is predicted to cost less over the
    steps expected until the next change; 0: never."""
    fault_threshold: int = 1
    """The reconfigure candidate's (Oobleck's) f: simultaneous node failures its pipelines survive in place."""
    solver: str = "list"
    """The reroute candidate's (ReCycle's) scheduler: list or milp (``policy=recycle``'s ``solver``)."""


SCHEMAS = {"policy": AdaptiveConfig}
