"""A whole AFD group on one machine: child processes, groups in processes or threads, offline batches.

What `afd generate`, `afd run-batch`, `afd up` and the tests start locally; pods never use it.
"""
