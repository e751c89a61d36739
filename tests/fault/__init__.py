"""The fault suite: real processes killed and stalled while Triage works, nothing lost.

`python -m tests.fault.fault_suite` runs the full suite by hand (minutes);
`test_fault_suite.py` is its shortened form that every CI run repeats.
"""
