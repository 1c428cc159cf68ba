"""The claims tools/reproduce.py measures, one `Claim` each: what the paper says, the runs it needs, the function
that measures it (returning plain data for the report, its comparisons judged by `squad.reproduce.verdicts`), and
optionally its post-training jobs for ``--parallel``.

The measurements live by subject: `squad.reproduce.claims_modsquad` (modsquad-table2, pruning, mi-vs-balance),
`squad.reproduce.claims_transfer` (router-finetune, pascal-table3), `squad.reproduce.claims_budget` (amod-table3,
mone-budget); what they share (baselines, the gate, curves, plateaus) is `squad.reproduce.measure`. In every claim the
first comparisons are its parts (co-primary: the claim is reproduced when every part holds, partly reproduced when only
some do); the others are secondary (Holm-corrected), and controls are reported apart. Results computed after training
are cached beside the runs with the settings they were made with (`squad.reproduce.specs.cached`), and a cached result
made with other settings is computed again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from squad.reproduce.claims_budget import amod_specs, measure_amod, measure_mone, mone_specs
from squad.reproduce.claims_curve import curve_specs, measure_curve
from squad.reproduce.claims_modsquad import (
    measure_mi_vs_balance,
    measure_pruning,
    measure_table2,
    mi_specs,
    table2_specs,
)
from squad.reproduce.claims_transfer import (
    finetune_jobs,
    finetune_specs,
    measure_pascal,
    measure_router_finetune,
    pascal_specs,
)
from squad.reproduce.parallel import Job
from squad.reproduce.runs import RunSpec
from squad.reproduce.specs import Context, method_spec, stl_specs
from squad.reproduce.verdicts import RULE, VERDICTS

__all__ = ["CLAIMS", "RULE", "VERDICTS", "Claim", "resolve_claims"]


@dataclasses.dataclass(frozen=True)
class Claim:
    """A claim: what the paper says, where, the runs it needs, the function that measures it, and (optionally) its
    post-training jobs that ``--parallel`` runs in processes of their own before it is measured."""

    name: str
    source: str
    statement: str
    parts: str  # the parts (co-primary comparisons) that together decide the verdict, in words
    specs: Callable[[Context], list[RunSpec]]
    measure: Callable[[Context], dict]
    jobs: Callable[[Context], list[Job]] | None = None


CLAIMS: dict[str, Claim] = {c.name: c for c in [
    Claim("modsquad-table2", "Mod-Squad (Chen et al., CVPR 2023), Table 2",
          "Δt(Mod-Squad) > Δt(M3ViT) > Δt(MTL) > 0 against single-task models (the cost side is reported beside; "
          "an MTL + task embedding control apart).",
          "Δt(Mod-Squad) > Δt(MTL); Δt(MTL) > 0; Δt(Mod-Squad) > 0", table2_specs, measure_table2),
    Claim("table2-curve", "Mod-Squad, Table 2 (the Mean row: MTL +2.8, Mod-Squad +5.6 over STL at convergence)",
          "The multi-task models' gap to single-task models closes with training: Δt rises with the steps "
          "(a learning curve over the scale's budgets, each a run of its own).",
          "Δt(Mod-Squad) per doubling of the steps > 0; Δt(MTL) per doubling > 0", curve_specs, measure_curve),
    Claim("pruning", "Mod-Squad, Table 2 (pruned row) and Fig. 3",
          "At θ = 0.01 the extracted single-task models keep the full model's Δt with ≤ 60 % of its parameters "
          "(counted like with like: each with the task's head only); judged at the paper's θ and along a θ curve at "
          "the first setting that keeps ≤ 60 %.",
          "at θ = 0.01 and at the first θ keeping ≤ 60 %: Δt(extracted) ≥ Δt(full model) − 1; largest share ≤ 0.60",
          lambda ctx: [s for seed in ctx.seeds for s in [*stl_specs(ctx, seed), method_spec(ctx, "modsquad", seed)]],
          measure_pruning),
    Claim("router-finetune", "Mod-Squad, Fig. 4",
          "Learning a new task from little data, fine-tuning only its routers (and head) beats training the head, "
          "the whole model, or a linear probe, at every data fraction (same budget and stopping rule for every "
          "mode).",
          "router > full fine-tuning; > training the head; > a linear probe (means over the learnable held-out tasks "
          "and fractions)",
          finetune_specs, measure_router_finetune, finetune_jobs),
    Claim("mi-vs-balance", "Mod-Squad, Fig. 5 and §4.4",
          "The mutual-information loss gives sparser, more task-specific expert use than a balance loss over all "
          "tasks (the paper's modified MoE), at equal or better Δt (a per-task balance loss beside).",
          "I(T;E)(MI loss) > I(T;E)(balance over all tasks); Δt(MI loss) ≥ Δt(balance over all tasks) − 1",
          mi_specs, measure_mi_vs_balance),
    Claim("amod-table3", "A-MoD (Gadhikar et al., 2024), Table 3",
          "Turning a trained dense model into MoD, attention routing keeps more of its metric than a learned router, "
          "and recovers faster when fine-tuned (the learned router trained the same steps; its untrained form, a "
          "random initialisation, beside).",
          "after the same fine-tune: Δt(attention routing) > Δt(learned router); mean over the fine-tune: the same",
          amod_specs, measure_amod),
    Claim("mone-budget", "MoNE (Jain et al., NeurIPS 2024), Fig. 5",
          "One model trained with e_c sampled per step serves every compute budget close to models trained at that "
          "budget, and its forward time falls with e_c.",
          "mean over the budgets: Δt(adaptive) ≥ Δt(trained at the budget) − 2; forward time at the lowest e_c < at "
          "e_c 1", mone_specs, measure_mone),
    Claim("pascal-table3", "Mod-Squad, Table 3 (PASCAL-Context)",
          "On PASCAL-Context's 5 tasks, Mod-Squad beats single-task models (Δm > 0; the paper: +4.72) and MTL, and "
          "the pruned model (every task extracted at θ = 0.01) keeps its Δm with ≤ 60 % of the parameters "
          "(the paper: 50 M → 22 M at the same metrics). Plumbing only on the synthetic stand-in.",
          "none (plumbing only on synthetic data)", pascal_specs, measure_pascal),
]}


def resolve_claims(names: Sequence[str]) -> list[str]:
    """Claim names in the order given (``all``: every claim), without repeats.

    Raises:
        ValueError: an unknown name (the claims are listed).
    """
    out: list[str] = []
    for name in names:
        if name == "all":
            out.extend(CLAIMS)
        elif name in CLAIMS:
            out.append(name)
        else:
            raise ValueError(f"unknown claim {name!r}; claims: {', '.join(CLAIMS)}, all")
    return list(dict.fromkeys(out))
