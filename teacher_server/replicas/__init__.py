"""Data-parallel replicas on one host (``--data-parallel-size N``): N engines, each in a
process of its own on its own GPU (or TP group), behind the one HTTP front of the server.

``ReplicaPool`` stands where the single ``AsyncEngine`` stands (same ``score`` / drain /
shutdown surface), routes each request with ``teacher_server.routing`` and keeps one queue
per replica; ``Replica`` is the front's handle on one process; ``worker`` runs inside it.
"""
