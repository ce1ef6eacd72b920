"""What each cause of a wrong step asks the user to do: the remedies the step's rules (judge.py) and causes
(signature.py) offer, one sentence each."""

from __future__ import annotations

SEED_REMEDY = (
    "give every rank of a CP group the same inputs: seed noise and timesteps by the data-parallel rank "
    "(e.g. torch.Generator().manual_seed(seed + dp_rank)), never by the global rank"
)
LOSS_REMEDY = "compute the loss on the full (gathered) model output, identically on every CP rank"
SHARD_LOSS_REMEDY = (
    "compute the loss on the full gathered output on every CP rank (diffusers' _cp_plan gathers it), or normalise "
    "each shard's loss by the full token count"
)
CP_SUM_REMEDY = (
    "sum the parameter gradients over the CP group after backward (dist.all_reduce(p.grad, op=SUM, group=cp_group), "
    "the group of the model's CP mesh), then average over the data-parallel ranks only; or multiply the loss by cp "
    "where a reduction averages over the CP ranks (DDP or FSDP over a mesh that includes them)"
)
DP_REMEDY = "average the gradients over the data-parallel ranks (DDP over the data-parallel group, or all_reduce then divide by dp)"
ATTENTION_REMEDY = "cpdoctor.patch() before the first step (cpdoctor.preflight(...) does it when the fix is exact)"
RNG_REMEDY = (
    "make every CP rank draw the same random numbers in the same order (same generator seeded by the data-parallel "
    "rank; no rank-only draws such as dropout or logging samples between seeding and the step); `cpdoctor env` "
    "measures whether the attention op itself consumes RNG"
)
TWO_RUNS_REMEDY = (
    "two runs decide, with the same code without CP and with it (nothing read): `cpdoctor step path/to/train.py:fn{layout}` "
    "with a function that takes its degrees, or `cpdoctor step{layout} -- <your launch command>`"
)
LAYOUT_SCALE_REMEDY = (
    "look for a scaling of the loss or of the gradients that depends on the layout (a division by the world size or by "
    "this rank's token count): the same code without CP does not apply it"
)
LOSS_SCALE_REMEDY = (
    "or tell the watcher the loss's factor of the degrees: watch_step(model, loss_scale=...) or preflight(model=..., loss_scale=...)"
)
SKIP_REMEDY = "nothing to do for this step: the next step the optimizer takes is examined (preflight's armed watch re-arms)"
