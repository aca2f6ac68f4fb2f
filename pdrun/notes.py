"""Notes pdrun gives before training: what a run will do that its user may not expect.

Each is one line on stderr, on rank 0, said once the plan and options are checked
(``pdrun.launch.check``); none stops the run.
"""

from __future__ import annotations

from pdrun.config import RunConfig
from shared.plan import Plan

# Heavy-ball momentum at or above which a 2bw run is told about its delay: there the stable step is
# under a sixth of the undelayed one's (two_bw_momentum_note).
TWO_BW_MOMENTUM = 0.5


def delayed_stable_share(momentum: float) -> float:
    """The largest stable step of heavy-ball SGD with its gradient one step late, over the undelayed one's.

    On a quadratic of curvature h, heavy-ball SGD with momentum m and its gradient one step late
    (``W(t+1) = W(t) - lr grad f(W(t-1))``, Narayanan et al., ICML'21) has the characteristic
    polynomial z^2 - (1 + m) z + (m + lr h): stable while lr h < 1 - m. Without the delay the
    bound is lr h < 2 (1 + m).
    """
    return (1 - momentum) / (2 * (1 + momentum))


def two_bw_momentum_note(plan: Plan, cfg: RunConfig) -> str | None:
    """A note for 2BW under SGD with high momentum, whose one-step-late gradient makes it unstable
    (:func:`delayed_stable_share`)."""
    if plan.schedule != "2bw" or cfg.optimizer != "sgd" or cfg.momentum < TWO_BW_MOMENTUM:
        return None
    share = delayed_stable_share(cfg.momentum)
    return (
        f"pdrun: note: 2bw applies every gradient one step late; under --momentum {cfg.momentum:g} that "
        f"is stable only below about {share:.1%} of the learning rate training without the delay takes "
        "(docs/pdrun.md, 2bw). PipeDream-2BW trains with --optimizer adam; lower momentum or "
        "--lr-schedule cosine also keep it stable"
    )


def validation_note(plan: Plan, cfg: RunConfig, has_val: bool) -> str | None:
    """A note for a run asked to validate whose dataset takes no ``split``: validation does nothing."""
    if not cfg.validate or has_val:
        return None
    return (
        f"pdrun: note: no validation: {plan.spec.data} takes no split argument (pdrun validates on "
        "split='val' of a dataset callable that takes one, docs/pdrun.md); --no-val silences this"
    )


def cluster_note(plan: Plan, source: str) -> str | None:
    """A note for a plan whose recorded cluster has another number of workers than it has ranks (a plan
    edited by hand): pdrun runs its ranks, but its predictions are for that cluster."""
    mismatch = plan.cluster_mismatch()
    if mismatch is None:
        return None
    return (
        f"pdrun: note: {source}: {mismatch}; this run has {plan.world_size} ranks and the plan's "
        "predictions are for the cluster (`pdplan validate` refuses such a plan; re-plan, or remove cluster)"
    )


EDITED = "the plan was edited after pdplan predicted it"


def edited_note(plan: Plan, source: str) -> str | None:
    """A note for a plan changed by hand since pdplan predicted it (``Plan.edited_since_predicted``): its
    predictions are for the layout pdplan wrote, so the run's summary leaves them out."""
    if not plan.edited_since_predicted():
        return None
    return (
        f"pdrun: note: {source}: {EDITED} (its stages, schedule, microbatches or cluster changed); its "
        f"predictions are for the layout pdplan wrote and the summary leaves them out; `pdplan show {source} "
        "--graph GRAPH` predicts this one"
    )
