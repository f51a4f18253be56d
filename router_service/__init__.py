"""Gating math for MoE serving: top-k gates, capacity and overflow, dispatch plan, placement, load stats.

Pure torch: no Ray, no torch.distributed.
"""

from router_service.capacity import OverflowPolicy, Routed, apply_capacity, expert_capacity
from router_service.dispatch_plan import DispatchPlan, build_dispatch_plan
from router_service.gating import ExpertLoadStats, GateConfig, Gates, GateStyle, switch_balance_loss, topk_gate
from router_service.placement import Placement, balanced_placement, contiguous_placement

__all__ = ["DispatchPlan", "ExpertLoadStats", "GateConfig", "GateStyle", "Gates", "OverflowPolicy", "Placement",
           "Routed", "apply_capacity", "balanced_placement", "build_dispatch_plan", "contiguous_placement",
           "expert_capacity", "switch_balance_loss", "topk_gate"]
