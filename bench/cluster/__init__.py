"""Ranks together: AFD decode over NCCL, the expert-parallel exchange, NCCL pairs, the planner against live groups,
recorded SLO traces."""
