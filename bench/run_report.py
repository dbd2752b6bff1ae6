"""Reading `memfit train --report` JSON, for bench/peers.py and bench/gpt_budget.py."""


def mib(b):
    return f"{b / 2**20:.2f} MiB"


def plan_knobs(plan, batch):
    """The knobs a run's plan turned on, as short phrases (none for no plan or a plain step)."""
    knobs = []
    if plan.get("micro_batch", 0) and plan["micro_batch"] < batch:
        knobs.append(f"micro-batch {plan['micro_batch']}")
    if plan.get("checkpoint", "none") not in ("none", ""):
        knobs.append(f"checkpoint {plan['checkpoint']}")
    if plan.get("selective_recompute", False):
        knobs.append("selective recompute")
    if plan.get("precision", "fp32") != "fp32":
        knobs.append(plan["precision"])
    if plan.get("offload", "none") != "none":
        knobs.append("offload " + plan["offload"])
    return knobs
