"""memstrata.operator: the FineTuneJob controller (run by `memstrata operator`).

Pure decisions — node selection (placement), the state machine (lifecycle, conditions),
the objects of an attempt (render) — and a thin edge: Kopf registrations (handlers), a
keyed work queue (workqueue) under the reconciler, and a small async API client (kube).
"""
