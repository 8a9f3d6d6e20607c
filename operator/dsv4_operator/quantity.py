"""Kubernetes resource quantities as numbers: the API server stores `nvidia.com/gpu: 4` as "4" and
`cpu: 1000m` as "1", so a live object compared with the manifest the operator built must compare
quantities by value, not by spelling."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any, Optional

_SUFFIX = {
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "Pi": 1024**5,
    "Ei": 1024**6,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_FORM = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:[eE]([+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)$")
# Keys whose values are quantities: a container's resources.limits/requests maps, an emptyDir's sizeLimit.
QUANTITY_MAPS = ("limits", "requests")
QUANTITY_FIELDS = ("sizeLimit",)


def quantity_value(value: Any) -> Optional[Decimal]:
    """Pure: the number a quantity stands for (`"1Gi"` -> 1073741824), None if it is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    m = _FORM.match(str(value).strip())
    if not m:
        return None
    number = Decimal(m[1])
    if m[2] is not None:
        return number * Decimal(10) ** int(m[2])
    return number * Decimal(_SUFFIX[m[3] or ""])


def same_quantity(live: Any, wanted: Any) -> bool:
    a, b = quantity_value(live), quantity_value(wanted)
    return a is not None and a == b
