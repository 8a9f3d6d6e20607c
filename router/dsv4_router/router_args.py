"""The options of `dsv4 router` as a dataclass (their one declaration: dsv4_wire.router_options)."""

from __future__ import annotations


from dsv4_router.tenancy import TenantLimits
from dsv4_wire.options import dataclass_of
from dsv4_wire.router_options import ROUTER_OPTIONS


def _key_limits(self) -> TenantLimits:
    return TenantLimits(self.key_max_concurrency, self.key_rate_limit, self.key_rate_burst)


RouterArgs = dataclass_of(
    "RouterArgs",
    ROUTER_OPTIONS,
    ["router"],
    doc="The options of dsv4_wire.router_options.",
    namespace={"key_limits": property(_key_limits), "__module__": __name__},
)
