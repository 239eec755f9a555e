"""QC: metrics and pass/reject verdicts over frames. Knows nothing of jobs or how a clip was made."""

from clipmill.qc.check import QCConfig, QCResult, check_frames, check_frames_with_series

__all__ = ["QCConfig", "QCResult", "check_frames", "check_frames_with_series"]
