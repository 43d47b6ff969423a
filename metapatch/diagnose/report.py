"""The shape of a diagnosis: :class:`Report` and its :class:`Finding`\ s, and the metapatch patch each
finding names, found through the records (``Patch.diagnoses`` lists the finding codes a patch fixes)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

# Every code a check reports (metapatch.diagnose's docstring says what each means).
CODES = ("meta-unfilled", "no-hf-device-map", "model-device-meta", "tied-split", "skip-keys-missing",
         "quant-state-meta", "offloaded")

ERROR, WARNING, INFO = "error", "warning", "info"
_SHOWN = 8  # names listed per finding in the text report (all of them are in to_dict())


@dataclass
class Finding:
    code: str
    severity: str
    summary: str
    items: List[str] = field(default_factory=list)
    fix: str = ""
    patch: Optional[str] = None
    patch_state: Optional[str] = None

    def lines(self) -> List[str]:
        out = [f"[{self.severity}] {self.code}: {self.summary}"]
        if self.items:
            shown = ", ".join(self.items[:_SHOWN])
            more = f" (and {len(self.items) - _SHOWN} more)" if len(self.items) > _SHOWN else ""
            out.append(f"    {shown}{more}")
        if self.patch:
            out.append(f"    metapatch fix: {self.patch} ({self.patch_state or 'not shipped in this build'})")
        if self.fix:
            out.append(f"    what to do: {self.fix}")
        return out


@dataclass
class Report:
    model_class: str
    devices: Dict[str, int]  # device -> number of parameters there (meta counted as "meta")
    has_hf_device_map: bool
    findings: List[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No error or warning findings (info findings, such as offloaded modules, are fine)."""
        return not any(f.severity in (ERROR, WARNING) for f in self.findings)

    def codes(self) -> List[str]:
        return [f.code for f in self.findings]

    def finding(self, code: str) -> Optional[Finding]:
        return next((f for f in self.findings if f.code == code), None)

    def to_dict(self) -> Dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **{"indent": 2, **kwargs})

    def __str__(self) -> str:
        devices = ", ".join(f"{d}: {n}" for d, n in self.devices.items()) or "no parameters"
        out = [f"metapatch diagnosis of {self.model_class}",
               f"  parameters per device: {devices}",
               f"  hf_device_map: {'present' if self.has_hf_device_map else 'absent'}"]
        if not self.findings:
            out.append("  no problems found")
        for finding in self.findings:
            out.extend("  " + line for line in finding.lines())
        out.append("  verdict: " + ("ok" if self.ok else "problems found"))
        return "\n".join(out)


def fixing_patch(code: str) -> "tuple[Optional[str], Optional[str]]":
    """(id, state here) of the patch whose record says it fixes findings ``code``: the first in
    status order that applies to this install (not ``not-affected``), else the first one declaring it
    (a sibling for other releases is still the right name to search for)."""
    from metapatch._framework.registry import shared_registry

    registry = shared_registry()
    declaring = [row for row in registry.status()
                 if code in getattr(registry.patches.get(row["id"]), "diagnoses", ())]
    chosen = next((row for row in declaring if row["state"] != "not-affected"), declaring[0] if declaring else None)
    return (chosen["id"], chosen["state"]) if chosen else (None, None)


def with_patch(finding: Finding, code: Optional[str] = None) -> Finding:
    """``finding`` naming the patch that fixes findings ``code`` (its own code unless given)."""
    patch_id, state = fixing_patch(code or finding.code)
    if patch_id:
        finding.patch, finding.patch_state = patch_id, state
    return finding
