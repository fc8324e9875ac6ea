"""Timing: the sampling implementations side by side, training steps per variant, and their reports."""
