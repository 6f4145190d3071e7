"""Preference optimisation's losses: a model learns from pairs of answers to one prompt, one preferred ("chosen") and
one not ("rejected"), without a reward model.

Each loss reads four numbers a pair: the summed log-probabilities of the chosen and the rejected answer's tokens under
the model being trained (the policy, pi) and under a frozen reference (the model before, pi_ref), and the answers'
token counts |y|:

    DPO    (Rafailov et al., 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward Model",
           eq. 7): the implicit reward of an answer is r = beta log(pi(y) / pi_ref(y)); the loss is the logistic loss
           of the chosen answer's reward beating the rejected one's,
               -log sigmoid(r_chosen - r_rejected)
    IPO    (Azar et al., 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences",
           eq. 17): a squared loss that pulls the margin of the log-ratios to 1 / (2 tau) instead of to infinity, so
           a pair the model already separates stops pushing (DPO's overfits deterministic preferences),
               (h - 1 / (2 beta))^2,  h = log-ratio of chosen / |y_chosen| - log-ratio of rejected / |y_rejected|
           with each log-ratio averaged over its answer's tokens, as TRL computes it and as IPO's authors confirmed
           their results were computed
    SimPO  (Meng et al., 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward", eq. 6): no
           reference model; the reward is the policy's average log-probability a token, and the chosen answer must
           beat the rejected one by a margin gamma,
               -log sigmoid(beta (log pi(y_c) / |y_c| - log pi(y_r) / |y_r|) - gamma)

The metrics are TRL's: the rewards of each side (DPO's beta log-ratio; SimPO's beta times the average log-probability;
IPO reports DPO's), their margin (chosen minus rejected, averaged over pairs) and the reward accuracy (the share of
pairs whose chosen answer has the higher reward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import Tensor
from torch.nn import functional as F

from llmkit.models.loss import answer_logps

__all__ = ["Pairs", "PreferenceLoss", "answer_logps", "preference_loss"]

PreferenceLoss = Literal["dpo", "ipo", "simpo"]


@dataclass(frozen=True)
class Pairs:
    """Per pair (shape (B,)): the summed log-probabilities of the chosen and the rejected answers and their token
    counts."""

    chosen: Tensor
    rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor


def preference_loss(
    kind: PreferenceLoss, policy: Pairs, reference: Pairs | None, beta: float, gamma: float = 0.0
) -> dict[str, Tensor]:
    """The loss averaged over the pairs, and the metrics (module docstring). `reference` is None for SimPO only."""
    if kind == "simpo":
        chosen = beta * policy.chosen / policy.chosen_tokens.clamp(min=1)
        rejected = beta * policy.rejected / policy.rejected_tokens.clamp(min=1)
        losses = -F.logsigmoid(chosen - rejected - gamma)
    else:
        if reference is None:
            raise ValueError(f"{kind} needs the reference model's log-probabilities")
        chosen_ratio, rejected_ratio = policy.chosen - reference.chosen, policy.rejected - reference.rejected
        chosen, rejected = beta * chosen_ratio, beta * rejected_ratio
        if kind == "dpo":
            losses = -F.logsigmoid(chosen - rejected)
        else:
            h = chosen_ratio / policy.chosen_tokens.clamp(min=1) - rejected_ratio / policy.rejected_tokens.clamp(min=1)
            losses = (h - 1 / (2 * beta)) ** 2
    chosen, rejected = chosen.detach(), rejected.detach()
    return {
        "loss": losses.mean(),
        "reward_chosen": chosen.mean(),
        "reward_rejected": rejected.mean(),
        "reward_margin": (chosen - rejected).mean(),
        "reward_accuracy": (chosen > rejected).float().mean(),
    }
