"""The experiment harness: quickstart, the leave-one-subject-out study, the torch-free job
process, memory probes and the torch blocker.

Kept apart from the bundle format and the executors: nothing in ``edgeadapt.runtime``,
``edgeadapt.sched`` or ``edgeadapt.export`` imports it.
"""
