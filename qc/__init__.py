"""Quality control over frames: metrics and pass/reject verdicts. Knows nothing of jobs."""

from qc.check import QCConfig, QCResult, check_frames

__all__ = ["QCConfig", "QCResult", "check_frames"]
