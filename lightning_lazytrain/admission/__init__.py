"""Admission control: count host RAM, GPU and disk bytes before step 1 and refuse what cannot fit (``count.py``:
the arithmetic, for any machine; ``measure.py``: what a built executor holds)."""

from lightning_lazytrain.admission.count import PRECISIONS, admission_report, check_admission, host_bytes_per_param
from lightning_lazytrain.admission.measure import admission, optimizer_state_bytes_per_param
from lightning_lazytrain.tier_report import AdmissionReport, TierUsage

__all__ = ["PRECISIONS", "AdmissionReport", "TierUsage", "admission", "admission_report", "check_admission",
           "host_bytes_per_param", "optimizer_state_bytes_per_param"]
